"""The engine loop: one thread per model runs schedule -> decode -> sample -> update, and
streams each request's new text back through its output stream.

Requests arrive from gRPC threads through a small inbox. Admitted prompts go to the model's
prefill worker (its own thread and session) and join the decode batch at a step boundary
once computed. Cancellation and deadlines are honoured at the next step boundary, where the
sequence leaves the batch and frees its blocks.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from export.manifest import Manifest, ManifestError
from service.engine.kv_cache import KVCacheManager
from service.engine.prefill import PrefillJob, PrefillResult, PrefillWorker
from service.engine.request import Request, RequestStatus, SamplingParams
from service.engine.runner import ModelRunner
from service.engine.sampler import Sampler
from service.engine.scheduler import QueueFullError, Scheduler
from service.metrics import ServiceMetrics

logger = logging.getLogger(__name__)

# Gauges (cache bytes, running, queued) are refreshed this often while busy, and whenever idle.
GAUGE_INTERVAL_SECONDS = 0.02


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"


class RequestError(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


@dataclass
class EngineConfig:
    kv_cache_bytes: int = 256 * 1024 * 1024  # per model
    block_size: int = 16
    max_batch_size: int = 32
    max_queue: int = 128
    prefill_tokens: int = 512  # prompt tokens per prefill call (longer prompts are chunked)
    max_new_tokens_limit: int = 1024
    default_max_new_tokens: int = 64
    max_sequence_tokens: int = 4096  # prompt + new tokens, for schemes with no hard limit
    device: str = "auto"
    threads: int = 0  # intra-op threads per session (0: half the cores for decode, all for prefill)
    prefill_nice: int = 10  # OS priority drop of the prefill worker thread (0: none)


class ModelEngine:
    """Everything that serves one model."""

    def __init__(self, manifest: Manifest, config: EngineConfig, metrics: ServiceMetrics) -> None:
        self.manifest = manifest
        self.config = config
        self.runner = ModelRunner(manifest, config.device, config.threads, open_prefill_session=False)
        self.kv_cache = KVCacheManager(
            config.kv_cache_bytes, manifest.kv_bytes_per_token(self.runner.dtype), config.block_size
        )
        self.scheduler = Scheduler(self.kv_cache, config.max_batch_size, config.max_queue)
        self.sampler = Sampler()
        self.eos_token_id = int(manifest.tokenizer["eos_token_id"])  # type: ignore[call-overload]
        self.bos_token_id = int(manifest.tokenizer["bos_token_id"])  # type: ignore[call-overload]
        self.add_bos = bool(manifest.tokenizer.get("add_bos", True))
        self.labels = {"model": manifest.name, "scheme": manifest.scheme}
        self.metrics = metrics
        # Labelled children resolved once: per-token metric updates stay cheap.
        self._ttft = metrics.time_to_first_token.labels(**self.labels)
        self._itl = metrics.inter_token_latency.labels(**self.labels)
        self._generated = metrics.generated_tokens.labels(**self.labels)
        self._steps = {
            phase: metrics.step_duration.labels(**self.labels, phase=phase) for phase in ("prefill", "decode")
        }
        self._batches = {
            phase: metrics.batch_size.labels(**self.labels, phase=phase) for phase in ("prefill", "decode")
        }
        self._cancel_latency = metrics.cancellation_latency.labels(**self.labels)
        self._kv_used = metrics.kv_cache_used.labels(**self.labels)
        self._kv_physical = metrics.kv_cache_physical.labels(**self.labels)
        self._running = metrics.running.labels(**self.labels)
        self._queued = metrics.queued.labels(**self.labels)
        self._prompt_tokens = metrics.prompt_tokens.labels(**self.labels)
        self._preemptions = metrics.preemptions.labels(**self.labels)
        self._inbox: list[Request] = []
        self._prefilled: list[PrefillResult] = []  # from the worker, joined at the next step
        self._to_remove: set[str] = set()  # rows leaving the batch, dropped together once per step
        self._gauges_due = 0.0
        self.prefill_worker = PrefillWorker(
            self.runner,
            config.prefill_tokens,
            self._deliver_prefilled,
            self._observe_prefill,
            manifest.name,
            config.prefill_nice,
        )
        self._wake = threading.Condition()
        self._stopping = False  # no new requests
        self._stopped = False  # the loop exits
        self._thread = threading.Thread(target=self._loop, name=f"engine-{manifest.name}", daemon=True)
        stats = self.kv_cache.stats()
        metrics.kv_cache_capacity.labels(**self.labels).set(stats.capacity_bytes)
        metrics.kv_cache_used.labels(**self.labels).set(0)

    # ------------------------------------------------------------------ limits

    @property
    def max_sequence_tokens(self) -> int:
        """Prompt (with BOS) + new tokens one request may reach."""
        limit = self.manifest.max_positions or self.config.max_sequence_tokens
        return min(limit, self.kv_cache.total_blocks * self.kv_cache.block_size)

    def tokenize(self, text: str) -> list[int]:
        data = list(text.encode("utf-8"))
        return [self.bos_token_id, *data] if self.add_bos else data

    def validate(self, prompt: str, params: SamplingParams) -> list[int]:
        if not prompt:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, "prompt: must not be empty")
        limit = self.config.max_new_tokens_limit
        if not 0 < params.max_new_tokens <= limit:
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT,
                f"max_new_tokens: must be in [1, {limit}], got {params.max_new_tokens}",
            )
        if not (params.temperature >= 0.0 and np.isfinite(params.temperature)):
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"temperature: must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"top_p: must be in (0, 1], got {params.top_p}")
        if params.top_k < 0:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"top_k: must be >= 0, got {params.top_k}")
        ids = self.tokenize(prompt)
        total = len(ids) + params.max_new_tokens
        if total > self.max_sequence_tokens:
            what = (
                f"max_positions={self.manifest.max_positions} of model {self.manifest.name!r}"
                if self.manifest.max_positions
                else f"max_sequence_tokens={self.max_sequence_tokens} of this server"
            )
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT,
                f"prompt + max_new_tokens: {len(ids)} prompt tokens + {params.max_new_tokens} new tokens "
                f"= {total} exceeds {what}",
            )
        return ids

    # ------------------------------------------------------------------ requests in

    def submit(self, request: Request) -> None:
        with self._wake:
            if self._stopping:
                raise RequestError(ErrorKind.UNAVAILABLE, "server is shutting down")
            waiting = len(self.scheduler.waiting) + len(self._inbox)
            if waiting >= self.config.max_queue:
                raise RequestError(
                    ErrorKind.RESOURCE_EXHAUSTED,
                    f"queue: {waiting} requests waiting for model {self.manifest.name!r} "
                    f"(max_queue={self.config.max_queue})",
                )
            self._inbox.append(request)
            self._wake.notify()

    def wake(self) -> None:
        with self._wake:
            self._wake.notify()

    # ------------------------------------------------------------------ the loop

    def start(self) -> None:
        self.prefill_worker.start()
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Refuse new work, let running work finish within `timeout`, then cancel the rest."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self.scheduler.has_work or self._inbox):
            time.sleep(0.01)
        with self._wake:
            for request in self._inbox:
                request.finish(RequestStatus.FINISHED_CANCELLED, "server shut down")
            self._inbox.clear()
        self._stopped = True
        with self._wake:
            self._wake.notify()
        self._thread.join(timeout=5)
        self.prefill_worker.stop()

    def _deliver_prefilled(self, results: list[PrefillResult]) -> None:
        with self._wake:
            self._prefilled.extend(results)
            self._wake.notify()

    def _loop(self) -> None:
        busy = False
        while True:
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
            try:
                busy = self.step()
            except Exception:  # a bug must not kill the loop silently
                logger.exception("engine step failed for %s", self.manifest.name)
                busy = False
        for request in self.scheduler.requests():
            self._finish(request, RequestStatus.FINISHED_CANCELLED, "server shut down")

    def step(self) -> bool:
        """One iteration; False when it found nothing to run (the loop may sleep)."""
        self._reap_aborted()
        with self._wake:
            prefilled, self._prefilled = self._prefilled, []
        self._flush_removals()
        joined = self._join(prefilled)
        output = self.scheduler.schedule()
        for request in output.preempted:
            self._to_remove.add(request.request_id)
            self._preemptions.inc()
        self._flush_removals()
        if output.admitted:
            self._start_prefill(output.admitted)
        if output.decode:
            self._decode(output.decode)
        self._flush_removals()
        busy = bool(joined or output.decode)
        now = time.monotonic()
        if not busy or now >= self._gauges_due:  # every step would cost ~3% of a small step
            self._update_gauges()
            self._gauges_due = now + GAUGE_INTERVAL_SECONDS
        return busy

    def _reap_aborted(self) -> None:
        now = time.monotonic()
        for request in self.scheduler.requests():
            if request.cancelled.is_set():
                self._finish(request, RequestStatus.FINISHED_CANCELLED, "cancelled by the client")
            elif request.deadline is not None and now >= request.deadline:
                request.cancel_time = request.deadline
                self._finish(request, RequestStatus.FINISHED_DEADLINE, "deadline exceeded")

    def _flush_removals(self) -> None:
        if self._to_remove:
            self.runner.remove(self._to_remove)
            self._to_remove = set()

    def _start_prefill(self, admitted: list[Request]) -> None:
        now = time.monotonic()
        for request in admitted:
            if request.attempt == 0:
                request.scheduled_time = now
                self._prompt_tokens.inc(len(request.prompt_ids))
        self.prefill_worker.submit([PrefillJob(r, r.attempt, r.prefill_ids) for r in admitted])

    def _join(self, results: list[PrefillResult]) -> int:
        """Computed prompts join the decode batch; first tokens are sampled. Returns how many joined."""
        ready = []
        for result in results:
            request = result.job.request
            if request.status.finished or request.attempt != result.job.attempt:
                continue  # finished or preempted meanwhile: its blocks are already free
            if result.error is not None:
                self._fail([request], result.error)
            elif result.prompt is not None:  # None: given up (cancel or deadline, reaped here)
                ready.append(result)
        if not ready:
            return 0
        try:
            self.runner.join([r.prompt for r in ready])  # type: ignore[misc]
        except Exception as error:
            self._fail([r.job.request for r in ready], error)
            return 0
        requests = [r.job.request for r in ready]
        for request in requests:
            request.num_computed_tokens = request.prefill_length
        # After a preemption the next token is already known: no sample.
        fresh = [(row, r) for row, r in enumerate(requests) if not r.output_ids]
        if fresh:
            logits = np.stack([ready[row].prompt.logits for row, _ in fresh])  # type: ignore[union-attr]
            self._append([r for _, r in fresh], logits)
        return len(ready)

    def _decode(self, requests: list[Request]) -> None:
        by_id = {r.request_id: r for r in requests}
        rows = [by_id.get(row) for row in self.runner.rows]
        if len(by_id) != len(rows) or None in rows:  # must not happen; never decode a wrong batch
            strays = {row for row in self.runner.rows if row not in by_id}
            logger.error("model %s: decode batch and scheduler disagree (%d strays)", self.manifest.name, len(strays))
            self.runner.remove(strays)
            for request in requests:
                if request.request_id not in self.runner.rows:
                    self._finish(request, RequestStatus.FINISHED_ERROR, "internal error: sequence lost its cache")
            return
        tokens = np.fromiter((r.output_ids[-1] for r in rows), dtype=np.int64, count=len(rows))
        started = time.monotonic()
        try:
            logits = self.runner.decode(tokens)
        except Exception as error:  # fail only the sequences of this call
            self._fail(rows, error)
            return
        self._steps["decode"].observe(time.monotonic() - started)
        self._batches["decode"].observe(len(rows))
        for request in rows:
            request.num_computed_tokens = request.num_tokens
        self._append(rows, logits)  # type: ignore[arg-type]

    def _append(self, requests: list[Request], logits: np.ndarray) -> None:
        """Sample one token per request (rows of logits), stream the new text, finish the done."""
        tokens = self.sampler.sample_batch(requests, logits)
        now = time.monotonic()
        eos, generated = self.eos_token_id, 0
        for request, token in zip(requests, tokens, strict=True):
            if request.status.finished:
                continue
            if isinstance(token, Exception):  # one request's sampling failure ends that request only
                logger.error("sampling failed for %s: %s", request.request_id, token)
                self._finish(request, RequestStatus.FINISHED_ERROR, f"sampling failed: {token}")
                continue
            if request.first_token_time is None:
                request.first_token_time = now
                self._ttft.observe(now - request.arrival_time)
            else:
                self._itl.observe(now - request.last_token_time)
            request.last_token_time = now
            request.output_ids.append(token)
            generated += 1
            if token == eos:
                self._finish(request, RequestStatus.FINISHED_EOS)
                continue
            text = request.detokenizer.push(token)
            if text:
                request.emit(text)
            if request.detokenizer.stopped:
                self._finish(request, RequestStatus.FINISHED_STOP)
            elif len(request.output_ids) >= request.params.max_new_tokens:
                self._finish(request, RequestStatus.FINISHED_LENGTH)
        self._generated.inc(generated)

    def _fail(self, requests: list[Request], error: Exception) -> None:
        logger.error("model %s: ONNX Runtime failed for %d request(s): %s", self.manifest.name, len(requests), error)
        for request in requests:
            self._finish(request, RequestStatus.FINISHED_ERROR, f"inference failed: {error}")

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        self.scheduler.remove(request)
        self._to_remove.add(request.request_id)
        self.sampler.forget(request.request_id)
        if status in (RequestStatus.FINISHED_CANCELLED, RequestStatus.FINISHED_DEADLINE) and request.cancel_time:
            self._cancel_latency.observe(time.monotonic() - request.cancel_time)
        request.finish(status, error)

    def _observe_prefill(self, seconds: float, batch: int) -> None:
        self._steps["prefill"].observe(seconds)
        self._batches["prefill"].observe(batch)

    def _update_gauges(self) -> None:
        self._kv_used.set(self.kv_cache.stats().used_bytes)
        self._kv_physical.set(self.runner.cache_slots * self.manifest.kv_bytes_per_token(self.runner.dtype))
        self._running.set(len(self.scheduler.running))
        self._queued.set(len(self.scheduler.waiting) + len(self._inbox))


class Engine:
    """All models of one repository, by name."""

    def __init__(self, models: dict[str, ModelEngine]) -> None:
        self.models = models
        self._ids = itertools.count()

    @classmethod
    def from_repository(
        cls, repository: Path, config: EngineConfig, metrics: ServiceMetrics, names: list[str] | None = None
    ) -> Engine:
        """Load every model folder (or those named); a bad manifest or file stops the start."""
        if not repository.is_dir():
            raise ManifestError(f"{repository}: model repository does not exist")
        folders = sorted(p for p in repository.iterdir() if (p / "manifest.json").is_file())
        if names:
            missing = sorted(set(names) - {p.name for p in folders})
            if missing:
                raise ManifestError(f"{repository}: no model folder named {', '.join(missing)}")
            folders = [p for p in folders if p.name in names]
        if not folders:
            raise ManifestError(f"{repository}: no model folders with a manifest.json")
        return cls({p.name: ModelEngine(Manifest.load(p), config, metrics) for p in folders})

    def model(self, name: str) -> ModelEngine:
        try:
            return self.models[name]
        except KeyError:
            known = ", ".join(sorted(self.models))
            raise RequestError(ErrorKind.NOT_FOUND, f"model: unknown model {name!r} (serving: {known})") from None

    def submit(self, model: str, prompt: str, params: SamplingParams, deadline: float | None = None) -> Request:
        engine = self.model(model)
        ids = engine.validate(prompt, params)
        request = Request(f"{model}-{next(self._ids)}", model, ids, params, engine.eos_token_id, deadline)
        try:
            engine.submit(request)
        except QueueFullError as error:
            raise RequestError(ErrorKind.RESOURCE_EXHAUSTED, str(error)) from None
        return request

    def cancel(self, request: Request) -> None:
        if request.cancel_time is None and not request.status.finished:
            request.cancel_time = time.monotonic()
        request.cancelled.set()
        self.models[request.model].wake()

    def start(self) -> None:
        for engine in self.models.values():
            engine.start()

    def stop(self, timeout: float) -> None:
        threads = [threading.Thread(target=e.stop, args=(timeout,)) for e in self.models.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
