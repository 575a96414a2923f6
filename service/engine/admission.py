"""SLO-aware admission: refuse at once a request that would miss its time-to-first-token target.

Past saturation a server that admits everything grows its queue until every request waits too
long and goodput falls to nothing (measured before this existed: 0.02x at 32 users on 2 cores).
Shedding instead keeps the admitted ones within target, as TGI's `max_concurrent_requests` and
Triton's queue policy do, but from a measured estimate rather than a fixed count: a request's
first token waits for

- the prompt tokens ahead of it (queued, or admitted and not yet computed), plus its own, at the
  prefill throughput measured on recent prefill calls (which already includes the CPU the decode
  steps take from it), and
- a free row in the running batch when it is full: the running sequence that ends soonest,
  at the measured decode step time.

A request with nothing ahead of it is always admitted, even if its own prompt alone takes longer
than the target: refusing it would refuse it forever.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from service.engine.errors import ErrorKind, RequestError
from service.engine.request import Request

SMOOTHING = 0.2  # weight of the newest observation in the moving averages
MIN_RETRY_AFTER_SECONDS = 0.05


@dataclass(frozen=True)
class Backlog:
    """What is ahead of a new request, snapshot by the engine loop each step."""

    prompt_tokens: int = 0  # prompts not yet computed (waiting, or admitted and in prefill)
    waiting: int = 0  # requests not yet admitted to the running batch
    running_steps_left: tuple[int, ...] = ()  # decode steps each running sequence has left, ascending

    @classmethod
    def of(cls, waiting: Iterable[Request], running: Iterable[Request]) -> Backlog:
        waiting, running = list(waiting), list(running)
        pending = [r for r in (*waiting, *running) if not r.output_ids]
        left = sorted(max(0, r.params.max_new_tokens - len(r.output_ids)) for r in running)
        return cls(sum(len(r.prefill_ids) for r in pending), len(waiting), tuple(left))


class AdmissionControl:
    """Moving averages of prefill throughput and decode step time, and the refusal rule."""

    def __init__(self, ttft_slo_seconds: float, max_batch_size: int) -> None:
        self.ttft_slo_seconds = ttft_slo_seconds  # 0: admit everything
        self.max_batch_size = max_batch_size
        self.prefill_tokens_per_second: float | None = None
        self.decode_step_seconds: float | None = None

    @property
    def enabled(self) -> bool:
        return self.ttft_slo_seconds > 0

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        if seconds > 0 and tokens > 0:
            self.prefill_tokens_per_second = _smooth(self.prefill_tokens_per_second, tokens / seconds)

    def observe_decode(self, seconds: float) -> None:
        if seconds > 0:
            self.decode_step_seconds = _smooth(self.decode_step_seconds, seconds)

    def wait_seconds(self, backlog: Backlog, inbox_tokens: int, inbox: int) -> float:
        """Estimated wait of a new request before its own prompt is computed (0 until measured)."""
        if self.prefill_tokens_per_second is None:
            return 0.0
        wait = (backlog.prompt_tokens + inbox_tokens) / self.prefill_tokens_per_second
        free_rows = self.max_batch_size - len(backlog.running_steps_left)
        ahead_for_a_row = backlog.waiting + inbox - free_rows  # >= 0: it must wait for a sequence to end
        if ahead_for_a_row >= 0 and backlog.running_steps_left and self.decode_step_seconds is not None:
            rounds, index = divmod(ahead_for_a_row, len(backlog.running_steps_left))
            longest = backlog.running_steps_left[-1]
            steps = rounds * longest + backlog.running_steps_left[index]
            wait = max(wait, steps * self.decode_step_seconds)
        return wait

    def check(self, request: Request, backlog: Backlog, inbox_tokens: int, inbox: int, model: str) -> None:
        """Raise RESOURCE_EXHAUSTED (with a retry hint) if the request would miss the target."""
        if not self.enabled or self.prefill_tokens_per_second is None:
            return
        wait = self.wait_seconds(backlog, inbox_tokens, inbox)
        if wait <= 0:
            return
        own = len(request.prefill_ids) / self.prefill_tokens_per_second
        expected = wait + own
        if expected <= self.ttft_slo_seconds:
            return
        retry_after = max(MIN_RETRY_AFTER_SECONDS, expected - self.ttft_slo_seconds)
        raise RequestError(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"ttft_slo: model {model!r} would take about {expected:.2f} s to its first token "
            f"({backlog.prompt_tokens + inbox_tokens} prompt tokens and {backlog.waiting + inbox} requests ahead), "
            f"over the server's time-to-first-token target of {self.ttft_slo_seconds:g} s "
            f"(--ttft-slo-seconds); retry after {retry_after:.2f} s",
            retry_after=retry_after,
        )


def _smooth(average: float | None, value: float) -> float:
    if average is None or not math.isfinite(average):
        return value
    return (1 - SMOOTHING) * average + SMOOTHING * value
