"""Prompts and scoring on a split KV layout (KVLayout.local: a hybrid's local layers' K/V kept apart
from its global layers'), through the fused prompt graph.

A split row keeps its global layers' K/V of every token but its local layers' of the last window only,
so its prompts need their own bookkeeping: a local buffer that never holds more than a window and a
chunk, and the window before a prefix-cache hit, kept or recomputed. It lives here, apart from the
runner's other paths (runner.py), which makes one where its layout keeps a sliding-window group apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from service.engine.kv import Array, Backend, KVLayout, SlidingWindowSpec, SplitKV
from service.engine.kv.prefix import CachedPast
from service.engine.prompts.prompt import PrefilledPrompt, PromptRun, chunk_inputs
from service.engine.worker.model_session import LocalPast, ModelSession
from service.engine.worker.prompt_sessions import PromptLane

# ModelRunner._prompt_in_place: one row's chunk with its past in place -> (host logits, cache).
PromptInPlace = Callable[..., tuple[np.ndarray, Array]]


class SplitPrompts:
    """A split layout's prompt calls: chunked prompts, prefix-cache hits' local windows and every
    token's logits of a text, each through `prompt_in_place` (the runner's fused prompt call)."""

    def __init__(
        self, layout: KVLayout, window: SlidingWindowSpec, backend: Backend, dtype: str, prompt_in_place: PromptInPlace
    ) -> None:
        self.layout, self.window, self.backend, self.dtype = layout, window, backend, dtype
        self.prompt_in_place = prompt_in_place

    def fresh_local(self, mask: Array, width: int, past: Array) -> LocalPast:
        """The local inputs for a prompt call with no past (every caller's with a split layout): its
        mask is the call's, and a new array takes its local layers' K/V of every token."""
        assert past.shape[3] == 0, "a split layout's prompts with a past run in place (SplitPrompts.chunks)"
        layout, batch, tensors = self.layout, past.shape[1], self.window.tensors
        empty = self.backend.zeros((tensors, batch, layout.n_heads, 0, layout.head_dim), self.dtype)
        present = self.backend.zeros((tensors, batch, layout.n_heads, width, layout.head_dim), self.dtype)
        return LocalPast(mask, empty, present)

    def row_cache(self, cache: SplitKV, row: int, columns: slice) -> SplitKV:
        """One row's cache of a batched prompt call: its columns, the local K/V's last `local_width` of
        them at most (all a row keeps)."""
        local = cache.local_kv[:, row, :, columns]
        return SplitKV(cache.global_kv[:, row, :, columns], local[:, :, -self.window.width :])

    def logits(self, run: PromptRun, chunk_tokens: int) -> np.ndarray:
        """Every logit (len(token_ids) - done, vocab) of the run's tokens after its past (a one-row
        `SplitKV`), in chunks: the local layers never hold more than a window and a chunk."""
        kept: list[np.ndarray] = []
        for _ in self.chunks(run, chunk_tokens, PromptLane(), all_logits=kept):
            pass
        return np.concatenate(kept)

    def chunks(
        self, run: PromptRun, chunk_tokens: int, lane: PromptLane, all_logits: list[np.ndarray] | None = None
    ) -> Iterator[PrefilledPrompt | None]:
        """ModelRunner._chunks_in_place for a split layout: the global layers' cache array holds the whole
        prompt, the local layers' only the window before a chunk and the chunk (window - 1 + chunk_tokens
        columns, whatever the prompt's length): after each chunk its last window - 1 tokens move to the
        front. A cached past brings the local window before it (KVStore.cached_past). `all_logits`: gets
        every chunk's logits (S, vocab) (scoring)."""
        request_id, token_ids, done, past = run.request_id, run.token_ids, run.done, run.past
        session, scratch = lane.session, lane.scratch
        layout, room = self.layout, len(token_ids) - done
        keep = self.window.keep_tokens
        if isinstance(past, CachedPast) and past.repair:  # the cache kept no local window before the hit
            cache = past.assemble(room, scratch)
            local = self.repair_window(token_ids, done, past.repair, cache, session)
            held = int(local.shape[3])
        elif isinstance(past, CachedPast):
            cache, local, held = past.assemble(room, scratch), past.assemble_local(), past.local_tokens
        else:  # none, or a past computed by the caller (reused segments): SplitKV (2 x layers, 1, heads, P, hd)
            assert past is None or isinstance(past, SplitKV), "a split layout's past carries its local window"
            cache = self.backend.zeros((layout.tensors, 1, layout.n_heads, len(token_ids), layout.head_dim), self.dtype)
            local, held = None, 0
            if past is not None:
                cache[:, :, :, :done] = past.global_kv
                local = past.local_kv[:, :, :, -keep:]
                held = int(local.shape[3])
        columns = keep + min(chunk_tokens, room)
        buffer = self.backend.zeros((self.window.tensors, 1, layout.n_heads, columns, layout.head_dim), self.dtype)
        if local is not None:
            buffer[:, :, :, :held] = local
        for end, ids, mask, positions in chunk_inputs(token_ids, done, chunk_tokens):
            local_mask = np.ones((1, held + ids.shape[1]), dtype=np.int64)
            last_only = all_logits is None
            logits, cache = self.prompt_in_place(ids, mask, positions, cache, session, (local_mask, buffer), last_only)
            if all_logits is not None:
                all_logits.append(logits[0])
            held += ids.shape[1]
            if end == len(token_ids):
                start = max(0, held - self.window.width)
                kv = SplitKV(cache[:, 0], buffer[:, 0, :, start:held])
                yield PrefilledPrompt(request_id, logits[0, -1], kv, end)
                return
            if held > keep:  # the next chunk's local layers see the last window - 1 tokens before it
                buffer[:, :, :, :keep] = self.backend.copy(buffer[:, :, :, held - keep : held])
                held = keep
            yield None

    def repair_window(
        self, token_ids: list[int], end: int, repair: int, cache: Array, session: ModelSession | None
    ) -> Array:
        """The local layers' K/V of the window before token `end`, which the prefix cache did not keep:
        one call over the `repair` tokens before it (KVLayout.repair_tokens) after the cached global K/V
        in `cache`, whose own global K/V of those tokens (computed from a local past it did not have)
        are put back as cached. Returns (2 x local layers, 1, heads, window - 1 at most, head_dim)."""
        layout, start = self.layout, max(0, end - repair)
        cached = self.backend.copy(cache[:, :, :, start:end])
        shape = (self.window.tensors, 1, layout.n_heads, end - start, layout.head_dim)
        buffer = self.backend.zeros(shape, self.dtype)
        ids = np.asarray([token_ids[start:end]], dtype=np.int64)
        positions = np.arange(start, end, dtype=np.int64)[None]
        local_mask = np.ones((1, end - start), dtype=np.int64)
        self.prompt_in_place(ids, np.ones((1, end), dtype=np.int64), positions, cache, session, (local_mask, buffer))
        cache[:, :, :, start:end] = cached
        return buffer[:, :, :, max(0, end - start - self.window.keep_tokens) :]
