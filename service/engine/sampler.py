"""Next-token choice: greedy, temperature, top-k, top-p; seeded per request."""

from __future__ import annotations

import numpy as np

from service.engine.request import Request, SamplingParams

# Below this, temperature sampling is greedy (dividing by it would overflow).
MIN_TEMPERATURE = 1e-5


class Sampler:
    """Each request draws from its own generator, seeded by the request, so its samples do
    not depend on which other requests shared the batch."""

    def __init__(self) -> None:
        self._generators: dict[str, np.random.Generator] = {}

    def sample(self, request_id: str, logits: np.ndarray, params: SamplingParams) -> int:
        """logits: (vocab,) float."""
        if params.temperature < MIN_TEMPERATURE:
            return int(np.argmax(logits))
        generator = self._generators.get(request_id)
        if generator is None:
            generator = self._generators[request_id] = np.random.default_rng(params.seed)
        probs = probabilities(logits, params)
        if not np.all(np.isfinite(probs)):  # e.g. non-finite logits: fall back to the mode
            return int(np.argmax(logits))
        return int(generator.choice(len(logits), p=probs))

    def sample_batch(self, requests: list[Request], logits: np.ndarray) -> list[int | Exception]:
        """One token per row of logits (n, vocab): greedy rows in one argmax, the rest one by
        one; a row whose sampling fails gets the exception instead of a token."""
        tokens: list[int | Exception] = logits.argmax(axis=1).tolist()
        for row, request in enumerate(requests):
            if request.params.temperature >= MIN_TEMPERATURE:
                try:
                    tokens[row] = self.sample(request.request_id, logits[row], request.params)
                except Exception as error:
                    tokens[row] = error
        return tokens

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampled from, after temperature, top-k and top-p (nucleus) filters."""
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < len(scaled):
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = cumulative - probs[order] < params.top_p  # smallest prefix reaching top_p
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs
