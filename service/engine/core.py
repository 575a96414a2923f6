"""The engine core process (vLLM v1's EngineCore): the models' engine loops in a process of their
own, so decode steps never wait for the GIL behind gRPC threads, and the front end
(service.engine_client) never waits for theirs. On two cores this is parallelism one process lacks.

The front end starts it as `python -m service.engine.core` with its pickled CoreConfig on stdin
and two pipes' ends inherited (a new pair for every core it starts); the messages on them are
service.engine.messages'. A pipe, not a message broker: a message is one write and one read, with
no I/O threads to wake on either side. The core ignores SIGINT and SIGTERM (the front end decides
when to drain) and dies with the front end (PR_SET_PDEATHSIG, and the end of its command pipe).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import math
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, ProcessCollector

from contract.cache_policy import CachePolicyError
from contract.manifest import ManifestError
from service.engine.engine import Engine
from service.engine.kv import KVBudgetError
from service.engine.messages import (
    Add,
    Cancel,
    Command,
    CoreConfig,
    ErrorKind,
    Event,
    Failed,
    Final,
    MessageWriter,
    MetricsQuery,
    MetricsReply,
    ModelInfo,
    Outputs,
    Ready,
    Refusal,
    Reply,
    RequestError,
    RequestOutput,
    RequestStatus,
    Score,
    ScoreReply,
    Stop,
    Stopped,
    read_messages,
)
from service.engine.model_policies import eviction_positions, policy_syntax
from service.engine.processing.output_processor import OutputBatch
from service.engine.request import Request
from service.engine.worker import denormals
from service.malloc import return_freed_memory_to_the_os
from service.metrics import FRONT_END, ServiceMetrics

logger = logging.getLogger(__name__)


def model_infos(engine: Engine) -> list[ModelInfo]:
    """What the front end knows of each served model (ListModels, metric labels), sent once at READY."""
    infos = []
    for name, model in engine.models.items():
        manifest = model.manifest
        infos.append(
            ModelInfo(
                name=name,
                scheme=manifest.scheme,
                max_positions=manifest.max_positions or 0,
                train_context=manifest.train_context,
                kv_cache_bytes_per_token=model.store.layout.token_bytes,
                n_layers=manifest.n_layers,
                n_heads=manifest.n_heads,
                head_dim=manifest.head_dim,
                dtype=model.runner.dtype,
                max_new_tokens_limit=model.config.max_new_tokens_limit,
                default_max_new_tokens=model.config.default_max_new_tokens,
                max_sequence_tokens=model.max_sequence_tokens,
                kv_cache_capacity_bytes=model.store.capacity_bytes,
                cache_policies=policy_syntax(manifest),
                default_cache_policy=str(model.inputs.default_policy),
                eviction_positions=eviction_positions(manifest),
                segment_reuse=manifest.segment_reuse.mode,
                vocab_size=manifest.vocab_size,
                bos_token_id=model.inputs.bos_token_id,
                eos_token_id=model.inputs.eos_token_id,
                add_bos=model.inputs.add_bos,
                kv_cache_bytes_per_sequence=model.store.layout.local_row_bytes,
                random_weights=manifest.random_weights,
            )
        )
    return infos


class EventSender:
    """The core's events pipe, shared by the publisher, the command thread and score workers."""

    def __init__(self, fd: int) -> None:
        self._writer = MessageWriter(fd)
        self._lock = threading.Lock()

    def send(self, message: Event) -> None:
        with self._lock:
            try:
                self._writer.send(message)
            except BrokenPipeError:  # the front end is gone: nobody to tell
                os._exit(1)


# A step to deliver (its model's output processor, the step's batch), or a message to send after
# everything before it.
_Published = tuple[Callable[[OutputBatch], None] | None, OutputBatch | None, Event | None]


