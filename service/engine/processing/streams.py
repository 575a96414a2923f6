"""How a request's text reaches its reader: the sink the engine writes to, and the stream a reader
(a gRPC handler, a test) takes merged events from. Standard library only: the front end uses it."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Protocol

from service.engine.messages import RequestStatus, TokenLogprob


@dataclass
class StreamEvent:
    """New text since the consumer last looked; `status` is final on the last event. `logprobs`:
    those of the tokens that arrived with it, where the request asked for them (a token's text
    may come in a later event: a character's first bytes, a possible stop string are held back)."""

    text: str
    status: RequestStatus
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


class OutputSink(Protocol):
    """Where a request's text goes as it is produced (an OutputStream, or the engine core's collector)."""

    def put(self, text: str) -> None: ...

    def close(self, text: str, status: RequestStatus, error: str | None = None) -> None: ...


class OutputStream:
    """Engine -> consumer hand-off that merges what the consumer has not taken yet.

    While the consumer keeps up it gets one event per step; when it falls behind (a slow
    client, a busy gRPC thread) the waiting texts are joined into one event instead of
    piling up, as vLLM's output collector does. The engine never blocks on a consumer.
    The consumer is woken through a C queue, one item per batch of new text: a threading.Event
    (a Condition and a dozen Python-level lock operations per token on the reading side) slowed the
    core's decode step measurably (docs/measurements.md).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakeups: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._signalled = False  # a wake-up is queued that the consumer has not taken
        self._text = ""
        self._logprobs: list[TokenLogprob] = []
        self._final: StreamEvent | None = None
        self._closed = False  # the final event was taken: later calls answer at once

    def put(self, text: str, logprobs: list[TokenLogprob] | None = None) -> None:
        with self._lock:
            self._text += text
            if logprobs:
                self._logprobs += logprobs
            if self._signalled:
                return
            self._signalled = True
        self._wakeups.put(None)

    def close(
        self, text: str, status: RequestStatus, error: str | None = None, logprobs: list[TokenLogprob] | None = None
    ) -> None:
        with self._lock:
            self._final = StreamEvent(self._text + text, status, error, self._logprobs + (logprobs or []))
            self._text, self._logprobs = "", []
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
        return self.take()

    def take(self) -> StreamEvent:
        """What `get` returns once woken (an asynchronous reader waits its own way, then takes)."""
        with self._lock:
            self._signalled = False
            if self._final is not None:  # a closed stream stays readable
                self._closed = True
                final, self._final = self._final, StreamEvent("", self._final.status, self._final.error)
                return final
            text, self._text = self._text, ""
            logprobs, self._logprobs = self._logprobs, []
        return StreamEvent(text, RequestStatus.RUNNING, None, logprobs)
