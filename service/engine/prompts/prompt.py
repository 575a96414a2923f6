"""What a prompt call takes and gives: each chunk's graph inputs, and a computed prompt on its way
to the row the scheduler reserved for it (service.engine.worker.runner computes them, the engine joins
them, the prefix cache keeps their blocks)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from contract.cache_policy import CachePolicy
from service.engine.kv import Array, RowEviction
from service.engine.kv.prefix import CachedPast


def chunk_inputs(
    token_ids: list[int], done: int, chunk_tokens: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """(end, input_ids, attention_mask, position_ids) of each chunk of one row's prompt after its
    first `done` tokens: the chunk attends to every token before it."""
    for start in range(done, len(token_ids), chunk_tokens):
        end = min(start + chunk_tokens, len(token_ids))
        ids = np.asarray([token_ids[start:end]], dtype=np.int64)
        yield end, ids, np.ones((1, end), dtype=np.int64), np.arange(start, end, dtype=np.int64)[None]


@dataclass(frozen=True)
class PromptRun:
    """One prompt to compute into a row (ModelRunner.prefill): its tokens after the first `done`,
    whose K/V `past` holds (a prefix-cache hit's blocks; a one-row array, (2 x layers, 1, heads, P,
    head_dim), of reused segments), through `policy` where that keeps fewer tokens than the prompt."""

    request_id: str
    token_ids: list[int]
    past: Array | CachedPast | None = None
    policy: CachePolicy | None = None

    @property
    def done(self) -> int:
        """Tokens whose K/V the past holds."""
        past = self.past
        return 0 if past is None else past.tokens if isinstance(past, CachedPast) else int(past.shape[3])

    @property
    def streams(self) -> bool:
        """No past, and a policy that keeps fewer tokens than the prompt: it streams through the policy."""
        n = len(self.token_ids)
        return self.past is None and self.policy is not None and self.policy.cached(n) < n


@dataclass
class PrefilledPrompt:
    """A computed prompt, ready to be written into its reserved row."""

    request_id: str
    logits: np.ndarray  # (vocab,) at the last position, float32, host
    cache: Array  # (2 x layers, heads, length, head_dim) on the store's device
    length: int
    policy: RowEviction | None = None  # the row's policy and eviction state (None: full, or set at join)


@dataclass
class StreamedPrompt(PrefilledPrompt):
    """A prompt computed through a bounded policy; with every position's logits when asked (scoring)."""

    all_logits: np.ndarray | None = None  # (T, vocab)
