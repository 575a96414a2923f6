"""One model's Prometheus children, resolved once: the engine loop records through these attributes
and never looks a label set up per step (a `labels()` call costs more than the observation)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.engine.messages import MAX_SPECULATIVE_TOKENS
from service.engine.processing.output_processor import TokenMetrics
from service.metrics import ServiceMetrics

if TYPE_CHECKING:
    from service.engine.kv import KVStore
    from service.engine.prompts.prefix_cache import PrefixReuse
    from service.engine.request import Request


class ModelMetrics:
    """Children per cache-policy form this model accepts, created up front: at most six each, and
    every form's series exists (at zero) before its first request."""

    def __init__(self, metrics: ServiceMetrics, model: str, scheme: str, forms: list[str]) -> None:
        labels = {"model": model, "scheme": scheme}
        by_form = {form: {**labels, "policy": form} for form in forms}
        self.gauge_lock = metrics.gauge_lock
        self.tokens = {
            form: TokenMetrics(
                metrics.time_to_first_token.labels(**form_labels),
                metrics.inter_token_latency.labels(**form_labels),
                metrics.generated_tokens.labels(**form_labels),
            )
            for form, form_labels in by_form.items()
        }
        self.step_seconds = {p: metrics.step_duration.labels(**labels, phase=p) for p in ("prefill", "decode")}
        self.batch_size = {p: metrics.batch_size.labels(**labels, phase=p) for p in ("prefill", "decode")}
        self.cancel_latency = metrics.cancellation_latency.labels(**labels)
        self.physical = metrics.kv_cache_physical.labels(**labels)
        self.peak = metrics.kv_cache_physical_peak.labels(**labels)
        self.classes = metrics.kv_cache_classes.labels(**labels)
        self.capacity = metrics.kv_cache_capacity.labels(**labels)
        self.usage = metrics.kv_cache_usage.labels(**labels)
        self.running = metrics.running.labels(**labels)
        self.queued = metrics.queued.labels(**labels)
        self.used = {form: metrics.kv_cache_used.labels(**form_labels) for form, form_labels in by_form.items()}
        self.prompt_tokens = {form: metrics.prompt_tokens.labels(**fl) for form, fl in by_form.items()}
        self.preemptions = metrics.preemptions.labels(**labels)
        self.speculative_proposed = {f: metrics.speculative_proposed.labels(**fl) for f, fl in by_form.items()}
        self.speculative_accepted = {f: metrics.speculative_accepted.labels(**fl) for f, fl in by_form.items()}
        self._accepted_at = [metrics.speculative_accepted_by_position.labels(**labels, position=str(p)) for p in
                             range(1, MAX_SPECULATIVE_TOKENS + 1)]  # fmt: skip
        self._steps = [metrics.speculative_steps.labels(**labels, guesses=str(g)) for g in
                       range(1, MAX_SPECULATIVE_TOKENS + 1)]  # fmt: skip
        self.estimated_ttft = metrics.admission_estimated_ttft.labels(**labels)
        self.estimate_error = metrics.admission_ttft_error.labels(**labels)
        self.shed: dict[tuple[str, str], Any] = {
            (reason, form): metrics.requests_shed.labels(**form_labels, reason=reason)
            for reason in ("ttft_slo", "queue")
            for form, form_labels in by_form.items()
        }

    def speculative_accepted_at(self, position: int) -> Any:
        """The counter of guesses kept at `position` (1-based) of their block."""
        return self._accepted_at[position - 1]

    def speculative_steps(self, guesses: int) -> Any:
        """The counter of verifications of `guesses` guesses."""
        return self._steps[guesses - 1]

    def set_gauges(
        self, store: KVStore, prefix: PrefixReuse, requests: list[Request], running: int, queued: int
    ) -> None:
        """The store's bytes (each policy form's rows and cached blocks), classes, running and
        queued sequences, under the gauge lock: a scrape sees all of one update or none of it."""
        with self.gauge_lock:
            stats = store.stats()
            forms = {request.request_id: request.cache_policy.form for request in requests}
            held = dict.fromkeys(self.used, 0)
            for sequence, nbytes in store.held_bytes().items():
                held[forms[sequence]] += nbytes
            self.usage.set(sum(held.values()) / max(1, store.capacity_bytes))
            for form, nbytes in prefix.held_by_form().items():
                held[form] += nbytes
            prefix.update_gauges()
            for form, gauge in self.used.items():
                gauge.set(held[form])
            self.physical.set(stats.physical_bytes)
            self.peak.set(stats.peak_physical_bytes)
            self.classes.set(stats.classes)
            self.running.set(running)
            self.queued.set(queued)
