"""SLO-aware admission: refuse at once a request that would miss its time-to-first-token target,
and tell it when to come back.

Past saturation a server that admits everything grows its queue until every request waits too
long and goodput falls to nothing (docs/measurements.md).
Shedding instead keeps the admitted ones within target, as TGI's `max_concurrent_requests` and
Triton's queue policy do, but from a measured estimate rather than a fixed count.

The estimate. A request's first token waits for

- the prompt tokens ahead of it (queued, or admitted and not yet computed), plus its own, at the
  prefill throughput measured on recent prefill calls, and
- a free row in the running batch when it is full: the running sequence that ends soonest,
  at the measured decode step time.

That queue arithmetic (the *raw* estimate) leaves out what a model's own pace adds: the gaps
between prefill calls, the engine step a computed prompt waits for before its first token is
sampled, the CPU the decode steps and gRPC threads take. How much depends on the model: a
short-context model serving many small requests a second spends more of each request in those
gaps than a long-prompt one (uncalibrated, the reference run admitted `learned` requests that
missed the target). So each model calibrates its own estimate against what happened:
every admitted request's realised time to first token is regressed on its raw estimate
(`Calibration`: exponentially weighted least squares, realised = offset + slope * raw), and the
target is checked against the fitted line plus TARGET_DEVIATIONS of its recent errors, because the
target holds per request. Estimate and outcome are exported side by
side (`posenc_admission_estimated_ttft_seconds`, `posenc_admission_ttft_error_seconds`) and can
be recorded (`--admission-trace DIR`) and replayed (`replay`) to test the estimate offline.

The retry hint. A refused request is told to come back when it would meet the target: after the
excess of its estimate over the target has drained, and after every request refused before it has
had its turn, at the rate first tokens are leaving the queue (a virtual queue of retry tickets,
one per refusal, spaced by that drain rate). A ±20% jitter keeps returning clients from arriving
in waves. Without the tickets a saturated server told every refused client the minimum hint, and
the waiting clients came back many times a second to be refused again (each a full gRPC round
trip of the same CPU the admitted requests needed).

A request with nothing ahead of it is always admitted, even if its own prompt alone takes longer
than the target: refusing it would refuse it forever.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from service.api.retry import MAX_RETRY_AFTER_SECONDS, MIN_RETRY_AFTER_SECONDS
from service.engine.messages import ErrorKind, RequestError

logger = logging.getLogger(__name__)

SMOOTHING = 0.2  # weight of the newest observation in the throughput and step-time averages
RETRY_JITTER = 0.2  # hints are spread uniformly over +-20%
DRAIN_WINDOW_SECONDS = 2.0  # the drain rate counts first tokens over this window
# Calibration: the newest admitted request's weight in the fit (~30 requests of memory), and a
# ridge that pulls the slope towards 1 while the raw estimates barely vary (light load).
CALIBRATION_WEIGHT = 0.03
CALIBRATION_RIDGE = 0.05**2  # seconds^2: raw estimates spread less than ~50 ms say little about the slope
SLOPE_RANGE = (0.5, 4.0)
# The target holds per request, not on average: a request is admitted when its estimate plus this
# many standard deviations of the fit's recent errors is within it (1.28: 9 in 10 requests, were
# the errors normal).
TARGET_DEVIATIONS = 1.28


@dataclass(frozen=True)
class TenantBacklog:
    """One tenant's part of the backlog under fair scheduling."""

    tenant: str
    prompt_tokens: int
    waiting: int
    weight: float = 1.0


