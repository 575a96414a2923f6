"""Next-token choice: greedy, temperature, top-k, top-p; seeded per request.

A sampled token's uniform is a function of the request's seed and the token's index alone
(`token_generator`): the index-th draw of PCG64(seed), the stream `np.random.default_rng(seed)`
gives. So a request resubmitted with its first k tokens (after the engine core restarted) draws
for token k exactly what an uninterrupted run draws there.
"""

from __future__ import annotations

import numpy as np

from service.engine.messages import TokenLogprob
from service.engine.request import Request, SamplingParams

# Below this, temperature sampling is greedy (dividing by it would overflow).
MIN_TEMPERATURE = 1e-5


class Sampler:
    """Each request draws from its own generator, seeded by the request, and each row's
    arithmetic depends on that row alone, so a request's samples do not depend on which
    other requests shared the batch (or on the batch's order). A request's generator is kept
    between steps with the token index its next draw is for; a draw for another index (a
    request that arrived with tokens already produced) starts one there (`token_generator`)."""

    def __init__(self) -> None:
        self._generators: dict[str, tuple[np.random.Generator, int]] = {}

    def sample(self, request_id: str, logits: np.ndarray, params: SamplingParams, index: int | None = None) -> int:
        """One request alone; logits: (vocab,) float; `index`: the token's (None: the one after the last drawn)."""
        token = self.sample_rows([request_id], [params], logits[None], None if index is None else [index])[0]
        if isinstance(token, Exception):
            raise token
        return token

    def sample_batch(self, requests: list[Request], logits: np.ndarray, greedy: bool = False) -> list[int | Exception]:
        """`greedy`: the caller knows every request is (a steady batch checks once, `all_greedy`).
        Each row is drawn from its processed logits (`processed_logits`)."""
        logits = processed_logits(logits, requests, [len(r.output_ids) for r in requests])
        if greedy or all_greedy(requests):
            return logits.argmax(axis=1).tolist()  # one argmax (as sample_rows would)
        indices = [len(r.output_ids) for r in requests]
        return self.sample_rows([r.request_id for r in requests], [r.params for r in requests], logits, indices)

    def sample_rows(
        self,
        request_ids: list[str],
        params: list[SamplingParams],
        logits: np.ndarray,
        indices: list[int] | None = None,
    ) -> list[int | Exception]:
        """One token per row of logits (n, vocab); `indices`: each row's token index (None: each
        request's next). Greedy rows share one argmax, rows with temperature alone one softmax and
        one inverse-CDF draw (a uniform from each row's own generator); rows with top-k / top-p
        filters go one by one. A row whose sampling fails gets the exception instead of a token."""
        sampled = [row for row, p in enumerate(params) if p.temperature >= MIN_TEMPERATURE]
        if len(sampled) < len(params):
            tokens: list[int | Exception] = logits.argmax(axis=1).tolist()
        else:  # every row draws (one that cannot keeps its mode: `_draw_rows`)
            tokens = [0] * len(params)
        if not sampled:
            return tokens
        plain = [row for row in sampled if params[row].top_k == 0 and params[row].top_p >= 1.0]
        if plain:
            # In place on one float64 copy: the arithmetic of probabilities(), so the same tokens,
            # with one array allocated instead of several.
            cdfs = (logits if len(plain) == len(params) else logits[plain]).astype(np.float64)
            cdfs /= np.array([[params[row].temperature] for row in plain])
            cdfs -= cdfs.max(axis=1, keepdims=True)
            np.exp(cdfs, out=cdfs)
            np.cumsum(cdfs, axis=1, out=cdfs)
            self._draw_rows(plain, cdfs, request_ids, params, indices, tokens, logits)
        if len(plain) == len(sampled):
            return tokens
        for row in sorted(set(sampled) - set(plain)):
            try:
                cdf = np.cumsum(probabilities(logits[row], params[row]))[None]
            except Exception as error:
                tokens[row] = error
                continue
            self._draw_rows([row], cdf, request_ids, params, indices, tokens, logits)
        return tokens

    def _draw_rows(
        self,
        rows: list[int],
        cdfs: np.ndarray,
        request_ids: list[str],
        params: list[SamplingParams],
        indices: list[int] | None,
        tokens: list[int | Exception],
        logits: np.ndarray,
    ) -> None:
        """Inverse-CDF draws for `rows` (their unnormalised cdfs, one per row): one uniform from each
        request's generator, then every row's token at once (the first index whose cdf exceeds it).
        A row whose total is not finite and positive (e.g. non-finite logits) gets its mode."""
        totals = cdfs[:, -1]
        uniforms = np.zeros(len(rows))
        generators = self._generators
        for index, row in enumerate(rows):
            request_id = request_ids[row]
            kept = generators.get(request_id)
            token = (kept[1] if kept is not None else 0) if indices is None else indices[row]
            if kept is not None and kept[1] == token:
                generator = kept[0]
            else:
                generator = token_generator(params[row].seed, token)
            uniforms[index] = generator.random()
            generators[request_id] = (generator, token + 1)
        valid = np.isfinite(totals) & (totals > 0)
        uniforms *= np.where(valid, totals, 0.0)
        # searchsorted(cdf, u, side="right") for each row: how many cdf entries are <= u.
        drawn = np.minimum((cdfs <= uniforms[:, None]).sum(axis=1), cdfs.shape[1] - 1).tolist()
        if not valid.all():
            modes = logits[rows].argmax(axis=1).tolist()
            drawn = [d if ok else mode for d, ok, mode in zip(drawn, valid.tolist(), modes, strict=True)]
        for index, row in enumerate(rows):
            tokens[row] = drawn[index]

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)