class StepOutputs:
    """The core's publisher: delivers each model step's outputs and sends them as one message.

    Each model loop hands its step's `OutputBatch` here (`submit`) and goes on to
    the next step; the publisher thread runs the output processor's client half on it (text, stop
    strings, final events, metrics: OutputProcessor.deliver) while that next step's graph has
    released the GIL, then packs what the steps' requests produced into one OUT message. Each
    request's `output` is a `ForwardedOutput` writing here. So the front end receives one message
    per publish, however many sequences the batch holds.

    `interval` paces the messages: after one is sent, steps that only continue streams wait until
    `interval` seconds have passed and go out together (a first token, a finish or a flush goes at
    once). Every wake-up on the other core (publisher, the front end's reader, its consumer) slows
    the decoding one (docs/measurements.md). 0: one message per step.
    """

    def __init__(self, sender: EventSender, interval: float = 0.0) -> None:
        self._sender = sender
        self._interval = interval
        self._lock = threading.Lock()
        self._entries: list[RequestOutput] = []
        self._pending: dict[str, RequestOutput] = {}  # request id -> its entry of this message
        self._steps: collections.deque[_Published | None] = collections.deque()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._idle = False  # the publisher waits for a step without a timeout: wake it for any
        self._urgent = False  # a queued step holds something a client waits on: send it at once
        self.requests: dict[str, Request] = {}  # live requests, for cancels
        self._ids_sent: dict[str, int] = {}  # request id -> how many of its token ids were sent
        self._publisher = threading.Thread(target=self._publish, name="publisher", daemon=True)
        self._publisher.start()

    def sink(self, request: Request) -> ForwardedOutput:
        self.requests[request.request_id] = request
        self._ids_sent[request.request_id] = request.delivered_tokens  # a resumed request's are known
        return ForwardedOutput(self, request)

    def put(self, request: Request, text: str) -> None:
        """`text` of the tokens delivered so far: their ids not yet sent go with it (on the publisher,
        as `deliver` counts them, so text and ids always describe the same tokens)."""
        request_id = request.request_id
        with self._lock:
            entry = self._pending.get(request_id)
            if entry is None:
                entry = self._pending[request_id] = RequestOutput(request_id, text)
                self._entries.append(entry)
            else:
                entry.text += text
            sent, delivered = self._ids_sent.get(request_id, 0), request.delivered_tokens
            if delivered > sent:
                entry.token_ids += request.output_ids[sent:delivered]
                if request.logprobs is not None:
                    entry.logprobs += request.logprobs[sent:delivered]  # type: ignore[arg-type]
                self._ids_sent[request_id] = delivered

    def close(self, request: Request, text: str, status: RequestStatus, error: str | None) -> None:
        final = Final(
            len(request.prompt_ids),
            request.delivered_tokens,
            request.arrival_time,
            request.first_token_time,
            request.scheduled_time,
            request.finish_time,
            request.cached_prompt_tokens,
            request.reused_prompt_tokens,
        )
        with self._lock:
            entry = self._pending.get(request.request_id)
            if entry is None:
                entry = RequestOutput(request.request_id, "")
                self._entries.append(entry)
            entry.text += text
            entry.status, entry.error, entry.final = int(status), error, final
            sent = self._ids_sent.get(request.request_id, 0)
            if request.logprobs is not None and request.delivered_tokens > sent:  # held back, or no text (EOS)
                entry.logprobs += request.logprobs[sent : request.delivered_tokens]  # type: ignore[arg-type]
            self._pending.pop(request.request_id, None)
            self.requests.pop(request.request_id, None)
            self._ids_sent.pop(request.request_id, None)

    def submit(self, deliver: Callable[[OutputBatch], None], batch: OutputBatch) -> None:
        """A model step's outputs, to be delivered (`deliver`: its model's output processor) and sent."""
        self._enqueue((deliver, batch, None), batch.first_tokens or bool(batch.finishes))

    def flush(self, then: Event | None = None) -> None:
        """Send what is produced so far (and `then`, a message to send after it), after every step submitted before."""
        self._enqueue((None, None, then), True)

    def close_publisher(self) -> None:
        """Everything submitted so far is sent; then the publisher ends."""
        self._enqueue(None, True)
        self._publisher.join()

    def _enqueue(self, item: _Published | None, urgent: bool) -> None:
        self._steps.append(item)
        if urgent:
            self._urgent = True
        if urgent or self._idle:  # a wake-up only when the publisher waits for one
            self._idle = False  # one is enough
            self._wake.put(None)

    def _publish(self) -> None:
        steps, interval = self._steps, self._interval
        sent = -math.inf
        while True:
            if not steps:
                self._idle = True
                if not steps:  # checked after saying so: a step queued in between signals
                    self._wake.get()
                self._idle = False
                continue
            wait = sent + interval - time.monotonic()
            if wait > 0 and not self._urgent:
                try:
                    self._wake.get(timeout=wait)  # an urgent step cuts it short
                except queue.Empty:
                    pass
            self._urgent = False
            while True:  # the signals of what is taken now (one queued later stays)
                try:
                    self._wake.get_nowait()
                except queue.Empty:
                    break
            while steps:
                item = steps.popleft()
                if item is None:
                    self._send()
                    return
                deliver, batch, then = item
                if deliver is not None and batch is not None:
                    try:
                        deliver(batch)
                    except Exception:  # a bug must not end the outputs of every later step
                        logger.exception("delivering a step's outputs failed")
                    if not interval:
                        self._send()  # unpaced: one message per step
                if then is not None:
                    self._send(then)  # after everything before it
            self._send()
            sent = time.monotonic()

    def _send(self, then: Event | None = None) -> None:
        """The outputs gathered so far as one message (if any), then `then`."""
        with self._lock:
            entries, self._entries, self._pending = self._entries, [], {}
        if entries:
            self._sender.send(Outputs(entries))
        if then is not None:
            self._sender.send(then)


