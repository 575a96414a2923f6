"""A request inside the engine core: its tokens, sampling parameters, cache policy and progress."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from contract.cache_policy import FULL_POLICY, CachePolicy
from service.engine.messages import RequestStatus, TokenLogprob
from service.engine.processing.detokenizer import IncrementalDetokenizer
from service.engine.processing.streams import OutputSink, OutputStream
from service.engine.sched.admission import Estimate
from service.engine.spec_decode.draft import DraftState


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # EOS never ends the request: the sampler masks its logit
    min_tokens: int = 0  # nor before this many new tokens
    logprobs: int | None = None  # each generated token's log-probability and this many alternatives' (None: none)
    speculative_tokens: int = 0  # guesses a step may verify (service.engine.spec_decode; 0: none)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits before sampling

    def eos_allowed(self, generated: int) -> bool:
        """Whether EOS may be sampled (and end the request) after `generated` new tokens."""
        return not self.ignore_eos and generated >= self.min_tokens


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
    # The output processor's side (service.engine.processing.output_processor.deliver): tokens it has turned
    # into text (the usage a client is told) and when the last of them was sampled.
    delivered_tokens: int = 0
    last_token_time: float = 0.0
    cancel_time: float | None = None  # when a cancel was asked for
    scheduled_time: float | None = None
    # Admission control's expected time to first token (None: not estimated), set when admitted and
    # checked against the realised one when the first token is sampled.
    admission_estimate: Estimate | None = None
    finish_time: float | None = None
    # Prompt tokens whose K/V the prefix cache gave (the usage's cached_prompt_tokens; before its
    # prefill, admission's estimate of them).
    cached_prompt_tokens: int = 0
    # The prefix cache's salt (GenerateInput.cache_salt): part of its first block's key.
    cache_salt: str = ""
    # Its tenant (the caller's token's; "" without tokens) and its priority within the tenant (vLLM's:
    # lower first): the scheduler's fair queue orders by them (service.engine.sched.fair).
    tenant: str = ""
    priority: int = 0
    # Reusable segments of the prompt as token spans [start, end), and how many leading tokens of
    # each are recomputed in context (service.engine.prompts.segments); the reused tokens, for the usage.
    segments: tuple[tuple[int, int], ...] = ()
    segment_repair_tokens: int = 0
    reused_prompt_tokens: int = 0
    error: str | None = None
    text: str = ""
    output: OutputSink = field(default_factory=OutputStream)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.detokenizer = IncrementalDetokenizer(self.params.stop)
        # One per output token when the request asks for log-probabilities (None: it asks for none);
        # None entries stand for tokens a resumed request produced on an earlier core.
        self.logprobs: list[TokenLogprob | None] | None = [] if self.params.logprobs is not None else None
        self.draft = DraftState() if self.params.speculative_tokens else None  # its proposer's state

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
        """Tokens the KV cache holds once this step's token is in: all of them, or the policy's budget.
        A speculative request's step may keep its guesses too: room for them is counted (`lookahead`)."""
        return self.cache_policy.cached(self.num_tokens + self.lookahead)

    @property
    def lookahead(self) -> int:
        """Most tokens a step may add beyond the one it feeds (its speculative guesses, as many as its
        draft's back-off allows now; none while it pauses): never past max_new_tokens, so never past
        the sequence limit the request was checked against."""
        if self.draft is None or self.draft.paused:
            return 0
        most = min(self.params.speculative_tokens, self.draft.cap)
        return min(most, max(0, self.params.max_new_tokens - len(self.output_ids) - 1))

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
