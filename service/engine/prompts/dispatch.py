"""Where a scheduled prompt is computed, and what it leaves behind (engine thread): the prefix cache's
K/V of its leading tokens and its reused segments go with it; a prefix-cache hit with a short tail left
goes to the tail worker, every other prompt to the prefill worker (prefill.py); once joined, its blocks
and segments are kept for the prompts after it. The engine loop (service/engine/model_engine.py) only
hands admitted requests over and joined prompts back."""

from __future__ import annotations

from collections.abc import Callable

from contract.manifest import Manifest
from service.engine.messages import EngineConfig
from service.engine.prompts.prefill import PrefillJob, PrefillResult, PrefillWorker, TailWorker
from service.engine.prompts.prefix_cache import PrefixMetrics, PrefixReuse
from service.engine.prompts.segments import SegmentAssembly, SegmentReuser
from service.engine.request import Request
from service.engine.worker.runner import ModelRunner
from service.metrics import ServiceMetrics


class PromptDispatch:
    """One model's prompts between admission and their rows: the prefix cache, reused segments and the
    two workers that compute them."""

    def __init__(
        self,
        manifest: Manifest,
        config: EngineConfig,
        runner: ModelRunner,
        metrics: ServiceMetrics,
        deliver: Callable[[list[PrefillResult]], None],
        observe: Callable[[float, int, int], None],
        nothing_decodes: Callable[[], bool],
    ) -> None:
        """`deliver`: computed prompts back to the engine loop (any thread); `observe`: a prompt call's
        figures; `nothing_decodes`: a hint for the tail worker that no running sequence waits on it."""
        store, name = runner.store, manifest.name
        labels = {"model": name, "scheme": manifest.scheme}
        self.prefix = PrefixReuse(store, name, config.prefix_cache, PrefixMetrics.of(metrics, labels))
        assembly = SegmentAssembly(runner, manifest.segment_reuse, config.prefill_tokens)
        self.segments = SegmentReuser(store, name, assembly)
        self.prefill_worker = PrefillWorker(
            runner, config.prefill_tokens, deliver, observe, name, config.prefill_nice,
            fair=config.scheduling == "fair",
        )  # fmt: skip
        # Prefix-cache hits with a short tail left, and light tenants' short prompts, go to a thread of
        # their own (TailWorker).
        light = config.light_prefill_tokens if config.scheduling == "fair" and config.tenants > 1 else 0
        wanted = (config.tail_prefill_tokens > 0 and config.prefix_cache) or light > 0
        tails = wanted and runner.prompt_sessions.open_tail()
        self._tail_tokens = config.tail_prefill_tokens if tails and config.prefix_cache else 0
        self._light_tokens = light if tails else 0
        self.tail_worker = TailWorker(runner, deliver, observe, name, nothing_decodes)

    def start(self) -> None:
        self.prefill_worker.start()
        self.tail_worker.start()

    def stop(self) -> None:
        self.prefill_worker.stop()
        self.tail_worker.stop()

    def submit(self, admitted: list[Request]) -> None:
        """Admitted requests' prompts, each to its worker with what the caches hold of it."""
        tails: list[PrefillJob] = []
        queued: list[PrefillJob] = []
        submitting: set[str] = set()  # tenants of the jobs routed so far in this call
        for job in (self._job(request) for request in admitted):
            light = self._light(job, submitting)
            (tails if light or self._short_tail(job) else queued).append(job)
            submitting.add(job.request.tenant)
        for worker, jobs in ((self.tail_worker, tails), (self.prefill_worker, queued)):
            if jobs:
                worker.submit(jobs)

    def keep(self, joined: list[PrefillResult]) -> None:
        """Prompts just joined leave their blocks (and reusable segments) in the prefix cache."""
        for result in joined:
            request = result.job.request
            self.prefix.keep(request, result.prompt, self.segments.exact_tokens(request))  # type: ignore[arg-type]
            self.segments.keep(request, result.prompt)  # type: ignore[arg-type]

    def _short_tail(self, job: PrefillJob) -> bool:
        """A prefix-cache hit with at most `tail_prefill_tokens` left to compute (TailWorker's)."""
        return job.past is not None and job.compute is None and 0 < job.computed_tokens <= self._tail_tokens

    def _light(self, job: PrefillJob, submitting: set[str]) -> bool:
        """A light tenant's short prompt (fair scheduling, TailWorker's): a whole prompt of at most
        `light_prefill_tokens` from a tenant with no other prompt submitted or being computed, while the
        prefill worker holds another tenant's. Behind that worker's call in flight and its batch the
        prompt waited 5x its solo first token beside a noisy tenant's 48 streams; here it waits for
        nothing, and a tenant sending many prompts at once never has them all taken here."""
        tenant = job.request.tenant
        return (
            0 < len(job.token_ids) <= self._light_tokens
            and job.past is None and job.compute is None and not job.run.streams
            and tenant not in submitting
            and not self.tail_worker.holds(tenant) and not self.prefill_worker.holds(tenant)
            and self.prefill_worker.holds()
        )  # fmt: skip

    def _job(self, request: Request) -> PrefillJob:
        """Its prompt, with what the prefix cache holds of it and its reused segments."""
        past = self.prefix.take(request, self.segments.hit_tokens(request))
        return PrefillJob(request, request.attempt, request.prefill_ids, past, self.segments.compute(request, past))