@dataclass(frozen=True)
class ForwardedOutput:
    """A request's OutputSink inside the core: its text joins the step's message."""

    outputs: StepOutputs
    request: Request

    def put(self, text: str) -> None:
        self.outputs.put(self.request, text)

    def close(self, text: str, status: RequestStatus, error: str | None = None) -> None:
        self.outputs.close(self.request, text, status, error)


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when the front end dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def run_core(config: CoreConfig) -> None:
    """The core process's main: load the models, say READY, serve commands until STOP."""
    _die_with_parent()
    return_freed_memory_to_the_os()  # the KV arrays live here
    denormals.enable()  # before the first session (service/engine/worker/denormals.py)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.update(config.environment)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sender = EventSender(config.events_fd)
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, without=FRONT_END)  # the front end records those
    ProcessCollector(namespace="posenc_engine", registry=registry)  # the core's own memory and CPU
    outputs = StepOutputs(sender, config.engine.stream_interval_ms / 1000)
    try:
        engine = Engine.from_repository(
            config.repository, config.engine, metrics, config.names, output_sink=outputs.sink, publish=outputs.submit
        )
    except (ManifestError, KVBudgetError, CachePolicyError, RuntimeError) as error:
        sender.send(Failed(str(error)))
        raise SystemExit(2) from None
    engine.start()
    sender.send(Ready(model_infos(engine)))
    if not CommandLoop(engine, outputs, sender, metrics).run(read_messages(config.commands_fd, Command)):
        logger.error("engine core: the front end is gone; exiting")
        os._exit(1)
    outputs.close_publisher()
    os.close(config.events_fd)


