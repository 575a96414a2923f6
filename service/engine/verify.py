"""Speculative blocks through the serving graph (service.engine.speculative says why): one call per
capacity class verifies every row's last token and guesses at once, reading the class's cache in
place; only the tokens a request keeps have their K/V written into its row afterwards (`commit`),
so a rejected guess never enters the store."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.engine.decode_plan import DecodeCalls
from service.engine.kv import INT8_CHANNEL, Array, CapacityClass, KVStore
from service.engine.model_session import GraphBinder, ModelSession


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


class BlockVerifier:
    """One model's verification calls (bound per class and block width) and the new K/V of the last
    verification until `commit` says how many of each row's tokens are kept."""

    def __init__(
        self, store: KVStore, binder: GraphBinder, calls: DecodeCalls, sessions: dict[str, ModelSession],
        pad_token_id: int, timings: Any,
    ) -> None:  # fmt: skip
        """The runner's store, binder, plain decode calls, explicit sessions by storage kind and timings."""
        self.store, self.backend, self.binder, self.calls = store, store.backend, binder, calls
        self.sessions, self.pad_token_id, self.timings = sessions, pad_token_id, timings
        self._verify_calls: dict[tuple[int, str], VerifyCall] = {}  # by class key
        self._pending: list[tuple[CapacityClass, Array]] = []  # a verification's new K/V, until commit

    def verify(self, ids: list[str], fed: list[list[int]]) -> list[np.ndarray]:
        """One speculative step of every member of the store (`ids`, each fed `fed[i]`: its last token
        and its guesses): per class one call of the serving graph over all its rows' tokens at once
        (right-padded to the class's longest), reading the class's cache in place. Returns each
        sequence's logits after each token it was fed, (len(fed[i]), vocab). Nothing is written into
        the store until `commit` says how many of each row's tokens are kept. A class whose rows all
        feed one token (or whose graph takes one token a row: the fused int8 graph's) decodes as a
        plain step, its tokens written at once (each keeps its one)."""
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
                self._pending.append((klass, verify.new_kv))
            for row, pick in enumerate(picks):
                out[pick] = logits[row, : widths[row]]
            self.timings.cache += time.perf_counter() - after_graph
            self.timings.graph += after_graph - started
        assert all(logits is not None for logits in out), "a speculative step feeds every member of the store"
        return out  # type: ignore[return-value]

    def commit(self, kept: dict[str, int]) -> None:
        """After `verify`: the K/V of the first `kept[sequence]` tokens each row was fed enter its row
        (those of rejected guesses are never written anywhere)."""
        started = time.perf_counter()
        for klass, new_kv in self._pending:
            for row, member in enumerate(list(klass.members)):
                klass.append_tokens(row, new_kv[:, row, :, : kept[member]])
        self._pending = []
        self.timings.cache += time.perf_counter() - started

    def verifies(self, klass: CapacityClass) -> bool:
        """Whether a class's rows can verify several tokens in one call: every kind the explicit
        serving graphs read (float, per-token int8); the int8-channel rows' fused graph takes one."""
        return klass.kind != INT8_CHANNEL

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
        for key in [key for key in self._verify_calls if everything or not exists(key)]:
            del self._verify_calls[key]
