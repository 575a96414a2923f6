"""Reusable prompt segments: a document's K/V computed once on its own, from position 0, and placed
wherever the document lands in later prompts (position-independent caching: EPIC, CacheBlend).

What placing needs is the scheme's declaration (contract.manifest.SegmentReuse), never its name:
`as_is` copies the K/V (keys carry no position: the bias is applied where a key lands, from its
column in the row); `rotate` turns the keys by the offset first (RoPE); `recompute` reuses nothing
(the segment is computed in place like any text). A reused segment's tokens never attended to the
text before it; the repair (EPIC's LegoLink) recomputes the first k tokens of each reused segment in
full context. The prompt's last token is always computed: its logits are the first token's.

The text before the first reused segment is exact, so only its blocks enter the prefix cache; the
segments' own K/V are entries of the same cache, inside the same budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from contract.manifest import REUSE_RECOMPUTE, REUSE_ROTATE, SegmentReuse
from service.engine.kv import Array, Backend, KVStore, SplitKV
from service.engine.kv.classes import rotate_keys
from service.engine.kv.prefix import CachedPast
from service.engine.prompts.prompt import PrefilledPrompt, PromptRun
from service.engine.request import Request
from service.engine.worker.runner import ModelRunner


def keys_moved(
    backend: Backend,
    kv: Array,
    rows: list[int],
    columns: tuple[int, int],
    offset: int,
    inv_freq: np.ndarray,
    dtype: str,
) -> Array:
    """A copy of `kv` (entries, heads, T, width) whose `rows` are turned by `offset` in `columns` [start, stop)
    alone: a RoPE key's every column, a latent attention entry's rotated key but not its latent."""
    start, stop = columns
    placed = backend.copy(kv)
    placed[rows, ..., start:stop] = rotate_keys(backend, kv[rows][..., start:stop], offset, inv_freq, dtype)
    return placed


@dataclass
class SegmentedPrompt(PrefilledPrompt):
    """A prompt assembled from computed text and reused segments."""

    computed: list[tuple[tuple[int, ...], Array]] = field(default_factory=list)  # segments computed here
    reused_tokens: int = 0


class SegmentAssembly:
    """One prompt's prefill with reused segments, run on the prefill worker's thread."""

    def __init__(self, runner: ModelRunner, reuse: SegmentReuse, chunk_tokens: int) -> None:
        self.runner, self.reuse, self.chunk_tokens = runner, reuse, chunk_tokens

    def _compute(self, request_id: str, token_ids: list[int], past: Array | CachedPast | None) -> PrefilledPrompt:
        """`token_ids` after the `past` they extend, computed in that context."""
        *_, result = self.runner.prefill([PromptRun(request_id, token_ids, past)], self.chunk_tokens)
        assert result is not None
        return result[0]

    def _append(self, past: Array | None, piece: Array, start: int, stop: int) -> Array:
        """past (2 x layers, 1, heads, P, hd) and the tokens [start, stop) of a segment's placed K/V
        (2 x layers, heads, T, hd): one contiguous array. A split layout's (SplitKV): the global K/V
        alike, and the local K/V of the last tokens, which the segment's own local K/V end (a segment
        computed alone keeps its last `local_width` tokens' at most, and a span ends at most one token
        before its segment's end: the window before the next computed token is always there)."""
        backend = self.runner.backend
        if not isinstance(piece, SplitKV):
            piece = piece[:, None, :, start:stop]
            return backend.concatenate([piece] if past is None else [past, piece], axis=3)
        length, held = int(piece.global_kv.shape[2]), int(piece.local_kv.shape[2])
        first = max(start, length - held)  # the segment's first token whose local K/V it holds
        local = piece.local_kv[:, None, :, first - (length - held) : stop - (length - held)]
        glob = piece.global_kv[:, None, :, start:stop]
        if past is None:
            return SplitKV(glob, local)
        if first == start:  # the local K/V run on from the past's
            window = self.runner.layout.local
            assert window is not None, "a split cache comes from a split layout"
            local = backend.concatenate([past.local_kv, local], axis=3)[:, :, :, -window.width :]
        return SplitKV(backend.concatenate([past.global_kv, glob], axis=3), local)

    def placed(self, kv: Array, offset: int) -> Array:
        """A segment's K/V computed from position 0, as it serves at `offset` (a split layout's: the
        rotated layers' keys in the global and the local K/V alike)."""
        if self.reuse.mode != REUSE_ROTATE or offset == 0:
            return kv
        if isinstance(kv, SplitKV):
            layout = self.runner.layout
            assert layout.local is not None, "a split cache comes from a split layout"
            return SplitKV(
                self._rotated(kv.global_kv, offset, layout.full.layers),
                self._rotated(kv.local_kv, offset, layout.local.layers),
            )
        return self._rotated(kv, offset, tuple(range(kv.shape[0] // self.runner.layout.per_layer)))

    def _rotated(self, kv: Array, offset: int, layers: tuple[int, ...]) -> Array:
        """The cache of these layers, (per_layer x len(layers), heads, T, width), with the rotated layers' keys
        turned by `offset`: only the columns that carry the rotation (latent attention: its rotated key, not
        its latent), every other byte as it was."""
        assert self.reuse.rotary_inv_freq is not None
        layout, rotated = self.runner.layout, self.reuse.rotated_layers
        rows = [layout.per_layer * index for index, layer in enumerate(layers) if rotated is None or layer in rotated]
        if not rows:
            return kv
        columns = layout.rotated_columns
        return keys_moved(self.runner.backend, kv, rows, columns, offset, self.reuse.rotary_inv_freq, self.runner.dtype)

    def run(
        self,
        request_id: str,
        token_ids: list[int],
        spans: tuple[tuple[int, int], ...],
        cached: list[Array | None],
        repair: int,
        hit: CachedPast | None,
    ) -> SegmentedPrompt:
        """The prompt's K/V and last logits: text in context, reused segments placed (the first `repair`
        tokens of each recomputed in context); `hit`: the prefix cache's, ending before the first span
        starts (SegmentReuser.hit_tokens), so the text before it computes after the hit as any prompt
        does and no one-row copy of the hit is made here."""
        past: Array | CachedPast | None = hit
        done = 0 if hit is None else hit.tokens
        assert hit is None or not spans or spans[0][0] > done, "a hit ends before the first reused segment"
        last = len(token_ids) - 1  # always computed
        prompt: PrefilledPrompt | None = None
        computed: list[tuple[tuple[int, ...], Array]] = []
        reused = 0
        for (start, end), kv in zip(spans, cached, strict=True):
            if start > done:
                prompt = self._compute(request_id, token_ids[:start], past)
                past, done = _batched(prompt.cache), start
            if kv is None:
                segment = tuple(token_ids[start:end])
                kv = self._compute(request_id, list(segment), None).cache
                computed.append((segment, kv))
            stop = min(end, last)
            if repair > 0 and start < stop:
                prompt = self._compute(request_id, token_ids[: min(start + repair, stop)], past)
                past, done = _batched(prompt.cache), min(start + repair, stop)
            if done < stop:
                assert not isinstance(past, CachedPast), "the text before a span computes after the hit"
                past = self._append(past, self.placed(kv, start), done - start, stop - start)
                reused += stop - done
                done = stop
        if done < len(token_ids):
            prompt = self._compute(request_id, token_ids, past)
        assert prompt is not None and prompt.length == len(token_ids)
        return SegmentedPrompt(request_id, prompt.logits, prompt.cache, prompt.length, None, computed, reused)


def _batched(kv: Array) -> Array:
    """A row's K/V (2 x layers, heads, T, hd) as a one-row past (2 x layers, 1, heads, T, hd)."""
    return SplitKV(kv.global_kv[:, None], kv.local_kv[:, None]) if isinstance(kv, SplitKV) else kv[:, None]


class SegmentReuser:
    """One model's reusable segments as its engine loop uses them (engine thread)."""

    def __init__(self, store: KVStore, model: str, assembly: SegmentAssembly) -> None:
        self.store, self.model, self.assembly = store, model, assembly

    def applies(self, request: Request) -> bool:
        """The model can reuse and the prompt has reusable segments that its policy keeps whole."""
        tokens = len(request.prefill_ids)
        if self.assembly.reuse.mode == REUSE_RECOMPUTE or not request.segments:
            return False
        return request.cache_policy.cached(tokens) == tokens

    def exact_tokens(self, request: Request) -> int | None:
        """Leading tokens whose K/V equal a fresh prefill's (before the first reused segment); None: all."""
        return request.segments[0][0] if self.applies(request) else None

    def hit_tokens(self, request: Request) -> int | None:
        """The most leading tokens a prefix-cache hit may bring: one fewer than `exact_tokens`, so the
        text before the first segment always has a token to compute after the hit, and the hit joins the
        prompt through the runner's one way in (ModelRunner.prefill) whatever the layout."""
        exact = self.exact_tokens(request)
        return None if exact is None else max(0, exact - 1)

    def _key(self, request: Request, tokens: tuple[int, ...]) -> int:
        return hash(("segment", self.model, request.cache_policy.form, request.cache_salt, tokens))

    def compute(self, request: Request, past: CachedPast | None) -> Callable[[], PrefilledPrompt] | None:
        """The prefill of a request with reused segments, for the prefill worker (None: a plain prefill)."""
        if not self.applies(request):
            return None
        token_ids, spans = request.prefill_ids, request.segments
        segments = [tuple(token_ids[start:end]) for start, end in spans]
        cached = [self.store.cached_segment(self._key(request, tokens), tokens) for tokens in segments]
        repair = request.segment_repair_tokens
        return lambda: self.assembly.run(request.request_id, token_ids, spans, cached, repair, past)

    def keep(self, request: Request, prompt: PrefilledPrompt) -> None:
        """Segments computed for this prompt are kept; the usage learns how many tokens were reused."""
        if not isinstance(prompt, SegmentedPrompt):
            return
        for tokens, kv in prompt.computed:
            self.store.cache_segment(self._key(request, tokens), tokens, kv, request.cache_policy.form)
        if request.attempt == 0:
            request.reused_prompt_tokens = prompt.reused_tokens
