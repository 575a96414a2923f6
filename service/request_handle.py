"""The front end's view of one generation (RequestHandle) and of requests carried over an engine
core restart (ResumeObserver): what service.engine_client keeps per request and the front ends
(gRPC servicer, HTTP API) read."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from service.engine.messages import Final, GenerateInput, RequestStatus, TokenLogprob
from service.engine.processing.streams import OutputStream


@dataclass(frozen=True)
class ResumeObserver:
    """What the front end records of requests carried over a core restart (service.metrics)."""

    resumed: Callable[[], None] = lambda: None  # one was resubmitted to the new core
    not_resumed: Callable[[], None] = lambda: None  # one ended with UNAVAILABLE instead
    first_token: Callable[[float], None] = lambda seconds: None  # from the core's death to its next token


@dataclass(eq=False)
class RequestHandle:
    """The front end's view of one generation: its streamed text and, once final, how it ended;
    what resuming it takes (its input, every token id the core sent) and how often it was."""

    request_id: str
    model: str
    input: GenerateInput | None = None
    token_ids: list[int] = field(default_factory=list)
    # Log-probabilities where asked: each generated token's (aligned with token_ids, then the final
    # entry's tokens), and each prompt token's (echo; None for the first, which nothing precedes).
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    accepted: bool = False  # the core answered its Add without a refusal
    cancelled: bool = False
    resumes: int = 0
    stalled_since: float | None = None  # the core it ran on died then; cleared by its next token
    output: OutputStream = field(default_factory=OutputStream)
    done: threading.Event = field(default_factory=threading.Event)
    text: str = ""
    status: RequestStatus = RequestStatus.WAITING
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    scheduled_time: float | None = None
    finish_time: float | None = None
    on_finish: Callable[[RequestHandle], None] | None = None  # once, when it ends (its tenant's quota)
    quota_labels: dict[str, str] = field(default_factory=dict)  # its per-tenant metrics' labels

    def receive(
        self,
        text: str,
        status: int | None,
        error: str | None,
        final: Final | None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        if logprobs:
            self.logprobs += logprobs
        if status is None:
            self.text += text
            self.output.put(text, logprobs)
            return
        if final is not None:
            self.prompt_tokens, self.completion_tokens = final.prompt_tokens, final.completion_tokens
            self.cached_prompt_tokens = final.cached_prompt_tokens
            self.reused_prompt_tokens = final.reused_prompt_tokens
            if self.resumes:  # the first core's times (this handle's) stand: the last core saw a resubmission
                self.first_token_time = self.first_token_time or final.first_token_time
                self.scheduled_time = self.scheduled_time or final.scheduled_time
            else:
                self.arrival_time, self.first_token_time = final.arrival_time, final.first_token_time
                self.scheduled_time = final.scheduled_time
            self.finish_time = final.finish_time
        self.finish(RequestStatus(status), error, text, logprobs)

    def finish(
        self, status: RequestStatus, error: str | None, text: str = "", logprobs: list[TokenLogprob] | None = None
    ) -> None:
        if self.status.finished:
            return
        self.text += text
        self.status, self.error = status, error
        self.finish_time = self.finish_time or time.monotonic()
        self.output.close(text, status, error, logprobs)
        self.done.set()
        if self.on_finish is not None:
            self.on_finish(self)
