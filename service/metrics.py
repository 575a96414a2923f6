"""Every Prometheus metric of the service, defined in one place.

Names follow Prometheus rules: base units (seconds, bytes), `_total` on counters, and the
`posenc_` namespace; every series is labelled by `model` and `scheme`. Series whose values depend
on a request's cache policy (token latencies, tokens, KV bytes held, refusals) carry `policy` too:
the policy's form (contract.cache_policy.FORM_SYNTAX: full, window, sinks, each +int8), never its
numbers, so a model has at most six of each.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# No `*_created` series: one per counter and histogram child (2,260 lines, 207 KB per scrape
# with 15 models), and Prometheus does not use them (process start time dates every counter).
disable_created_metrics()

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Inter-token latency on a CPU is ~1 ms for these models: buckets resolve 0.1 ms to 100 ms.
INTER_TOKEN_BUCKETS = (
    0.0001,
    0.0002,
    0.0003,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Realised minus estimated time to first token: negative when admission control was pessimistic.
ESTIMATE_ERROR_BUCKETS = (-1.0, -0.5, -0.25, -0.1, -0.05, -0.025, 0.0, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LABELS = ("model", "scheme")
POLICY_LABELS = (*LABELS, "policy")  # policy: the form of the request's cache policy (CachePolicy.form)
TENANT_LABELS = (*LABELS, "tenant")  # tenant: a name from --auth-tokens-file ("": no tokens), never a client's


# What the front end (gRPC and HTTP) records itself (RPC accounting, engine restarts); the engine core process
# records every other series, and /metrics serves both (service.metrics_endpoint).
# Requests carried over an engine core restart (service.engine_client), recorded by the front end.
RESUME = ("resumed_requests", "resume_failures", "resume_stall")
# Per tenant (service.quota): the `tenant` label takes only names from --auth-tokens-file ("": no tokens).
TENANT = ("tenant_requests", "tenant_tokens", "tenant_queue_time", "tenant_refusals")
FRONT_END = ("requests", "request_duration", "engine_restarts", "drained", *RESUME, *TENANT)
# Metrics are created unregistered; ServiceMetrics registers its process's share of them itself.
UNREGISTERED = {"registry": None}


class ServiceMetrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        only: tuple[str, ...] | None = None,
        without: tuple[str, ...] = (),
    ) -> None:
        """Every metric, in `registry` (default: prometheus_client's). One process's share: `only`
        these attributes are registered, or all `without` those; the others exist unexported.

        The metrics are defined by family, one method each, in the order /metrics lists them."""
        self.registry = registry if registry is not None else REGISTRY
        # Held while an engine sets its cache gauges and while the exposition is generated, so one
        # scrape never reads used bytes from one update and physical bytes from the one before.
        self.gauge_lock = threading.Lock()
        self._define_requests()
        self._define_tokens()
        self._define_kv_cache()
        self._define_scheduling()
        self._define_lifecycle()
        self._define_speculative()
        self._define_admission()
        self._define_prefix_cache()
        self._define_tenants()
        self._registered = [
            metric for name, metric in vars(self).items() if isinstance(metric, Counter | Gauge | Histogram)
            and (only is None or name in only) and name not in without
        ]  # fmt: skip
        for metric in self._registered:
            self.registry.register(metric)

    def _define_requests(self) -> None:
        """Calls as the front ends saw them: counted, shed, timed."""
        self.requests = Counter(
            "posenc_requests",
            "Calls of either front end, each counted once with the status code its client saw: api=grpc (RPCs of "
            "posenc.v1.Generation) or api=http (the OpenAI-compatible API: method is the path, code the gRPC name "
            "of its HTTP status, so one panel reads both).",
            [*LABELS, "method", "code", "api"], **UNREGISTERED,
        )  # fmt: skip
        self.requests_shed = Counter(
            "posenc_requests_shed",
            "Requests refused at once with RESOURCE_EXHAUSTED: reason=ttft_slo (would miss --ttft-slo-seconds) "
            "or queue (--max-queue full).",
            [*POLICY_LABELS, "reason"], **UNREGISTERED,
        )  # fmt: skip
        self.request_duration = Histogram(
            "posenc_request_duration_seconds", "Request latency from arrival to last token.",
            [*LABELS, "method", "api"], buckets=LATENCY_BUCKETS, **UNREGISTERED,
        )  # fmt: skip

    def _define_tokens(self) -> None:
        """Token latencies and counts, by the form of the request's cache policy."""
        self.time_to_first_token = Histogram(
            "posenc_time_to_first_token_seconds", "Arrival to first generated token.", POLICY_LABELS,
            buckets=LATENCY_BUCKETS, **UNREGISTERED,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "posenc_inter_token_latency_seconds", "Time between consecutive generated tokens.", POLICY_LABELS,
            buckets=INTER_TOKEN_BUCKETS, **UNREGISTERED,
        )  # fmt: skip
        self.prompt_tokens = Counter("posenc_prompt_tokens", "Prompt tokens admitted.", POLICY_LABELS, **UNREGISTERED)
        self.generated_tokens = Counter("posenc_generated_tokens", "Tokens generated.", POLICY_LABELS, **UNREGISTERED)

    def _define_kv_cache(self) -> None:
        """The KV store: bytes held, budget, allocation, capacity classes."""
        self.kv_cache_used = Gauge(
            "posenc_kv_cache_used_bytes",
            "KV-cache bytes held by sequences (their tokens, in whole blocks) and by the prefix cache's blocks, by the "
            "form of their cache policy.",
            POLICY_LABELS, **UNREGISTERED,
        )  # fmt: skip
        self.kv_cache_capacity = Gauge(
            "posenc_kv_cache_capacity_bytes", "KV-cache budget (--kv-cache-bytes, in whole blocks).",
            LABELS, **UNREGISTERED,
        )  # fmt: skip
        self.kv_cache_physical = Gauge(
            "posenc_kv_cache_physical_bytes",
            "Bytes of K/V arrays the KV store has allocated now (rows of every capacity class).",
            LABELS, **UNREGISTERED,
        )  # fmt: skip
        self.kv_cache_physical_peak = Gauge(
            "posenc_kv_cache_physical_peak_bytes",
            "High-water mark of allocated K/V bytes, counting old and new array while a class is re-allocated.",
            LABELS, **UNREGISTERED,
        )  # fmt: skip
        self.kv_cache_classes = Gauge(
            "posenc_kv_cache_classes", "Capacity classes (dense batches, one graph call each) allocated.",
            LABELS, **UNREGISTERED,
        )  # fmt: skip
        self.kv_cache_usage = Gauge(
            "posenc_kv_cache_usage_ratio",
            "Share of the KV-cache budget that running sequences hold, 0 to 1 (the prefix cache's blocks, which "
            "give way to them, not counted): the Gateway API Inference Extension's --kv-cache-usage-percentage-metric.",
            LABELS, **UNREGISTERED,
        )  # fmt: skip

    def _define_scheduling(self) -> None:
        """The batch: who runs and waits, step sizes and times, cancellations, preemptions."""
        self.running = Gauge("posenc_running_sequences", "Sequences in the running batch.", LABELS, **UNREGISTERED)
        self.queued = Gauge("posenc_queued_sequences", "Requests waiting for admission.", LABELS, **UNREGISTERED)
        self.batch_size = Histogram(
            "posenc_batch_size", "Sequences per engine step.", [*LABELS, "phase"], buckets=BATCH_BUCKETS, **UNREGISTERED
        )
        self.step_duration = Histogram(
            "posenc_step_duration_seconds", "Engine step time by phase.", [*LABELS, "phase"],
            buckets=STEP_BUCKETS, **UNREGISTERED,
        )  # fmt: skip
        self.cancellation_latency = Histogram(
            "posenc_cancellation_latency_seconds", "From a cancel (client or deadline) to the sequence's cache freed.",
            LABELS, buckets=LATENCY_BUCKETS, **UNREGISTERED,
        )  # fmt: skip
        self.preemptions = Counter("posenc_preemptions", "Sequences preempted for cache space.", LABELS, **UNREGISTERED)

    def _define_lifecycle(self) -> None:
        """The front end's own: engine core restarts, the drain, requests carried over a restart."""
        self.engine_restarts = Counter(
            "posenc_engine_restarts",
            "Engine core processes started again after one exited unexpectedly (its accepted requests resume there).",
            **UNREGISTERED,
        )  # fmt: skip
        self.drained = Gauge(
            "posenc_drained",
            "1 once the server has drained on SIGTERM: no call runs and every counter holds its final value "
            "(it waits for one scrape of them, --final-scrape-seconds, before it exits).", **UNREGISTERED,
        )  # fmt: skip
        # Requests carried over an engine core restart.
        self.resumed_requests = Counter(
            "posenc_resumed_requests",
            "Accepted requests resubmitted to a restarted engine core with the tokens they had produced.",
            **UNREGISTERED,
        )  # fmt: skip
        self.resume_failures = Counter(
            "posenc_resume_failures",
            "Accepted requests ended with UNAVAILABLE because their engine core died and they could not be resumed "
            "(too many deaths, refused by the new core, or no core came back).", **UNREGISTERED,
        )  # fmt: skip
        self.resume_stall = Histogram(
            "posenc_resume_stall_seconds",
            "Time to first token after a restart: from the engine core's death to a resumed request's next token.",
            buckets=LATENCY_BUCKETS, **UNREGISTERED,
        )  # fmt: skip

    def _define_speculative(self) -> None:
        """Speculative decoding (--speculative-tokens): guesses verified and kept, and where in the block."""
        self.speculative_proposed = Counter(
            "posenc_speculative_proposed_tokens",
            "Speculative guesses (draft tokens) verified, by the form of the request's cache policy.",
            POLICY_LABELS, **UNREGISTERED,
        )  # fmt: skip
        self.speculative_accepted = Counter(
            "posenc_speculative_accepted_tokens",
            "Speculative guesses kept (each saved one decode step), by the form of the request's cache policy.",
            POLICY_LABELS, **UNREGISTERED,
        )  # fmt: skip
        self.speculative_accepted_by_position = Counter(
            "posenc_speculative_accepted_by_position",
            "Speculative guesses kept at each position of their block (1: the first guess); over "
            "posenc_speculative_steps_total it is the acceptance rate at that position.",
            [*LABELS, "position"], **UNREGISTERED,
        )  # fmt: skip
        self.speculative_steps = Counter(
            "posenc_speculative_steps",
            "Requests' verifications of one or more speculative guesses, by how many guesses they verified.",
            [*LABELS, "guesses"], **UNREGISTERED,
        )  # fmt: skip

    def _define_admission(self) -> None:
        """Admission control's estimate beside what happened (--ttft-slo-seconds; admitted requests only)."""
        self.admission_estimated_ttft = Histogram(
            "posenc_admission_estimated_ttft_seconds",
            "Time to first token admission control expected for each request it admitted (calibrated estimate; "
            "same buckets as posenc_time_to_first_token_seconds).",
            LABELS, buckets=LATENCY_BUCKETS, **UNREGISTERED,
        )  # fmt: skip
        self.admission_ttft_error = Histogram(
            "posenc_admission_ttft_error_seconds",
            "Realised minus estimated time to first token of admitted requests (negative: the estimate was "
            "pessimistic).",
            LABELS, buckets=ESTIMATE_ERROR_BUCKETS, **UNREGISTERED,
        )  # fmt: skip

    def _define_prefix_cache(self) -> None:
        """The prefix cache (--prefix-cache): prompt tokens looked up and found, blocks kept and evicted."""
        self.prefix_cache_queried_tokens = Counter(
            "posenc_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.", LABELS, **UNREGISTERED
        )
        self.prefix_cache_hit_tokens = Counter(
            "posenc_prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache (their K/V copied, not computed).", LABELS, **UNREGISTERED,
        )  # fmt: skip
        self.prefix_cache_bytes = Gauge(
            "posenc_prefix_cache_bytes",
            "Bytes of the prefix cache's blocks (inside the KV budget; counted in used and physical bytes too).",
            LABELS, **UNREGISTERED,
        )  # fmt: skip
        self.prefix_cache_evictions = Counter(
            "posenc_prefix_cache_evictions",
            "Prefix-cache blocks evicted, least recently used first, to make room for rows or newer blocks.",
            LABELS, **UNREGISTERED,
        )  # fmt: skip

    def _define_tenants(self) -> None:
        """Per tenant (service.quota): requests, tokens, queue time and refusals; `tenant` is a name from
        --auth-tokens-file ("" without tokens), never a client's string."""
        self.tenant_requests = Counter(
            "posenc_tenant_requests", "Generations accepted, by tenant.", TENANT_LABELS, **UNREGISTERED
        )
        self.tenant_tokens = Counter(
            "posenc_tenant_tokens", "Tokens of ended generations by tenant: kind=prompt or completion.",
            [*TENANT_LABELS, "kind"], **UNREGISTERED,
        )  # fmt: skip
        self.tenant_queue_time = Histogram(
            "posenc_tenant_queue_seconds",
            "From arrival to admission into the running batch, by tenant (fair scheduling shares it out).",
            TENANT_LABELS, buckets=LATENCY_BUCKETS, **UNREGISTERED,
        )  # fmt: skip
        self.tenant_refusals = Counter(
            "posenc_tenant_refusals",
            "Generations refused, by tenant and reason: max_concurrent or tokens_per_minute (the tenant's limits), "
            "ttft_slo or queue (the server's load shedding), invalid (a bad request) or unavailable.",
            [*TENANT_LABELS, "reason"], **UNREGISTERED,
        )  # fmt: skip

    def exposition(self) -> bytes:
        """The registry in the text format, consistent with each engine's gauge updates."""
        with self.gauge_lock:
            return generate_latest(self.registry)

    def unregister(self) -> None:
        for metric in self._registered:
            self.registry.unregister(metric)
