"""Graded long-range probes, measured through the service's `Score` RPC.

Each probe builds a text, scores it teacher-forced in one call, and counts the bytes the model's
greedy prediction gets right (`ScoreResponse.greedy_tokens`), so every trial contributes a graded
figure instead of all or nothing:

- **copy**: a random 16-character span of the span alphabet (`models.spans`, the one training and
  `models.copy_probe` use) in held-out text, repeated after a filler of D bytes; the figure is the
  share of the repeat's last 8 characters predicted (its first 8 identify which span to copy), and
  chance is 1/len(alphabet). Also on a grid of context lengths x depths (where the first copy
  sits: "lost in the middle").
- **passkey** (Mohtashami & Jaggi 2023; the position-interpolation and YaRN papers): a 5-digit key
  hidden in filler as a line of code, asked for at the end; the share of its digits predicted.
- **natural**: bits per byte on held-out bytes that complete a repeated 8-byte n-gram whose
  previous occurrence is D bytes back, bucketed by D: long-range use of real text, no planting.

Proportions carry 95% Wilson score intervals with n = trials (a trial's 8 bytes are not
independent, so each trial counts once: a conservative interval). Bits per byte carry a 95%
interval from the cluster-robust standard error of a ratio over windows.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from models.spans import SPAN_ALPHABET
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc

Z95 = 1.959963984540054
SPAN, CUE = 16, 8  # the planted span; its first CUE characters identify it, the rest are scored
NGRAM = 8
DISTANCE_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # upper edges, bytes
# The passkey's line and the question after it, asked with the line's own words, as Mohtashami & Jaggi
# ask "The pass key is".
PASSKEY_DIGITS = 5
PASSKEY_QUESTION = '\n# what was it? pass_key = "'
Filler = Callable[[int], str]  # about n bytes of held-out text (valid UTF-8, at least n - 3 bytes)


@dataclass(frozen=True)
class Interval:
    """A figure and its 95% interval; `n` is how many trials (or bytes) it rests on."""

    value: float
    low: float
    high: float
    n: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def wilson(mean: float, n: int, z: float = Z95) -> Interval:
    """Wilson score interval of a proportion `mean` observed over `n` trials."""
    if n <= 0:
        return Interval(math.nan, 0.0, 1.0, 0)
    denominator = 1 + z * z / n
    centre = (mean + z * z / (2 * n)) / denominator
    half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / denominator
    return Interval(mean, max(0.0, centre - half), min(1.0, centre + half), n)


def clustered_wilson(values: list[float], clusters: list[int]) -> Interval:
    """Wilson interval of the mean of graded shares (each in [0, 1]) where observations of one cluster
    are not independent: n = the clusters, each cluster's mean one observation (a mean of shares in
    [0, 1] varies no more than a proportion of that mean, so the interval is conservative, as one
    observation per trial is for a trial's bytes). `n` in the result stays the observations."""
    interval = wilson(sum(values) / len(values), len(set(clusters)))
    return Interval(interval.value, interval.low, interval.high, len(values))


def ratio_interval(clusters: Iterable[tuple[float, int]], z: float = Z95) -> Interval | None:
    """sum(bits) / sum(bytes) over windows, with the cluster-robust standard error of a ratio
    (bytes inside one window are not independent; windows are)."""
    pairs = [(bits, count) for bits, count in clusters if count > 0]
    total = sum(count for _, count in pairs)
    if not total:
        return None
    value = sum(bits for bits, _ in pairs) / total
    k = len(pairs)
    if k < 2:
        return Interval(value, math.nan, math.nan, total)
    variance = sum((bits - value * count) ** 2 for bits, count in pairs) / total**2 * k / (k - 1)
    half = z * math.sqrt(variance)
    return Interval(value, max(0.0, value - half), value + half, total)


# ---------------------------------------------------------------------------------- texts


@dataclass(frozen=True)
class ProbeText:
    """A text to score and the byte offsets whose greedy predictions count."""

    text: str
    scored: tuple[int, ...]


def _span(rng: random.Random) -> str:
    return "".join(rng.choice(SPAN_ALPHABET) for _ in range(SPAN))


def copy_text(filler: Filler, rng: random.Random, before: int, distance: int) -> ProbeText:
    """`before` bytes of text, a span, `distance` bytes of text, the span again (last CUE.. scored)."""
    span = _span(rng)
    head = filler(before) + "\n" + span if before else span
    body = head + filler(distance) + span
    end = len(body.encode())
    return ProbeText(body, tuple(range(end - (SPAN - CUE), end)))


def depth_text(filler: Filler, rng: random.Random, context: int, depth: float) -> ProbeText:
    """A copy probe of `context` bytes whose first copy sits at `depth` of it."""
    room = max(0, context - 2 * SPAN - 1)
    before = int(room * depth)
    return copy_text(filler, rng, before, room - before)


