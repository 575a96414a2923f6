"""Speculative blocks: one call per capacity class verifies every row's last token and guesses at
once, reading the class's cache in place (service.engine.spec_decode says why). Two ways:

- A class with one row of full float32 rows that decodes through the fused graph verifies through
  the fused prompt graph bound to that row in place (GroupQueryAttention's continued prompt takes one
  row): the kernel writes every fed token's K/V after the row's last, and `commit` keeps the accepted
  ones and clears the columns of the rejected (the row ends as a plain run's would).
- Any other class verifies through the explicit serving graph over T tokens a row, which returns the
  new K/V apart: only the tokens a request keeps have theirs written into its row (`commit`).

Either way a rejected guess's K/V never stays in a row, a class's accounting or the prefix cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.engine.kv import Array, CapacityClass, KVStore
from service.engine.messages import MAX_SPECULATIVE_TOKENS
from service.engine.worker.decode_plan import DecodeCalls
from service.engine.worker.model_session import GraphBinder, LocalPast, ModelSession


@dataclass
class VerifyCall:
    """A class's speculative verification call: the explicit serving graph over `width` tokens a
    row, bound to the class's arrays in place and to its own inputs and outputs."""

    version: int
    width: int
    session: ModelSession
    binding: Any
    ids: Array  # (B, width)
    mask: Array  # (B, capacity + width)
    positions: Array  # (B, width)
    logits: Array  # (B, width, vocab)
    new_kv: Array  # (2 x layers, B, heads, width, head_dim)


@dataclass
class InPlaceCall:
    """A one-row class's verification through the fused prompt graph, its cache bound as past and
    present alike; token inputs and logits are views of `tokens`-wide buffers, bound anew each call."""

    version: int
    binding: Any
    ids: Array  # (1, tokens)
    mask: Array  # (1, capacity): all ones (the row is left-aligned; the view's width says how many count)
    positions: Array  # (1, tokens)
    logits: Array  # (1, tokens, vocab)
    local_mask: Array | None = None  # (1, local_width): all ones, a split row's (the view says how many count)


@dataclass
class Pending:
    """A verified class until `commit`: its call's new K/V (explicit graph), or None where the fused
    prompt graph wrote `written` tokens into its one row already."""

    klass: CapacityClass
    new_kv: Array | None
    written: list[int] | None = None  # per row: the tokens the fused prompt graph wrote after it


