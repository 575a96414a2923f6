"""A batch's decode calls resolved once (vLLM's persistent batch): what the runner binds per
capacity class (`DecodeCalls`) and what the engine's steady batch holds on to between steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from service.engine.kv import Array, CapacityClass, StorageSpec
from service.engine.worker.model_session import GraphBinder, LocalPast, ModelSession


@dataclass
class DecodeCall:
    """A class's decode call, bound once for its current arrays and batch size."""

    version: int
    session: ModelSession
    binding: ort.IOBinding
    new_kv: Array | None  # (2 x layers, B, heads, 1, head_dim), bound outputs; None: written in place
    logits: Array  # (B, 1, vocab)


@dataclass
class DecodePlan:
    """A batch's decode calls resolved once (vLLM's persistent batch): each capacity class with
    its bound call and where its members' tokens come from. Good while the store's classes and
    their members stay as they are; the engine's steady batch keeps one for as long as it lasts,
    so a step only writes each row's token, runs the calls and advances the rows."""

    ids: list[str]  # the sequences, in the caller's order
    parts: list[tuple[CapacityClass, DecodeCall, list[int] | None]]  # class, call, its members' indexes in ids
    order: np.ndarray | None  # for each of ids, its row of the classes' logits stacked (None: the same)


class DecodeCalls:
    """Each capacity class's decode call, bound to the leading rows of its arrays and preallocated
    outputs, and re-made only when the class is re-allocated or its membership changes."""

    def __init__(
        self,
        binder: GraphBinder,
        sessions: dict[str, ModelSession],
        fused_session: ModelSession | None,
        fused_rows: StorageSpec | None,
    ) -> None:
        """`sessions`: the explicit serving graph's per storage kind (int8-channel rows: the fused int8
        graph's); `fused_session`: the fused decode graph's for full rows stored as `fused_rows`, if any."""
        self._binder, self._sessions = binder, sessions
        self._fused_session, self._fused_rows = fused_session, fused_rows
        self.by_class: dict[tuple[int, str], DecodeCall] = {}  # by the class key (capacity, kind)

    def get(self, klass: CapacityClass) -> DecodeCall:
        call = self.by_class.get(klass.key)
        if call is not None and call.version == klass.version:
            return call
        batch = len(klass.members)
        past = [array[:, :batch] for array in klass.arrays]
        inputs = (klass.input_ids[:batch], klass.mask[:batch], klass.positions[:batch])
        if self.fused(klass):
            fused = self._sessions[klass.kind] if klass.spec.written_by_kernel else self._fused_session
            assert fused is not None
            local = None if klass.local is None else LocalPast(klass.local.mask[:batch], klass.local.cache[:, :batch])
            binding, logits = self._binder.bind_in_place(fused, *inputs, past[0], local)
            call = DecodeCall(klass.version, fused, binding, None, logits)
        else:
            assert klass.local is None, "split rows decode through the fused graph (it reads their local columns)"
            session = self._sessions[klass.kind]
            binding, logits, new_kv = self._binder.bind(session, *inputs, past, klass.kind)
            call = DecodeCall(klass.version, session, binding, new_kv, logits)
        self.by_class[klass.key] = call
        return call

    def fused(self, klass: CapacityClass) -> bool:
        """The fused graph takes a class of full rows in its own dtype (it cannot shift a bounded
        row by one token, nor read int8 rows' per-token scales); the fused int8 graph takes the
        int8-channel classes (unbounded rows only)."""
        if klass.spec.written_by_kernel:
            return True
        return self._fused_session is not None and klass.spec == self._fused_rows and not klass.bounded

    def forget(self, exists: Callable[[tuple[int, str]], bool], everything: bool = False) -> None:
        """Drop the bindings (and output buffers) of classes that no longer exist, or all of them."""
        for key in [key for key in self.by_class if everything or not exists(key)]:
            del self.by_class[key]