def passkey(rng: random.Random) -> str:
    return "".join(rng.choice(string.digits) for _ in range(PASSKEY_DIGITS))


def passkey_line(key: str) -> str:
    """The line that plants `key`."""
    return f'\npass_key = "{key}"  # remember it\n'


def passkey_text(filler: Filler, rng: random.Random, context: int) -> ProbeText:
    """A 5-digit key as a line of code at a random depth of `context` bytes, asked for at the end."""
    key = passkey(rng)
    line, question = passkey_line(key), PASSKEY_QUESTION
    room = max(0, context - len(line) - len(question) - len(key))
    before = int(room * rng.uniform(0.1, 0.9))
    body = filler(before) + line + filler(room - before) + question + key
    end = len(body.encode())
    return ProbeText(body, tuple(range(end - len(key), end)))


def repeated_ngram_distances(data: bytes, n: int = NGRAM) -> dict[int, int]:
    """Byte offset -> distance back to the previous occurrence of the n-gram it completes."""
    last: dict[bytes, int] = {}
    out: dict[int, int] = {}
    for end in range(n - 1, len(data)):
        gram = data[end - n + 1 : end + 1]
        if gram in last:
            out[end] = end - last[gram]
        last[gram] = end
    return out


def bucket_of(distance: int) -> int | None:
    return next((edge for edge in DISTANCE_BUCKETS if distance <= edge), None)


# ---------------------------------------------------------------------------------- scoring


class Scorer:
    """Score texts through the service; None where the model cannot take the length."""

    def __init__(
        self,
        stub: generation_pb2_grpc.GenerationStub,
        model: str,
        limit: int,
        workers: int = 2,
        cache_policy: str = "",
    ) -> None:
        """`cache_policy`: the texts stream through it (contract/cache_policy.py; empty: the model's default)."""
        self.stub, self.model, self.limit, self.workers = stub, model, limit, workers
        self.cache_policy = cache_policy

    def servable(self, length: int) -> bool:
        return not self.limit or length <= self.limit

    def score(self, text: str) -> pb.ScoreResponse:
        request = pb.ScoreRequest(model=self.model, text=text, cache_policy=self.cache_policy)
        return self.stub.Score(request, timeout=600)

    def hits(self, probes: list[ProbeText]) -> list[float] | None:
        """Per probe, the share of its scored bytes the model predicts; None if any is too long."""
        if not all(self.servable(len(p.text.encode())) for p in probes):
            return None

        def one(probe: ProbeText) -> float:
            response = self.score(probe.text)
            data = probe.text.encode()
            return sum(response.greedy_tokens[i] == data[i] for i in probe.scored) / len(probe.scored)

        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(one, probes))

    def accuracy(self, probes: list[ProbeText]) -> dict[str, float] | None:
        scores = self.hits(probes)
        return None if scores is None else wilson(sum(scores) / len(scores), len(scores)).as_dict()

    def natural(self, windows: list[str], length: int) -> dict[str, dict[str, float] | None]:
        """Bits per byte on bytes completing a repeated n-gram, by distance bucket up to the windows'
        `length`, and on all bytes. A model that cannot take `length` bytes is scored on windows
        cut to its limit; the buckets past that are None (not servable)."""
        if self.limit:
            windows = [w.encode()[: self.limit].decode("utf-8", errors="ignore") for w in windows]
        per_bucket: dict[int, list[tuple[float, int]]] = {edge: [] for edge in DISTANCE_BUCKETS}
        overall: list[tuple[float, int]] = []

        def one(window: str) -> tuple[list[float], bytes]:
            return list(self.score(window).token_logprobs), window.encode()

        with ThreadPoolExecutor(self.workers) as pool:
            scored = list(pool.map(one, windows))
        for logprobs, data in scored:
            bits = [-lp / math.log(2) for lp in logprobs]
            overall.append((sum(bits), len(bits)))
            sums = {edge: [0.0, 0] for edge in DISTANCE_BUCKETS}
            for offset, distance in repeated_ngram_distances(data).items():
                edge = bucket_of(distance)
                if edge is not None:
                    sums[edge][0] += bits[offset]
                    sums[edge][1] += 1
            for edge, (total, count) in sums.items():
                per_bucket[edge].append((total, int(count)))
        longest = max((len(w.encode()) for w in windows), default=0)
        out: dict[str, dict[str, float] | None] = {}
        lower = 0  # the bucket holds distances in (lower, edge]
        for edge in DISTANCE_BUCKETS:
            if lower >= length:
                break  # past the windows the budget asked for: not measured (rather than not servable)
            interval = ratio_interval(per_bucket[edge]) if lower < longest else None
            lower = edge
            out[str(edge)] = None if interval is None else interval.as_dict()
        everything = ratio_interval(overall)
        out["all"] = None if everything is None else everything.as_dict()
        return out