@dataclass(frozen=True)
class Backlog:
    """What is ahead of a new request, snapshot by the engine loop each step (Scheduler.backlog)."""

    prompt_tokens: int = 0  # prompts not yet computed (waiting, or admitted and in prefill)
    waiting: int = 0  # requests not yet admitted to the running batch
    running_steps_left: tuple[int, ...] = ()  # decode steps each running sequence has left, ascending
    tenants: tuple[TenantBacklog, ...] = ()  # by tenant, under fair scheduling (empty: first come, first served)

    def seen_by(self, tenant: str, prompt_tokens: int, weight: float = 1.0) -> Backlog:
        """What is ahead of a new request of `tenant` (with `prompt_tokens` to compute) under fair
        scheduling: its own tenant's backlog, and of every other tenant's no more than its share of
        what is served up to it (deficit round robin serves tenants in proportion to their weights):
        a quiet tenant's request does not wait behind a noisy tenant's whole queue."""
        if not self.tenants:
            return self
        mine = next((t for t in self.tenants if t.tenant == tenant), TenantBacklog(tenant, 0, 0, weight))
        tokens, waiting = mine.prompt_tokens, mine.waiting
        for other in self.tenants:
            if other.tenant != tenant:
                ratio = other.weight / mine.weight
                tokens += min(other.prompt_tokens, math.ceil((mine.prompt_tokens + prompt_tokens) * ratio))
                waiting += min(other.waiting, math.ceil((mine.waiting + 1) * ratio))
        return Backlog(tokens, waiting, self.running_steps_left)


@dataclass(frozen=True)
class Estimate:
    """One request's expected time to first token, as admission judged it."""

    raw: float  # queue arithmetic: the wait ahead plus its own prompt
    seconds: float  # calibrated: what this model's requests with that raw estimate have taken
    wait: float  # the raw wait before its own prompt (0: nothing ahead of it)
    upper: (
        float  # seconds plus TARGET_DEVIATIONS of the calibration's recent errors: what the target is checked against
    )


class Calibration:
    """realised = offset + slope * raw, fitted by exponentially weighted least squares, and the
    spread of its errors (each request's error against the fit before it was seen).

    Until it has seen a request it predicts the raw estimate itself (slope 1, offset 0, no spread)."""

    def __init__(self, weight: float = CALIBRATION_WEIGHT, ridge: float = CALIBRATION_RIDGE) -> None:
        self.weight, self.ridge = weight, ridge
        self.count = 0
        self._x = self._y = self._xx = self._xy = 0.0  # weighted means of raw, realised, raw^2, raw*realised
        self._error2 = 0.0  # weighted mean of squared prediction errors

    def observe(self, raw: float, realised: float) -> None:
        if not (math.isfinite(raw) and math.isfinite(realised)):
            return
        # The first observations are averaged equally, then the weight settles at `weight`.
        w = max(self.weight, 1.0 / (self.count + 1))
        if self.count:
            self._error2 += w * ((realised - self.predict(raw)) ** 2 - self._error2)
        self._x += w * (raw - self._x)
        self._y += w * (realised - self._y)
        self._xx += w * (raw * raw - self._xx)
        self._xy += w * (raw * realised - self._xy)
        self.count += 1

    @property
    def slope(self) -> float:
        if not self.count:
            return 1.0
        variance = max(0.0, self._xx - self._x * self._x)
        covariance = self._xy - self._x * self._y
        return min(max((covariance + self.ridge) / (variance + self.ridge), SLOPE_RANGE[0]), SLOPE_RANGE[1])

    @property
    def offset(self) -> float:
        return self._y - self.slope * self._x if self.count else 0.0

    @property
    def deviation(self) -> float:
        """Root mean square of recent prediction errors (seconds)."""
        return math.sqrt(self._error2)

    def predict(self, raw: float) -> float:
        return max(0.0, self.offset + self.slope * raw)


