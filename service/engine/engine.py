"""The engine loop: one thread per model runs schedule -> run -> sample -> update, and
streams each request's new text back through its event queue.

Requests arrive from gRPC threads through a small inbox; cancellation and deadlines are
honoured at the next step boundary, where the sequence leaves the batch and frees its blocks.
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
from service.engine.request import Request, RequestStatus, SamplingParams, StreamEvent
from service.engine.runner import ModelRunner, PrefillChunk
from service.engine.sampler import Sampler
from service.engine.scheduler import QueueFullError, Scheduler, SchedulerOutput
from service.metrics import ServiceMetrics

logger = logging.getLogger(__name__)


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
    prefill_tokens: int = 512  # prompt tokens per step (longer prompts are chunked)
    max_new_tokens_limit: int = 1024
    default_max_new_tokens: int = 64
    max_sequence_tokens: int = 4096  # prompt + new tokens, for schemes with no hard limit
    device: str = "auto"
    threads: int = 0


class ModelEngine:
    """Everything that serves one model."""

    def __init__(self, manifest: Manifest, config: EngineConfig, metrics: ServiceMetrics) -> None:
        self.manifest = manifest
        self.config = config
        self.runner = ModelRunner(manifest, config.device, config.threads)
        self.kv_cache = KVCacheManager(
            config.kv_cache_bytes, manifest.kv_bytes_per_token(self.runner.dtype), config.block_size
        )
        self.scheduler = Scheduler(self.kv_cache, config.max_batch_size, config.max_queue, config.prefill_tokens)
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
        self._inbox: list[Request] = []
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

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._inbox and not self.scheduler.has_work and not self._stopped:
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
                self.step()
            except Exception:  # a bug must not kill the loop silently
                logger.exception("engine step failed for %s", self.manifest.name)
        for request in self.scheduler.requests():
            self._finish(request, RequestStatus.FINISHED_CANCELLED, "server shut down")

    def step(self) -> None:
        self._reap_aborted()
        output = self.scheduler.schedule()
        for request in output.preempted:
            self.runner.remove({request.request_id})
            self.metrics.preemptions.labels(**self.labels).inc()
        if not output.empty:
            self._run(output)
        self._update_gauges()

    def _reap_aborted(self) -> None:
        now = time.monotonic()
        for request in self.scheduler.requests():
            if request.cancelled.is_set():
                self._finish(request, RequestStatus.FINISHED_CANCELLED, "cancelled by the client")
            elif request.deadline is not None and now >= request.deadline:
                request.cancel_time = request.deadline
                self._finish(request, RequestStatus.FINISHED_DEADLINE, "deadline exceeded")

    def _run(self, output: SchedulerOutput) -> None:
        if output.decode:
            started = time.monotonic()
            try:
                logits = self.runner.decode({r.request_id: r.output_ids[-1] for r in output.decode})
            except Exception as error:  # fail only the sequences of this call
                self._fail(output.decode, error)
            else:
                self._observe_step("decode", started, len(output.decode))
                for request in output.decode:
                    request.num_computed_tokens = request.num_tokens
                    self._append(request, logits[request.request_id])
        if output.prefill:
            started = time.monotonic()
            chunks = [
                PrefillChunk(c.request.request_id, c.request.prefill_ids[c.start : c.end], c.start, c.is_last)
                for c in output.prefill
            ]
            for chunk in output.prefill:
                if chunk.start == 0:
                    chunk.request.scheduled_time = chunk.request.scheduled_time or started
                    self.metrics.prompt_tokens.labels(**self.labels).inc(len(chunk.request.prompt_ids))
            try:
                logits, failures = self.runner.prefill(chunks)
            except Exception as error:
                self._fail([c.request for c in output.prefill], error)
                return
            self._observe_step("prefill", started, len(output.prefill))
            for chunk in output.prefill:
                request = chunk.request
                if request.request_id in failures:
                    self._fail([request], failures[request.request_id])
                    continue
                request.num_computed_tokens = chunk.end
                # After a preemption the next token is already known: no sample.
                if chunk.is_last and request.request_id in logits and len(request.output_ids) == 0:
                    self._append(request, logits[request.request_id])

    def _append(self, request: Request, logits: np.ndarray) -> None:
        if request.status.finished:
            return
        try:
            token = self.sampler.sample(request.request_id, logits, request.params)
        except Exception as error:  # one request's sampling failure ends that request only
            logger.exception("sampling failed for %s", request.request_id)
            self._finish(request, RequestStatus.FINISHED_ERROR, f"sampling failed: {error}")
            return
        now = time.monotonic()
        if request.first_token_time is None:
            request.first_token_time = now
            self._ttft.observe(now - request.arrival_time)
        else:
            self._itl.observe(now - request.last_token_time)
        request.last_token_time = now
        request.output_ids.append(token)
        self._generated.inc()
        if token == self.eos_token_id:
            self._finish(request, RequestStatus.FINISHED_EOS)
            return
        text = request.detokenizer.push(token)
        if text:
            request.text += text
            request.events.put_nowait(StreamEvent(text, RequestStatus.RUNNING))
        if request.detokenizer.stopped:
            self._finish(request, RequestStatus.FINISHED_STOP)
        elif len(request.output_ids) >= request.params.max_new_tokens:
            self._finish(request, RequestStatus.FINISHED_LENGTH)

    def _fail(self, requests: list[Request], error: Exception) -> None:
        logger.error("model %s: ONNX Runtime failed for %d request(s): %s", self.manifest.name, len(requests), error)
        for request in requests:
            self._finish(request, RequestStatus.FINISHED_ERROR, f"inference failed: {error}")

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        self.scheduler.remove(request)
        self.runner.remove({request.request_id})
        self.sampler.forget(request.request_id)
        if status in (RequestStatus.FINISHED_CANCELLED, RequestStatus.FINISHED_DEADLINE) and request.cancel_time:
            self._cancel_latency.observe(time.monotonic() - request.cancel_time)
        request.finish(status, error)

    def _observe_step(self, phase: str, started: float, batch: int) -> None:
        self._steps[phase].observe(time.monotonic() - started)
        self._batches[phase].observe(batch)

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