class BlockVerifier:
    """One model's verification calls (bound per class and block width) and the new K/V of the last
    verification until `commit` says how many of each row's tokens are kept."""

    def __init__(
        self, store: KVStore, binder: GraphBinder, calls: DecodeCalls, sessions: dict[str, ModelSession],
        pad_token_id: int, timings: Any, prompt_session: Callable[[], ModelSession | None] = lambda: None,
    ) -> None:  # fmt: skip
        """The runner's store, binder, plain decode calls, explicit sessions by storage kind and timings;
        `prompt_session` opens the fused prompt graph's session for the engine thread (None: none)."""
        self.store, self.backend, self.binder, self.calls = store, store.backend, binder, calls
        self.sessions, self.pad_token_id, self.timings = sessions, pad_token_id, timings
        self._open_prompt_session = prompt_session
        self._prompt_session: ModelSession | bool | None = False  # False: not opened yet
        self._verify_calls: dict[tuple[int, str], VerifyCall] = {}  # by class key
        self._in_place_calls: dict[tuple[int, str, int], InPlaceCall] = {}  # by class key and row
        self._pending: list[Pending] = []  # a verification's classes, until commit

    def verify(self, ids: list[str], fed: list[list[int]]) -> list[np.ndarray]:
        """One speculative step of every member of the store (`ids`, each fed `fed[i]`: its last token
        and its guesses): per class one call over all its rows' tokens at once (right-padded to the
        class's longest), reading the class's cache in place. Returns each sequence's logits after
        each token it was fed, (len(fed[i]), vocab). What a row keeps is settled by `commit`. A class
        whose rows all feed one token (or whose graph takes one token a row: the fused int8 graph's)
        decodes as a plain step, its tokens written at once (each keeps its one)."""
        index = {sequence: position for position, sequence in enumerate(ids)}
        out: list[np.ndarray | None] = [None] * len(ids)
        self._pending = []
        for klass in self.store.batches():
            picks = [index[member] for member in klass.members]
            widths = [len(fed[pick]) for pick in picks]
            width = max(widths)
            started = time.perf_counter()
            if width == 1 or not self.verifies(klass):
                assert width == 1, f"class of kind {klass.kind} takes one token a row"
                call = self.calls.get(klass)
                self.binder.set_ids(klass.input_ids[: len(picks), 0], [fed[pick][0] for pick in picks])
                call.session.run(call.binding)
                after_graph = time.perf_counter()
                klass.append_step(call.new_kv)
                logits = self.backend.download(call.logits).astype(np.float32, copy=False)
            elif self._in_place(klass):
                logits = self._verify_rows_in_place(klass, [fed[pick] for pick in picks])
                after_graph = time.perf_counter()
                self._pending.append(Pending(klass, None, widths))
            else:
                verify = self._verify_call(klass, width)
                tokens = np.full((len(picks), width), self.pad_token_id, dtype=np.int64)
                for row, pick in enumerate(picks):
                    tokens[row, : widths[row]] = fed[pick]
                verify.ids[...] = self.backend.upload(tokens)
                verify.mask[:, : klass.capacity] = klass.mask[: len(picks), : klass.capacity]
                verify.positions[...] = klass.positions[: len(picks)] + self.backend.arange(width)[None]
                verify.session.run(verify.binding)
                after_graph = time.perf_counter()
                logits = self.backend.download(verify.logits).astype(np.float32, copy=False)
                self._pending.append(Pending(klass, verify.new_kv))
            for row, pick in enumerate(picks):
                out[pick] = logits[row, : widths[row]]
            self.timings.cache += time.perf_counter() - after_graph
            self.timings.graph += after_graph - started
        assert all(logits is not None for logits in out), "a speculative step feeds every member of the store"
        return out  # type: ignore[return-value]

    def commit(self, kept: dict[str, int]) -> None:
        """After `verify`: the K/V of the first `kept[sequence]` tokens each row was fed are its row's
        (those of rejected guesses are never written, or cleared where the fused kernel wrote them)."""
        started = time.perf_counter()
        for pending in self._pending:
            klass = pending.klass
            for row, member in enumerate(list(klass.members)):
                if pending.new_kv is None:
                    assert pending.written is not None
                    klass.keep_written(row, kept[member], pending.written[row])
                else:
                    klass.append_tokens(row, pending.new_kv[:, row, :, : kept[member]])
        self._pending = []
        self.timings.cache += time.perf_counter() - started

    def verifies(self, klass: CapacityClass) -> bool:
        """Whether a class's rows can verify several tokens in one call: every kind the explicit
        serving graphs read (float, per-token int8); the int8-channel rows' fused graph takes one."""
        return klass.spec.verifies_blocks

    def _in_place(self, klass: CapacityClass) -> bool:
        """A one-row class of full float32 rows decoding through the fused graph, where the export has
        the fused prompt graph: its verification runs there, in place. A class of split rows always
        does (one call per row: the explicit graph cannot read their local columns)."""
        one_row = len(klass.members) == 1 and klass.spec.full_float32 and self.calls.fused(klass)
        if not one_row and klass.local is None:
            return False
        if self._prompt_session is False:
            self._prompt_session = self._open_prompt_session()
        return self._prompt_session is not None

    def _verify_rows_in_place(self, klass: CapacityClass, fed: list[list[int]]) -> np.ndarray:
        """`_verify_in_place` for each row: host logits (B, the longest fed, vocab)."""
        if len(fed) == 1:
            return self._verify_in_place(klass, fed[0], 0)
        out = np.zeros((len(fed), max(map(len, fed)), self.binder.vocab_size), dtype=np.float32)
        for row, tokens in enumerate(fed):
            out[row, : len(tokens)] = self._verify_in_place(klass, tokens, row)[0]
        return out

    def _verify_in_place(self, klass: CapacityClass, fed: list[int], row: int) -> np.ndarray:
        """The fused prompt graph over the row's fed tokens after its past, bound to the row itself
        (a split row's local columns too, first shifted back to its window if the block would not fit
        after them): host logits (1, len(fed), vocab), a view of the call's buffer (good until the next call)."""
        session = self._prompt_session
        assert isinstance(session, ModelSession)
        key = (*klass.key, row)
        call = self._in_place_calls.get(key)
        backend, width = self.backend, len(fed)
        if call is None or call.version != klass.version:
            call = self._in_place_call(session, klass, row)
            self._in_place_calls[key] = call
        length = int(klass.lengths[row])
        assert length + width <= klass.capacity, "the scheduler reserves room for every guess"
        call.ids[0, :width] = backend.upload(np.asarray(fed, dtype=np.int64))
        call.positions[0, :width] = klass.positions[row, 0] + backend.arange(width)
        local_mask = None
        if klass.local is not None:
            klass.local.make_room(row, width)
            local_mask = call.local_mask[:, : int(klass.local.lengths[row]) + width]
        self.binder.rebind_prompt(
            session, call.binding, call.ids[:, :width], call.mask[:, : length + width],
            call.positions[:, :width], call.logits[:, :width], local_mask,
        )  # fmt: skip
        session.run(call.binding)
        return backend.download(call.logits[:, :width])

    def _in_place_call(self, session: ModelSession, klass: CapacityClass, row: int) -> InPlaceCall:
        """A row's verification call through the fused prompt graph, bound to the row (each of its
        tensors' row is contiguous) and to `MAX_SPECULATIVE_TOKENS + 1`-wide token buffers."""
        backend, most = self.backend, MAX_SPECULATIVE_TOKENS + 1
        ids, positions = backend.zeros((1, most), "int64"), backend.zeros((1, most), "int64")
        mask = backend.zeros((1, klass.capacity), "int64")
        mask[...] = 1
        logits = backend.zeros((1, most, self.binder.vocab_size), "float32")
        past = klass.arrays[0][:, row : row + 1]
        local, local_mask = None, None
        if klass.local is not None:
            local_mask = backend.zeros((1, klass.local.width), "int64")
            local_mask[...] = 1
            local = LocalPast(local_mask[:, :1], klass.local.cache[:, row : row + 1])
        binding, _ = self.binder.bind_prompt_in_place(
            session, ids[:, :1], mask[:, :1], positions[:, :1], past, local
        )  # fmt: skip
        return InPlaceCall(klass.version, binding, ids, mask, positions, logits, local_mask)

    def _verify_call(self, klass: CapacityClass, width: int) -> VerifyCall:
        """The class's verification call for `width` tokens a row, bound once to its arrays (re-made
        when the class changes, or the width does)."""
        call = self._verify_calls.get(klass.key)
        if call is not None and call.version == klass.version and call.width == width:
            return call
        batch, backend = len(klass.members), self.backend
        ids = backend.zeros((batch, width), "int64")
        mask = backend.zeros((batch, klass.capacity + width), "int64")
        mask[:, klass.capacity :] = 1
        positions = backend.zeros((batch, width), "int64")
        session = self.sessions[klass.kind]
        past = [array[:, :batch] for array in klass.arrays]
        binding, logits, new_kv = self.binder.bind(session, ids, mask, positions, past, klass.kind)
        call = VerifyCall(klass.version, width, session, binding, ids, mask, positions, logits, new_kv)
        self._verify_calls[klass.key] = call
        return call

    def forget(self, exists: Any, everything: bool = False) -> None:
        """Drop the calls of classes that no longer exist (`exists(key)` false), or all of them."""
        for calls in (self._verify_calls, self._in_place_calls):
            for key in [key for key in calls if everything or not exists(key[:2])]:
                del calls[key]