class AdmissionControl:
    """Moving averages of prefill throughput and decode step time, the calibrated estimate, the
    refusal rule and the retry hint. One per model; every method may be called from any thread."""

    def __init__(
        self,
        ttft_slo_seconds: float,
        max_batch_size: int,
        trace: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.ttft_slo_seconds = ttft_slo_seconds  # 0: admit everything
        self.max_batch_size = max_batch_size
        self.prefill_tokens_per_second: float | None = None
        self.decode_step_seconds: float | None = None
        self.calibration = Calibration()
        self._first_tokens: deque[float] = deque()  # when recent first tokens were sampled (drain rate)
        self._next_ticket = 0.0  # the earliest retry time the next refused request may be given
        self._trace = trace
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.ttft_slo_seconds > 0

    # ------------------------------------------------------------------ measurements

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        if seconds > 0 and tokens > 0:
            with self._lock:
                self.prefill_tokens_per_second = _smooth(self.prefill_tokens_per_second, tokens / seconds)
                self._record({"e": "prefill", "s": seconds, "n": tokens})

    def observe_decode(self, seconds: float) -> None:
        if seconds > 0:
            with self._lock:
                self.decode_step_seconds = _smooth(self.decode_step_seconds, seconds)
                self._record({"e": "decode", "s": seconds})

    def observe_first_token(self, request_id: str, estimate: Estimate | None, realised: float) -> None:
        """A request's first token was sampled `realised` seconds after it arrived: count it in the
        drain rate and, if admission estimated it, in the calibration."""
        with self._lock:
            now = self._clock()
            self._first_tokens.append(now)
            while self._first_tokens and self._first_tokens[0] < now - DRAIN_WINDOW_SECONDS:
                self._first_tokens.popleft()
            if estimate is not None:
                self.calibration.observe(estimate.raw, realised)
            self._record({"e": "first", "id": request_id, "ttft": realised, "est": estimate is not None})
        if estimate is not None:
            logger.debug("admission: %s first token after %.3f s, estimated %.3f s", request_id, realised,
                         estimate.seconds)  # fmt: skip

    def drain_rate(self) -> float | None:
        """First tokens per second over the last DRAIN_WINDOW_SECONDS (None before any)."""
        now = self._clock()
        recent = sum(1 for t in self._first_tokens if t >= now - DRAIN_WINDOW_SECONDS)
        return recent / DRAIN_WINDOW_SECONDS if recent else None

    # ------------------------------------------------------------------ the estimate

    def wait_seconds(self, backlog: Backlog, inbox_tokens: int, inbox: int) -> float:
        """Raw estimated wait of a new request before its own prompt is computed (0 until measured)."""
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

    def estimate(self, prompt_tokens: int, backlog: Backlog, inbox_tokens: int, inbox: int) -> Estimate | None:
        """The expected time to first token of a new request of `prompt_tokens` (None until measured)."""
        if self.prefill_tokens_per_second is None:
            return None
        wait = self.wait_seconds(backlog, inbox_tokens, inbox)
        raw = wait + prompt_tokens / self.prefill_tokens_per_second
        seconds = self.calibration.predict(raw)
        return Estimate(raw, seconds, wait, seconds + TARGET_DEVIATIONS * self.calibration.deviation)

    def check(
        self, request_id: str, prompt_tokens: int, backlog: Backlog, inbox_tokens: int, inbox: int, model: str
    ) -> Estimate | None:
        """The estimate of a new request with `prompt_tokens` to compute, if it is admitted;
        RESOURCE_EXHAUSTED (with a retry hint) if it would miss the target."""
        if not self.enabled:
            return None
        with self._lock:
            estimate = self.estimate(prompt_tokens, backlog, inbox_tokens, inbox)
            admit = estimate is None or estimate.wait <= 0 or estimate.upper <= self.ttft_slo_seconds
            retry_after = None if admit or estimate is None else self._retry_after(estimate.upper)
            self._record(
                {
                    "e": "check", "id": request_id, "p": prompt_tokens,
                    "b": [backlog.prompt_tokens, backlog.waiting, list(backlog.running_steps_left)],
                    "it": inbox_tokens, "i": inbox, "est": None if estimate is None else estimate.seconds,
                    "ok": admit, "retry": retry_after,
                }
            )  # fmt: skip
        if admit:
            return estimate
        assert estimate is not None and retry_after is not None
        raise RequestError(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"ttft_slo: model {model!r} would take about {estimate.seconds:.2f} s to its first token, up to "
            f"{estimate.upper:.2f} s ({backlog.prompt_tokens + inbox_tokens} prompt tokens and "
            f"{backlog.waiting + inbox} requests ahead), "
            f"over the server's time-to-first-token target of {self.ttft_slo_seconds:g} s "
            f"(--ttft-slo-seconds); retry after {retry_after:.2f} s",
            retry_after=retry_after,
        )

    # ------------------------------------------------------------------ retry hints

    def _retry_after(self, expected: float) -> float:
        """A retry ticket: after the estimate's excess over the target has drained and after the
        requests refused before this one have come back, one per 1/drain rate; jittered."""
        now = self._clock()
        rate = self.drain_rate()
        if rate is None:  # nothing has left the queue lately: one prompt's time, as computed now
            rate = 1.0 / max(expected, MIN_RETRY_AFTER_SECONDS)
        ticket = max(now + expected - self.ttft_slo_seconds, self._next_ticket)
        ticket = min(ticket, now + MAX_RETRY_AFTER_SECONDS)
        self._next_ticket = ticket + 1.0 / rate
        jitter = 1.0 + RETRY_JITTER * (2.0 * self._rng.random() - 1.0)
        return min(MAX_RETRY_AFTER_SECONDS, max(MIN_RETRY_AFTER_SECONDS, (ticket - now) * jitter))

    def queue_retry_after(self, waiting: int) -> float:
        """The hint for a refusal by a full queue: the time the queue takes to drain."""
        with self._lock:
            rate = self.drain_rate()
        if rate is None:
            return MAX_RETRY_AFTER_SECONDS
        return min(MAX_RETRY_AFTER_SECONDS, max(MIN_RETRY_AFTER_SECONDS, waiting / rate))

    # ------------------------------------------------------------------ the trace

    def _record(self, event: dict[str, object]) -> None:
        """One JSON line per measurement, decision and outcome, in the order they changed the state."""
        if self._trace is not None:
            event["t"] = round(self._clock(), 6)
            self._trace.write(json.dumps(event, separators=(",", ":")) + "\n")


def open_trace(folder: Path, model: str) -> TextIO:
    """`<folder>/<model>.jsonl`, line-buffered so a killed server leaves whole lines."""
    folder.mkdir(parents=True, exist_ok=True)
    return (folder / f"{model}.jsonl").open("w", buffering=1)


@dataclass(frozen=True)
class TracePoint:
    """An admitted request of a recorded trace: the estimate replayed now and what really happened."""

    request_id: str
    estimated: float
    upper: float
    raw: float
    realised: float


def replay(lines: Iterable[str], ttft_slo_seconds: float, max_batch_size: int) -> list[TracePoint]:
    """Feed a recorded trace's measurements and outcomes through today's estimator, in their
    recorded order and at their recorded times, and pair each admitted request's estimate with its
    realised time to first token."""
    now = [0.0]
    control = AdmissionControl(ttft_slo_seconds, max_batch_size, clock=lambda: now[0], rng=random.Random(0))
    estimates: dict[str, Estimate] = {}
    points: list[TracePoint] = []
    for line in lines:
        event = json.loads(line)
        now[0] = event["t"]
        kind = event["e"]
        if kind == "prefill":
            control.observe_prefill(event["s"], event["n"])
        elif kind == "decode":
            control.observe_decode(event["s"])
        elif kind == "check" and event["ok"]:
            prompt_tokens, waiting, steps_left = event["b"]
            backlog = Backlog(prompt_tokens, waiting, tuple(steps_left))
            estimate = control.estimate(event["p"], backlog, event["it"], event["i"])
            if estimate is not None:
                estimates[event["id"]] = estimate
        elif kind == "first":
            estimate = estimates.pop(event["id"], None)
            if estimate is not None:
                points.append(TracePoint(event["id"], estimate.seconds, estimate.upper, estimate.raw, event["ttft"]))
            control.observe_first_token(event["id"], estimate, event["ttft"])
    return points


def _smooth(average: float | None, value: float) -> float:
    if average is None or not math.isfinite(average):
        return value
    return (1 - SMOOTHING) * average + SMOOTHING * value
