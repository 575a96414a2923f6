"""Output processing: sampled tokens become text, stops and metrics (vLLM v1's output processor).

Given one step's logits for some requests, it samples each request's token, appends it,
streams the new text, and says which requests are done and why. It never touches the cache:
the engine core finishes the requests it names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.engine.request import Request, RequestStatus
from service.engine.sampler import Sampler

logger = logging.getLogger(__name__)


# (observe, value): apply observe(value), now or on another thread (service.engine.core.StepOutputs).
Record = Callable[[Callable[[Any], None], Any], None]


def apply_now(observe: Callable[[Any], None], value: Any) -> None:
    observe(value)


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


class OutputProcessor:
    def __init__(self, eos_token_id: int, metrics: dict[str, TokenMetrics]) -> None:
        """`metrics`: by cache-policy form (CachePolicy.form), each request's tokens counted under its own."""
        self.sampler = Sampler()
        self.eos_token_id = eos_token_id
        self._metrics = metrics
        # How token metrics are applied (ModelEngine.record: at once, or later on another thread).
        self.record: Record = apply_now

    def process(self, requests: list[Request], logits: np.ndarray) -> list[Finished]:
        """Sample one token per request (rows of logits), stream the new text; the requests now done."""
        tokens = self.sampler.sample_batch(requests, logits)
        now = time.monotonic()
        record = self.record
        finished: list[Finished] = []
        generated: dict[str, int] = {}  # by policy form: one increment per form and step
        for request, token in zip(requests, tokens, strict=True):
            if request.status.finished:
                continue
            if isinstance(token, Exception):  # one request's sampling failure ends that request only
                logger.error("sampling failed for %s: %s", request.request_id, token)
                finished.append(Finished(request, RequestStatus.FINISHED_ERROR, f"sampling failed: {token}"))
                continue
            form = request.cache_policy.form
            if request.first_token_time is None:
                request.first_token_time = now
                record(self._metrics[form].ttft.observe, now - request.arrival_time)
            else:
                record(self._metrics[form].itl.observe, now - request.last_token_time)
            request.last_token_time = now
            request.output_ids.append(token)
            generated[form] = generated.get(form, 0) + 1
            if token == self.eos_token_id:
                finished.append(Finished(request, RequestStatus.FINISHED_EOS))
                continue
            text = request.detokenizer.push(token)
            if text:
                request.emit(text)
            if request.detokenizer.stopped:
                finished.append(Finished(request, RequestStatus.FINISHED_STOP))
            elif len(request.output_ids) >= request.params.max_new_tokens:
                finished.append(Finished(request, RequestStatus.FINISHED_LENGTH))
        for form, count in generated.items():
            record(self._metrics[form].generated.inc, count)
        return finished

    def forget(self, request: Request) -> None:
        self.sampler.forget(request.request_id)
