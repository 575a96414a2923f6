"""A prompt longer than a bounded cache policy's budget, computed as that policy sees it: through a
private row that evicts (and quantizes) as the store's rows do, one token per graph call past the budget.

Its own module, apart from the runner (runner.py): it is the one prompt path that steps a row of its
own rather than calling the prompt graph, and the runner only picks its session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from contract.cache_policy import CachePolicy
from service.engine.kv import Array, CapacityClass
from service.engine.prompts.prompt import StreamedPrompt
from service.engine.worker.model_session import GraphBinder, ModelSession

# A prompt streaming through a bounded policy lets other prompts run after this many tokens.
STREAM_TOKENS_PER_YIELD = 64

# ModelRunner._prompt_forward: one prompt call -> (host logits, the whole cache, past and new).
PromptForward = Callable[..., tuple[np.ndarray, Array]]


class PolicyStream:
    """Streams prompts through bounded policies (ModelRunner.prefill, ModelRunner.score): their heads through
    `prompt_forward`, the rest through rows bound by `binder`, whose eviction state the layout makes."""

    def __init__(
        self,
        binder: GraphBinder,
        rotary_inv_freq: np.ndarray | None,
        prompt_forward: PromptForward,
    ) -> None:
        self.binder, self.rotary_inv_freq = binder, rotary_inv_freq
        self.prompt_forward = prompt_forward

    def stream(
        self,
        request_id: str,
        token_ids: list[int],
        policy: CachePolicy,
        session: ModelSession,
        chunk_tokens: int,
        keep_logits: bool = False,
        head_tokens: int | None = None,
    ) -> Iterator[StreamedPrompt | None]:
        """A prompt longer than a bounded policy's budget B, as the policy sees it: its first B tokens
        (or `head_tokens`) in float32 chunks (nothing is evicted yet), then one token per graph call
        of `session` through a private row of the policy's storage kind that evicts (and quantizes) as
        the store's rows do. Yields None between pieces of work (after every chunk, and every
        STREAM_TOKENS_PER_YIELD tokens), then the result."""
        capacity = policy.cached(len(token_ids))
        budget = capacity if head_tokens is None else min(head_tokens, capacity)
        assert len(token_ids) > budget
        binder = self.binder
        backend, layout = binder.backend, binder.layout
        kind = layout.kind_of(policy)
        head = token_ids[:budget]
        kept: list[np.ndarray] = []
        past: Array | None = None
        last = np.empty(0, dtype=np.float32)
        for start in range(0, len(head), chunk_tokens):
            chunk = head[start : start + chunk_tokens]
            end = start + len(chunk)
            ids = np.asarray([chunk], dtype=np.int64)
            positions = np.arange(start, end, dtype=np.int64)[None]
            mask = np.ones((1, end), dtype=np.int64)
            logits, past = self.prompt_forward(ids, mask, positions, past, not keep_logits)
            if keep_logits:
                kept.append(logits[0])
            last = logits[0, -1]
            yield None
        assert past is not None
        row = CapacityClass(backend, layout, capacity, 1, self.rotary_inv_freq, kind)
        row.write(request_id, past[:, 0], len(head), layout.row_eviction(policy))
        new_kv, inputs = None, (row.input_ids, row.mask, row.positions)
        if row.spec.written_by_kernel:  # the fused int8 graph appends each token's K/V in the row itself
            binding, step_logits = binder.bind_in_place(session, *inputs, row.arrays[0])
        else:
            binding, step_logits, new_kv = binder.bind(session, *inputs, row.arrays, kind)
        for done, token in enumerate(token_ids[budget:], start=1):
            binder.set_ids(row.input_ids[:, 0], np.asarray([token], dtype=np.int64))
            session.run(binding)
            row.append_step(new_kv)
            last = backend.download(step_logits[0]).astype(np.float32)  # (1, vocab), a copy
            if keep_logits:
                kept.append(last)
            last = last[-1]
            if done % STREAM_TOKENS_PER_YIELD == 0:
                yield None
        all_logits = np.concatenate(kept) if keep_logits else None
        yield StreamedPrompt(request_id, last, row.row_cache(0), int(row.lengths[0]), row.policies[0], all_logits)
