"""One model's engine loop: schedule -> execute -> process outputs, one step after another on its own
thread, streaming each request's new text back through its output sink.

The roles, as vLLM v1 splits them: the input processor (defaults, tokens, the checks that need the
model; every field was checked where the front end handed the request over) runs on the caller's
thread before a request reaches the loop; the scheduler decides who runs and
reserves their rows in the KV store; the prompt dispatch (prompts/dispatch.py) hands admitted
prompts, with what the prefix cache and reused segments hold of them, to the workers whose runner
calls compute them; the runner computes decode steps; the output processor turns logits into
tokens, text and stops.
Requests arrive through a small inbox. Cancellation and deadlines are honoured at the next
step boundary, where the sequence's row is freed. A step is a full one (`_full_step`) or, while
the last full step's batch holds (SteadyBatch), a steady one that skips reaping and scheduling.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract.manifest import Manifest
from service.engine.messages import DrainReport, EngineConfig, ErrorKind, RequestError, RequestStatus
from service.engine.model_metrics import ModelMetrics
from service.engine.model_policies import policy_forms
from service.engine.processing.input_processor import InputProcessor
from service.engine.processing.output_processor import Finished, OutputBatch, OutputProcessor
from service.engine.prompts.dispatch import PromptDispatch
from service.engine.prompts.prefill import PrefillResult
from service.engine.request import Request
from service.engine.sampler import Sampler, all_greedy, logprobs_by_row
from service.engine.sched.admission import AdmissionControl, Backlog, open_trace
from service.engine.sched.fair import WaitingQueue
from service.engine.sched.scheduler import QueueFullError, Scheduler, SchedulerOutput
from service.engine.sched.step_observer import StepObserver
from service.engine.spec_decode.speculator import Speculator
from service.engine.worker.decode_plan import DecodePlan
from service.engine.worker.runner import ModelRunner, StoreConfig
from service.engine.worker.store_size import sequence_limit
from service.metrics import ServiceMetrics

logger = logging.getLogger(__name__)

# Gauges (cache bytes, running, queued) are refreshed this often while busy, and whenever idle.
GAUGE_INTERVAL_SECONDS = 0.02


@dataclass
class SteadyBatch:
    """The batch the last full step decoded, while nothing that could change it has happened (new
    requests, computed prompts, cancels, a stop: the engine's `_changed`; a request finishing; a
    deadline; a row filling). Steps in it skip reaping and scheduling, and feed one decode plan."""

    requests: list[Request]
    plan: DecodePlan  # its decode calls, resolved once
    steps: int  # fast steps left before a sequence needs a wider row
    until: float  # its earliest deadline

    def holds(self, changed: bool, now: float) -> bool:
        return self.steps > 0 and not changed and now < self.until


class ModelEngine:
    """Everything that serves one model."""

    def __init__(
        self,
        manifest: Manifest,
        config: EngineConfig,
        metrics: ServiceMetrics,
        publish: Callable[[Callable[[OutputBatch], None], OutputBatch], None] | None = None,
        runner: ModelRunner | None = None,
    ) -> None:
        """`publish(deliver, batch)`: how a step's outputs reach the output processor's client half
        (`deliver`): inline by default; the engine core hands them to its publisher thread, which
        delivers them while the next step's graph runs (service.engine.core.StepOutputs). `runner`:
        the model's runner and its KV store, made here from the manifest by default (a test passes a
        fake one: onnxruntime-genai's "lowest layer that proves the behaviour")."""
        self.manifest = manifest
        self.config = config
        self.runner = runner or ModelRunner(
            manifest,
            StoreConfig(config.kv_cache_bytes, config.block_size, sequence_limit(manifest, config)),
            config.device,
            config.threads,
            config.kv_backend,
            open_prefill_session=False,
            attention=config.attention,
        )
        self.store = self.runner.store
        waiting = WaitingQueue(config.scheduling, config.tenant_weights)
        self.scheduler = Scheduler(self.store, config.max_batch_size, config.max_queue, waiting=waiting)
        # (its prefix_blocks: below)
        trace = open_trace(Path(config.admission_trace), manifest.folder.name) if config.admission_trace else None
        self.admission = AdmissionControl(config.ttft_slo_seconds, config.max_batch_size, trace)
        self._admission_trace = trace
        self._backlog = Backlog()  # what is ahead of a new request, as of the last step
        self.inputs = InputProcessor.of(manifest, config, self.store.max_tokens)
        self.policy_forms = policy_forms(manifest)
        self.metrics = ModelMetrics(metrics, manifest.name, manifest.scheme, self.policy_forms)
        self.observer = StepObserver(self.metrics, self.admission)
        self.outputs = OutputProcessor(self.inputs.eos_token_id, self.metrics.tokens, on_stop=self.wake)
        self._inbox: list[Request] = []
        self._prefilled: list[PrefillResult] = []  # from the worker, written into the store at the next step
        self._gauges_due = 0.0  # the next gauge update (full steps and steady steps alike)
        self._housekeeping_due = 0.0  # the next trim of spare rows and stale bindings (full steps)
        # Something the loop must look at arrived (new requests, computed prompts, cancels, a stop):
        # the next step is a full one, whatever batch is steady.
        self._changed = True
        self._steady: SteadyBatch | None = None  # the fast path's batch, while it holds (step)
        # The prefix cache, reused segments and the workers that compute prompts (prompts/dispatch.py).
        deliver, observe = self._deliver_prefilled, self.observer.prefill
        self.prompts = PromptDispatch(manifest, config, self.runner, metrics, deliver, observe, self._nothing_decodes)
        self.prefix = self.prompts.prefix
        self.scheduler.prefix_blocks = self.prefix.blocks_of
        self._wake = threading.Condition()
        self.sampler = Sampler()
        # Speculative decoding (service.engine.spec_decode): for requests whose parameters ask for guesses.
        self.speculator = Speculator.of(config, self.runner.verifier, self.sampler, self.metrics)
        # What the current step produced (tokens, finishes, observations), published when the step ends.
        self._batch = OutputBatch()
        self._publish = publish or (lambda deliver, batch: deliver(batch))
        self._stopping = False  # no new requests
        self._stopped = False  # the loop exits
        self._thread = threading.Thread(target=self._loop, name=f"engine-{manifest.name}", daemon=True)
        self.metrics.capacity.set(self.store.capacity_bytes)
        self._update_gauges(time.monotonic())

    @property
    def max_sequence_tokens(self) -> int:
        return self.store.max_tokens

    # ------------------------------------------------------------------ requests in

    def submit(self, request: Request) -> None:
        with self._wake:
            if self._stopping:
                raise RequestError(ErrorKind.UNAVAILABLE, "server is shutting down")
            waiting = len(self.scheduler.waiting) + len(self._inbox)
            if waiting >= self.config.max_queue:
                self.metrics.shed["queue", request.cache_policy.form].inc()
                retry_after = self.admission.queue_retry_after(waiting)
                raise RequestError(
                    ErrorKind.RESOURCE_EXHAUSTED,
                    f"queue: {waiting} requests waiting for model {self.manifest.name!r} "
                    f"(max_queue={self.config.max_queue}); retry after {retry_after:.2f} s",
                    retry_after=retry_after,
                )
            if self.admission.enabled:  # the inbox's prompt tokens are summed only when they are used
                inbox_tokens = sum(len(r.prefill_ids) - r.cached_prompt_tokens for r in self._inbox)
                prompt_tokens = len(request.prefill_ids) - self.prefix.peek(request)
                weight = self.scheduler.waiting.weight(request.tenant)
                try:
                    request.admission_estimate = self.admission.check(
                        request.request_id,
                        prompt_tokens,
                        self._backlog.seen_by(request.tenant, prompt_tokens, weight),  # its tenant's share
                        inbox_tokens,
                        len(self._inbox),
                        self.manifest.name,
                    )
                except RequestError:
                    self.metrics.shed["ttft_slo", request.cache_policy.form].inc()
                    raise
            self._inbox.append(request)
            self.speculator.admit(request)
            self._changed = True
            self._wake.notify()

    def wake(self) -> None:
        """Something the loop must look at (a cancellation): the next step is a full one."""
        with self._wake:
            self._changed = True
            self._wake.notify()

    # ------------------------------------------------------------------ the loop

    def start(self) -> None:
        self.prompts.start()
        self._thread.start()

    def stop(self, timeout: float) -> DrainReport:
        """Refuse new work, let running work finish within `timeout`, then cancel the rest."""
        with self._wake:
            self._stopping = True
            in_flight = [*self.scheduler.requests(), *self._inbox]
            self._changed = True
            self._wake.notify()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self.scheduler.has_work or self._inbox):
            time.sleep(0.01)
        with self._wake:
            for request in self._inbox:
                request.finish(RequestStatus.FINISHED_SHUTDOWN, "server shut down")
            self._inbox.clear()
        self._stopped = True
        with self._wake:
            self._changed = True
            self._wake.notify()
        self._thread.join(timeout=5)
        self.prompts.stop()
        if self._admission_trace is not None:
            self._admission_trace.close()
        cut = sum(1 for r in in_flight if r.status is RequestStatus.FINISHED_SHUTDOWN)
        return DrainReport(len(in_flight) - cut, cut)

    def _deliver_prefilled(self, results: list[PrefillResult]) -> None:
        with self._wake:
            self._prefilled.extend(results)
            self._changed = True
            self._wake.notify()

    def _loop(self) -> None:
        busy = False
        while True:
            changed = False
            # Busy with nothing new (an arrival sets `_changed` under the lock): no lock this step.
            if not busy or self._changed:
                with self._wake:
                    # Idle (nothing decoding, or only prompts in the worker): sleep until new work,
                    # a computed prompt or a cancellation; the timeout keeps deadlines honoured.
                    if not busy and not self._inbox and not self._prefilled and not self._stopped:
                        self._wake.wait(timeout=0.05)
                    if self._stopped:
                        break
                    for request in self._inbox:
                        try:
                            self.scheduler.add(request)
                        except QueueFullError as error:
                            request.finish(RequestStatus.FINISHED_ERROR, str(error))
                    self._inbox.clear()
                    changed, self._changed = self._changed, False
            try:
                busy = self.step(changed)
            except Exception:  # a bug must not kill the loop silently
                logger.exception("engine step failed for %s", self.manifest.name)
                busy = False
            self._hand_over()
        for request in self.scheduler.requests():
            self._finish(request, RequestStatus.FINISHED_SHUTDOWN, "server shut down")
        self._hand_over()

    def _hand_over(self) -> None:
        """The step's outputs are published (nothing when the step produced nothing)."""
        if self._batch:
            batch, self._batch = self._batch, OutputBatch()
            self._publish(self.outputs.deliver, batch)

    def step(self, changed: bool = True) -> bool:
        """One iteration, down one of two paths: while the last full step's batch holds steady
        (SteadyBatch) and nothing arrived (`changed`), it decodes again at once (`_decode_steady`);
        otherwise a full step (`_full_step`). False when it found nothing to run (the loop may sleep)."""
        steady = self._steady
        if steady is not None and steady.holds(changed, time.monotonic()):
            self._decode_steady(steady)
            return True
        self._steady = None
        return self._full_step()

    def _full_step(self) -> bool:
        """Reap aborted, write computed prompts, schedule, decode, process outputs; then note whether
        the batch it decoded is steady."""
        self._reap_aborted()
        with self._wake:
            prefilled, self._prefilled = self._prefilled, []
        joined = self._join(prefilled)
        if joined:
            # First tokens go out now, not after this step's decode; then the prompts' blocks are
            # kept in the prefix cache (copies that no first token should wait for).
            self._hand_over()
            self.prompts.keep(joined)
        output = self.scheduler.schedule()
        self._snapshot_backlog()
        if output.preempted:
            self.metrics.preemptions.inc(len(output.preempted))
        if output.admitted:
            self._start_prefill(output.admitted)
        if output.decode:
            self._decode(output.decode)
        busy = bool(joined or output.decode)
        now = time.monotonic()
        if not busy or now >= self._housekeeping_due:  # every step would cost a small step a few percent
            self.store.trim()  # classes left mostly spare by leavers give rows back
            self.runner.forget_calls()
            self._housekeeping_due = now + GAUGE_INTERVAL_SECONDS
            self._update_gauges(now)
        self._hold_steady(output, len(joined))
        return busy

    def _hold_steady(self, output: SchedulerOutput, joined: int) -> None:
        """After a full step: the batch it decoded is steady when every running sequence decoded
        and none finished, nothing waits or joined, and the store is as it was (until the next
        deadline): its decode plan is resolved once, for every step it holds."""
        running = self.scheduler.running
        if (
            joined
            or output.admitted
            or output.preempted
            or self.scheduler.waiting
            or not output.decode
            or len(output.decode) != len(running)
            or any(r is not s for r, s in zip(output.decode, running, strict=True))
        ):
            return
        deadlines = [r.deadline for r in running if r.deadline is not None]
        requests = running[:]
        plan = self.runner.plan_decode([r.request_id for r in running])  # the store holds still
        steps = self.scheduler.steady_steps(requests)
        self._steady = SteadyBatch(requests, plan, steps, min(deadlines, default=math.inf)) if steps > 0 else None

    def _reap_aborted(self) -> None:
        now = time.monotonic()
        for request in self.scheduler.requests():
            if request.detokenizer.stopped:  # the output processor found a stop string
                self._finish(request, RequestStatus.FINISHED_STOP)
            elif request.cancelled.is_set():
                self._finish(request, RequestStatus.FINISHED_CANCELLED, "cancelled by the client")
            elif request.deadline is not None and now >= request.deadline:
                request.cancel_time = request.deadline
                self._finish(request, RequestStatus.FINISHED_DEADLINE, "deadline exceeded")

    def _start_prefill(self, admitted: list[Request]) -> None:
        now = time.monotonic()
        for request in admitted:
            if request.attempt == 0:
                request.scheduled_time = now
                self.metrics.prompt_tokens[request.cache_policy.form].inc(len(request.prompt_ids))
        self.prompts.submit(admitted)

    def _nothing_decodes(self) -> bool:
        """No running request has its prompt computed (read by the tail worker's thread: a list the
        engine thread may change meanwhile, so a hint, never a guarantee)."""
        return not any(request.prefill_done for request in list(self.scheduler.running))

    def _join(self, results: list[PrefillResult]) -> list[PrefillResult]:
        """Computed prompts are written into their rows; first tokens are sampled. Returns those joined."""
        ready = []
        for result in results:
            request = result.job.request
            if request.status.finished or request.attempt != result.job.attempt:
                continue  # finished or preempted meanwhile: its row is already free
            if result.error is not None:
                self._fail([request], result.error)
            elif result.prompt is not None:  # None: given up (cancel or deadline, reaped here)
                ready.append(result)
        if not ready:
            return []
        for result in ready:
            assert result.prompt is not None
            if result.prompt.policy is None:
                result.prompt.policy = self.store.layout.row_eviction(result.job.request.cache_policy)
        try:
            self.runner.join([r.prompt for r in ready])  # type: ignore[misc]
        except Exception as error:
            self._fail([r.job.request for r in ready], error)
            return []
        requests = [r.job.request for r in ready]
        for request in requests:
            request.num_computed_tokens = request.prefill_length
        # After a preemption the next token is already known: no sample.
        fresh = [row for row, r in enumerate(requests) if not r.output_ids]
        if fresh:
            logits = np.stack([ready[row].prompt.logits for row in fresh])  # type: ignore[union-attr]
            self._sample([requests[row] for row in fresh], logits)
            self.observer.first_tokens([requests[row] for row in fresh])
        return ready

    def _snapshot_backlog(self) -> None:
        """What is ahead of a new request as of this step, for admission control (when it is on)."""
        if self.admission.enabled:
            with self._wake:
                self._backlog = self.scheduler.backlog()

    def _decode_steady(self, steady: SteadyBatch) -> None:
        """Steps of the steady batch back to back, each handing its outputs over, until something
        changes (`_changed`, a finish, a deadline) or a row fills: the loop's fast path, with per
        step only what a step must do (feed, graph, sample, append), and the gauges when due."""
        requests, plan = steady.requests, steady.plan
        greedy, snapshot = all_greedy(requests), self.admission.enabled
        while True:
            steady.steps -= 1
            if snapshot:
                self._snapshot_backlog()
            self._decode(requests, plan, greedy)
            self._hand_over()
            now = time.monotonic()
            if self._steady is not steady or not steady.holds(self._changed, now):
                return
            if now >= self._gauges_due:  # the store's layout is unchanged: only sizes to report
                self.scheduler.note_growth(requests)
                self._update_gauges(now)

    def _decode(self, requests: list[Request], plan: DecodePlan | None = None, greedy: bool = False) -> None:
        """One graph step for these sequences (every member of the store), through `plan` (the
        steady batch's, or one made here); then each one's next token is sampled (`greedy`: every
        one is, known beforehand), and those it ends (or whose sampling failed) are finished. A step
        where some request guesses its next tokens verifies them instead (`_decode_speculative`)."""
        if self.speculator.active and any(request.draft is not None for request in requests):
            fed = self.speculator.drafts(requests, self.store.verifies_blocks)
            if fed is not None:
                self._decode_speculative(requests, fed)
            if self.speculator.take_growth():  # more room for guesses: the next step reserves it
                self._steady = None
            if fed is not None:
                return
        started = time.monotonic()
        try:
            plan = plan or self.runner.plan_decode([r.request_id for r in requests])
            logits = self.runner.decode_planned(plan, [r.output_ids[-1] for r in requests])
        except Exception as error:  # fail only the sequences of this call
            self._fail(requests, error)
            return
        now = time.monotonic()
        # Observed where the step's outputs are delivered (the publisher, in the engine core).
        self._batch.records.append((self.observer.decode_step, (now - started, len(requests))))
        for request in requests:
            request.num_computed_tokens = request.num_tokens
        self._sample(requests, logits, now, greedy)

    def _decode_speculative(self, requests: list[Request], fed: list[list[int]]) -> None:
        """One verification call for the batch, then each request keeps its guesses up to the first
        that differs from the token the model itself gives there (sampled as without speculation),
        plus that token: 1 to len(guesses) + 1 tokens, whose K/V alone are written into the store."""
        started = time.monotonic()
        try:
            logits = self.speculator.verify(requests, fed)
        except Exception as error:  # fail only the sequences of this call
            self._fail(requests, error)
            return
        now = time.monotonic()
        flat_requests, flat_tokens, flat_logits = self.speculator.keep(requests, fed, logits)
        self._batch.records.append((self.observer.decode_step, (now - started, len(requests))))
        asking = [row for row, request in enumerate(flat_requests) if request.logprobs is not None]
        logprobs = logprobs_by_row(flat_requests, np.concatenate(flat_logits), flat_tokens, asking) if asking else None
        self._finish_all(self.outputs.accept(flat_requests, flat_tokens, now, self._batch, logprobs))
        for request in requests:
            request.num_computed_tokens = request.num_tokens - 1

    def _sample(
        self, requests: list[Request], logits: np.ndarray, now: float | None = None, greedy: bool = False
    ) -> None:
        """Each request's next token (sampled at `now`: after the graph call); those it ends, or
        whose sampling failed, are finished."""
        tokens = self.sampler.sample_batch(requests, logits, greedy)
        now = time.monotonic() if now is None else now
        asking = [row for row, request in enumerate(requests) if request.logprobs is not None]
        logprobs = logprobs_by_row(requests, logits, tokens, asking) if asking else None
        self._finish_all(self.outputs.accept(requests, tokens, now, self._batch, logprobs))

    def _finish_all(self, finished: list[Finished]) -> None:
        for done in finished:
            self._finish(done.request, done.status, done.error)

    def _fail(self, requests: list[Request], error: Exception) -> None:
        logger.error("model %s: ONNX Runtime failed for %d request(s): %s", self.manifest.name, len(requests), error)
        for request in requests:
            self._finish(request, RequestStatus.FINISHED_ERROR, f"inference failed: {error}")

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """Its row is freed at once; its final event follows its last text (`deliver`)."""
        self._steady = None
        request.status = status  # the loop skips it from now on
        self.scheduler.remove(request)  # frees its row in the store at once
        self.sampler.forget(request.request_id)
        if status in (RequestStatus.FINISHED_CANCELLED, RequestStatus.FINISHED_DEADLINE) and request.cancel_time:
            self.metrics.cancel_latency.observe(time.monotonic() - request.cancel_time)
        self._batch.finishes.append(Finished(request, status, error))

    def _update_gauges(self, now: float) -> None:
        self._gauges_due = now + GAUGE_INTERVAL_SECONDS
        scheduler = self.scheduler
        queued = len(scheduler.waiting) + len(self._inbox)
        self.metrics.set_gauges(self.store, self.prefix, scheduler.requests(), len(scheduler.running), queued)
