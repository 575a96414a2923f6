"""Engine-side request types: what the servicer hands in and what streams back."""

from __future__ import annotations

import enum
import queue
import threading
import time
from dataclasses import dataclass, field

from service.engine.detokenizer import IncrementalDetokenizer


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

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_LENGTH


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
    """One step's new text; `status` is final on the last event."""

    text: str
    status: RequestStatus
    error: str | None = None


@dataclass
class Request:
    request_id: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_id: int
    deadline: float | None = None  # time.monotonic() seconds
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (prompt chunks prefilled + decoded).
    num_computed_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float = 0.0
    cancel_time: float | None = None  # when a cancel was asked for
    scheduled_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    text: str = ""
    events: queue.Queue[StreamEvent] = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.detokenizer = IncrementalDetokenizer(self.params.stop)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

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
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.prefill_length

    def finish(self, status: RequestStatus, error: str | None = None) -> None:
        """Mark final and send the last event (flushing held-back text unless aborted)."""
        if self.status.finished:
            return
        self.status, self.error = status, error
        self.finish_time = time.monotonic()
        tail = self.detokenizer.flush() if status <= RequestStatus.FINISHED_EOS else ""
        self.text += tail
        self.events.put(StreamEvent(tail, status, error))
