"""Output processing (vLLM v1's output processor), in two halves.

`accept` runs on the engine loop right after a step's tokens are sampled: it appends each token
and decides who is done by token ids alone (end of sequence, length, a failed sample), so the
next step knows its batch. Everything a client sees (text, stop strings, final events, the
per-token metrics) is `deliver`'s, given the step's `OutputBatch` once the step is over: inline
on the loop (the in-process engine), or on the engine core's publisher thread while the next
step's graph runs (service.engine.core), so the decode loop pays for none of it.

A stop string is found by `deliver`, after the loop may already have decoded more tokens for
that request (one, or a paced interval's: service.engine.core.StepOutputs): the request is
finished there (its text ends before the stop string, its usage counts the tokens delivered),
and the loop frees its row at its next step (`on_stop`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.engine.messages import FIRST_FINAL, RequestStatus, TokenLogprob
from service.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    request: Request
    status: RequestStatus
    error: str | None = None


@dataclass(frozen=True)
class TokenMetrics:
    """One model's labelled metric children for one cache-policy form, resolved once (cheap per token)."""

    ttft: Any
    itl: Any
    generated: Any


@dataclass(slots=True)
class OutputBatch:
    """What one engine step produced, for `deliver`: tokens (request, token id, sample time) in
    sampling order, then the finishes decided in the step, then metric observations to apply.
    A request's token always precedes its finish: a step decodes a request at most once, and
    finishes it after sampling."""

    tokens: list[tuple[Request, int, float]] = field(default_factory=list)
    finishes: list[Finished] = field(default_factory=list)
    records: list[tuple[Callable[[Any], None], Any]] = field(default_factory=list)
    first_tokens: bool = False  # some request's first token is here (its client waits on it)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finishes or self.records)


class OutputProcessor:
    def __init__(
        self, eos_token_id: int, metrics: dict[str, TokenMetrics], on_stop: Callable[[], None] = lambda: None
    ) -> None:
        """`metrics`: by cache-policy form (CachePolicy.form), each request's tokens counted under its own.
        `on_stop`: called (on the delivering thread) when a stop string finished a request the loop still holds."""
        self.eos_token_id = eos_token_id
        self._metrics = metrics
        self.on_stop = on_stop

    def accept(
        self,
        requests: list[Request],
        tokens: list[int | Exception],
        now: float,
        batch: OutputBatch,
        logprobs: dict[int, TokenLogprob] | None = None,
    ) -> list[Finished]:
        """The loop's half: append each request's sampled token (into `batch` too), and its
        log-probabilities (`logprobs`, by row) where it asked; the requests now done by token ids
        (end of sequence, length) or by a failed sample."""
        finished: list[Finished] = []
        eos = self.eos_token_id
        out = batch.tokens
        for row, (request, token) in enumerate(zip(requests, tokens, strict=True)):
            if request.status >= FIRST_FINAL:
                continue  # finished by its stop string, not yet reaped
            if isinstance(token, Exception):  # one request's sampling failure ends that request only
                logger.error("sampling failed for %s: %s", request.request_id, token)
                finished.append(Finished(request, RequestStatus.FINISHED_ERROR, f"sampling failed: {token}"))
                continue
            if request.first_token_time is None:
                request.first_token_time = now
                batch.first_tokens = True
            output_ids = request.output_ids
            output_ids.append(token)
            if logprobs is not None and request.logprobs is not None:
                request.logprobs.append(logprobs[row])
            out.append((request, token, now))
            if token == eos and request.params.eos_allowed(len(output_ids) - 1):
                finished.append(Finished(request, RequestStatus.FINISHED_EOS))
            elif len(output_ids) >= request.params.max_new_tokens:
                finished.append(Finished(request, RequestStatus.FINISHED_LENGTH))
        return finished

    def deliver(self, batch: OutputBatch) -> None:
        """The client's half, in the batch's order: per-token metrics, text (stop strings end a
        request here), final events, then the step's observations."""
        generated: dict[str, int] = {}  # by policy form: one increment per form and step
        metrics = self._metrics
        eos = self.eos_token_id
        stopped = False
        for request, token, now in batch.tokens:
            if request.done.is_set() or request.detokenizer.stopped:
                continue  # decoded after its stop string (the loop frees the row at its next step)
            form = request.cache_policy.form
            if request.delivered_tokens == 0:
                metrics[form].ttft.observe(now - request.arrival_time)
            else:
                metrics[form].itl.observe(now - request.last_token_time)
            request.last_token_time = now
            request.delivered_tokens += 1
            generated[form] = generated.get(form, 0) + 1
            if token == eos:
                continue
            detokenizer = request.detokenizer
            text = detokenizer.push(token)
            if text:
                request.emit(text)
            if detokenizer.stopped:
                request.finish(RequestStatus.FINISHED_STOP)
                stopped = True
        for form, count in generated.items():
            metrics[form].generated.inc(count)
        for done in batch.finishes:
            done.request.finish(done.status, done.error)
        for observe, value in batch.records:
            try:
                observe(value)
            except Exception:  # a metric must never stop the outputs
                logger.exception("recording a step observation failed")
        if stopped:
            self.on_stop()