class CommandLoop:
    """The core's main thread: one command at a time; scoring goes to a small pool."""

    def __init__(self, engine: Engine, outputs: StepOutputs, sender: EventSender, metrics: ServiceMetrics) -> None:
        self.engine, self.outputs, self.sender, self.metrics = engine, outputs, sender, metrics
        self.scoring = ThreadPoolExecutor(max_workers=4, thread_name_prefix="score")

    def run(self, commands: Iterator[Command]) -> bool:
        """Serve commands until STOP (True) or the end of the pipe: the front end is gone (False)."""
        for command in commands:
            if isinstance(command, Add):
                self.add(command)
            elif isinstance(command, Cancel):
                request = self.outputs.requests.get(command.request_id)
                if request is not None:
                    self.engine.cancel(request)
            elif isinstance(command, Score):
                self.scoring.submit(self.score, command)
            elif isinstance(command, MetricsQuery):
                self.sender.send(MetricsReply(command.call, self.metrics.exposition()))
            elif isinstance(command, Stop):
                self.stop(command.grace)
                return True
        return False

    def add(self, command: Add) -> None:
        try:
            if command.produced:
                self.resume(command)
                return
            self.engine.submit(command.input, command.request_id)
        except RequestError as error:
            self.sender.send(Reply(command.request_id, Refusal.of(error)))
            return
        self.sender.send(Reply(command.request_id))

    def resume(self, command: Add) -> None:
        """A request that ran on a core that died, with the tokens it had produced: rebuilt as that
        core held it (as a preempted request is: its prompt and output are prefilled, and its last
        token feeds the next decode step, so no token is sampled twice), its detokenizer fed the
        produced tokens without sending their text (the client has it, or it is held back as it was).
        Its seeded draws go on from their token index (service.engine.sampler)."""
        raw, produced = command.input, command.produced
        model = self.engine.model(raw.model)
        request = model.inputs.request(raw, command.request_id)
        prompt, limit = len(request.prompt_ids), model.inputs.limits.max_sequence_tokens
        if prompt + len(produced) > limit:
            raise RequestError(
                ErrorKind.UNAVAILABLE,
                f"cannot resume: its prompt ({prompt} tokens) and the {len(produced)} tokens it produced "
                f"exceed max_sequence_tokens={limit}, the longest prompt this server computes",
            )
        eos = request.eos_token_id
        request.output_ids, request.delivered_tokens = list(produced), len(produced)
        if request.logprobs is not None:  # the produced tokens' went out with them: never sent again
            request.logprobs = [None] * len(produced)
        request.last_token_time = time.monotonic()  # its next token's interval starts now
        for token in produced:
            if token != eos:
                request.detokenizer.push(token)
        request.output = self.outputs.sink(request)
        status = (
            RequestStatus.FINISHED_STOP if request.detokenizer.stopped
            else RequestStatus.FINISHED_EOS if produced[-1] == eos
            else RequestStatus.FINISHED_LENGTH if len(produced) >= request.params.max_new_tokens
            else None
        )  # fmt: skip
        if status is None:
            try:
                model.submit(request)
            except RequestError:
                self.outputs.requests.pop(request.request_id, None)
                raise
        self.sender.send(Reply(command.request_id))
        if status is not None:  # it had ended; only its final event was lost
            request.finish(status)
            self.outputs.flush()

    def score(self, command: Score) -> None:
        try:
            scored = self.engine.score(
                command.model, command.text, command.cache_policy, command.ids, command.top, command.field
            )
        except RequestError as error:
            self.sender.send(ScoreReply(command.call, Refusal.of(error)))
            return
        except Exception as error:  # one failing request never harms the others
            logger.exception("scoring failed")
            self.sender.send(ScoreReply(command.call, Refusal("INTERNAL", f"scoring failed: {error}")))
            return
        self.sender.send(ScoreReply.of(command.call, scored))

    def stop(self, grace: float) -> None:
        report = self.engine.stop(grace)
        self.scoring.shutdown(wait=True, cancel_futures=True)
        self.outputs.flush(then=Stopped(report.finished, report.cut))  # after the last outputs


if __name__ == "__main__":
    import pickle
    import sys

    run_core(pickle.load(sys.stdin.buffer))
