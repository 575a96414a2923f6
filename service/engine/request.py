"""Engine-side request types: what the servicer hands in and what streams back."""

from __future__ import annotations

import enum
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from contract.cache_policy import FULL_POLICY, CachePolicy
from service.engine.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from service.engine.admission import Estimate


class RequestStatus(enum.IntEnum):
    """Ordered: everything from FINISHED_LENGTH on is final."""

    WAITING = 0
    RUNNING = 1
    FINISHED_LENGTH = 2
    FINISHED_STOP = 3
    FINISHED_EOS = 4
    FINISHED_CANCELLED = 5
    FINISHED_DEADLINE = 6
    FINISHED_ERROR = 7
    FINISHED_SHUTDOWN = 8  # cancelled because the server stopped before it finished

    @property
    def finished(self) -> bool:
        return self >= FIRST_FINAL


# The first final status, as a module name: `status >= FIRST_FINAL` is what `finished` says, for hot
# loops (the property, with its lookup on the enum class, costs ~0.4 us a call).
FIRST_FINAL = RequestStatus.FINISHED_LENGTH


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()


@dataclass
class StreamEvent:
    """New text since the consumer last looked; `status` is final on the last event."""

    text: str
    status: RequestStatus
    error: str | None = None


class OutputSink(Protocol):
    """Where a request's text goes as it is produced (an OutputStream, or the engine core's collector)."""

    def put(self, text: str) -> None: ...

    def close(self, text: str, status: RequestStatus, error: str | None = None) -> None: ...


class OutputStream:
    """Engine -> consumer hand-off that merges what the consumer has not taken yet.

    While the consumer keeps up it gets one event per step; when it falls behind (a slow
    client, a busy gRPC thread) the waiting texts are joined into one event instead of
    piling up, as vLLM's output collector does. The engine never blocks on a consumer.
    The consumer is woken through a C queue, one item per batch of new text: measured with
    the core decoding one stream read by this process, a threading.Event here (a Condition
    and a dozen Python-level lock operations per token on the reading side) cost the core's
    decode step 8-10 us more (543 against 536, 570 against 561 us, alternating requests).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakeups: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._signalled = False  # a wake-up is queued that the consumer has not taken
        self._text = ""
        self._final: StreamEvent | None = None
        self._closed = False  # the final event was taken: later calls answer at once

    def put(self, text: str) -> None:
        with self._lock:
            self._text += text
            if self._signalled:
                return
            self._signalled = True
        self._wakeups.put(None)

    def close(self, text: str, status: RequestStatus, error: str | None = None) -> None:
        with self._lock:
            self._final = StreamEvent(self._text + text, status, error)
            self._text = ""
            if self._signalled:
                return
            self._signalled = True
        self._wakeups.put(None)

    def get(self, timeout: float | None = None) -> StreamEvent | None:
        """Everything new since the last call (None on timeout); final once closed."""
        if not self._closed:
            try:
                self._wakeups.get(timeout=timeout)
            except queue.Empty:
                return None
        with self._lock:
            self._signalled = False
            if self._final is not None:  # a closed stream stays readable
                self._closed = True
                final, self._final = self._final, StreamEvent("", self._final.status, self._final.error)
                return final
            text, self._text = self._text, ""
        return StreamEvent(text, RequestStatus.RUNNING)


@dataclass(eq=False)  # identity: requests are compared in scheduler lists every step
class Request:
    request_id: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_id: int
    deadline: float | None = None  # time.monotonic() seconds
    cache_policy: CachePolicy = FULL_POLICY
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (prompt prefilled + decoded).
    num_computed_tokens: int = 0
    # Bumped on every preemption, so a prefill result computed before it is recognised as stale.
    attempt: int = 0
    first_token_time: float | None = None  # when its first token was sampled (the engine loop's)
    # The output processor's side (service.engine.output_processor.deliver): tokens it has turned
    # into text (the usage a client is told) and when the last of them was sampled.
    delivered_tokens: int = 0
    last_token_time: float = 0.0
    cancel_time: float | None = None  # when a cancel was asked for
    scheduled_time: float | None = None
    # Admission control's expected time to first token (None: not estimated), set when admitted and
    # checked against the realised one when the first token is sampled.
    admission_estimate: Estimate | None = None
    finish_time: float | None = None
    error: str | None = None
    text: str = ""
    output: OutputSink = field(default_factory=OutputStream)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.detokenizer = IncrementalDetokenizer(self.params.stop)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_ids(self) -> list[int]:
        """Tokens whose K/V must be computed before decoding: the prompt, or after a
        preemption everything but the last output (which the next decode step feeds)."""
        return self.prompt_ids + self.output_ids[:-1]

    @property
    def prefill_length(self) -> int:
        return len(self.prompt_ids) + max(0, len(self.output_ids) - 1)

    @property
    def cached_tokens(self) -> int:
        """Tokens the KV cache holds once this step's token is in: all of them, or the policy's budget."""
        return self.cache_policy.cached(self.num_tokens)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.prefill_length

    def emit(self, text: str) -> None:
        self.text += text
        self.output.put(text)

    def finish(self, status: RequestStatus, error: str | None = None) -> None:
        """Mark final and send the last event (flushing held-back text unless aborted). Once: the
        engine loop may have set `status` already (it owns it while the request runs)."""
        if self.done.is_set():
            return
        self.status, self.error = status, error
        self.finish_time = time.monotonic()
        tail = self.detokenizer.flush() if status <= RequestStatus.FINISHED_EOS else ""
        self.text += tail
        self.output.close(tail, status, error)
        self.done.set()