def processed_logits(logits: np.ndarray, requests: list[Request], generated: list[int]) -> np.ndarray:
    """What row i's token is drawn from, greedy or sampled: its request's logit_bias added, and its
    EOS logit masked while the request may not end yet after `generated[i]` new tokens (ignore_eos,
    min_tokens), so the token is still a sample of the other tokens (vLLM's logit-bias and min-tokens
    logits processors). `logits` itself when no row needs either, else a copy: the raw logits stay
    what log-probabilities report."""
    biased = [row for row, request in enumerate(requests) if request.params.logit_bias]
    banned = [row for row, request in enumerate(requests) if not request.params.eos_allowed(generated[row])]
    if not biased and not banned:
        return logits
    logits = np.array(logits, copy=True)
    for row in biased:
        ids, values = zip(*requests[row].params.logit_bias, strict=True)
        logits[row, list(ids)] += np.asarray(values, dtype=logits.dtype)
    if banned:
        logits[banned, [requests[row].eos_token_id for row in banned]] = -np.inf
    return logits


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in float64 (as Score's, contract.graph.target_logprobs)."""
    shifted = logits.astype(np.float64)
    shifted -= shifted.max(axis=-1, keepdims=True)
    shifted -= np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return shifted


def top_logprobs(logprobs: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's `top` likeliest tokens (ids, their log-probabilities), likeliest first; ties by
    lower id (a stable sort: over a vocabulary of 259 one sort is cheaper than a partition and a sort)."""
    ids = np.argsort(-logprobs, axis=-1, kind="stable")[:, :top]
    return ids, logprobs[np.arange(ids.shape[0])[:, None], ids]


def token_logprobs(logits: np.ndarray, tokens: list[int], top: list[int]) -> list[TokenLogprob]:
    """Row i's token `tokens[i]`: its log-probability under the model's own distribution (the raw
    logits' log-softmax, before temperature, top-k, top-p and the EOS mask: vLLM's default
    `raw_logprobs`) and its `top[i]` likeliest alternatives'. Only requests that ask call this."""
    logprobs = log_softmax(logits)
    chosen = logprobs[np.arange(len(tokens)), tokens].tolist()
    most = max(top, default=0)
    if not most:
        return [TokenLogprob(token, value) for token, value in zip(tokens, chosen, strict=True)]
    ids, values = top_logprobs(logprobs, most)
    ids_rows, value_rows = ids.tolist(), values.tolist()
    return [
        TokenLogprob(tokens[row], chosen[row], ids_rows[row][: top[row]], value_rows[row][: top[row]])
        for row in range(len(tokens))
    ]


def logprobs_by_row(
    requests: list[Request], logits: np.ndarray, tokens: list[int | Exception], asking: list[int]
) -> dict[int, TokenLogprob]:
    """The log-probabilities of the rows that ask for them (and sampled a token), by row (rows of
    `logits` align with `requests`; a request holds several rows in a speculative step)."""
    rows = [row for row in asking if not isinstance(tokens[row], Exception)]
    chosen = [tokens[row] for row in rows]
    top = [requests[row].params.logprobs or 0 for row in rows]
    picked = logits if len(rows) == len(logits) else logits[rows]
    return dict(zip(rows, token_logprobs(picked, chosen, top), strict=True))  # type: ignore[arg-type]


def token_generator(seed: int, index: int) -> np.random.Generator:
    """The generator whose next uniform is the one for token `index` of a request seeded `seed`:
    PCG64(seed) advanced by `index` draws (one 64-bit draw per uniform), in O(log index)."""
    bits = np.random.PCG64(seed)
    if index:
        bits.advance(index)
    return np.random.Generator(bits)


def all_greedy(requests: list[Request]) -> bool:
    return all(request.params.temperature < MIN_TEMPERATURE for request in requests)


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
