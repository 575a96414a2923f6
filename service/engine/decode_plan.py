"""A batch's decode calls resolved once (vLLM's persistent batch): what the runner binds per
capacity class and what the engine's steady batch holds on to between steps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from service.engine.kv import Array, CapacityClass
from service.engine.model_session import ModelSession


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
