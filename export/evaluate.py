"""Quality through ONNX Runtime: bits per byte on held-out text at a given context length."""

from __future__ import annotations

import math

import numpy as np

from export.runtime import OnnxCausalLM
from models.limits import PositionLimitError


def evaluation_sequences(stream: np.ndarray, context: int, count: int, bos_token_id: int) -> list[list[int]]:
    """`count` evenly spaced windows of `context` tokens to predict, each preceded by BOS.

    The model sees `context` tokens (positions 0..context-1), as in training.
    """
    starts = np.linspace(0, len(stream) - context - 1, count).astype(np.int64)
    return [[bos_token_id, *stream[s : s + context].tolist()] for s in starts]


def bits_per_byte(runtime: OnnxCausalLM, sequences: list[list[int]]) -> float | None:
    """Mean bits per predicted byte, or None when the model cannot represent the length."""
    total, count = 0.0, 0
    for ids in sequences:
        try:
            logprobs = runtime.token_logprobs(ids)
        except PositionLimitError:
            return None
        total -= float(logprobs.sum())
        count += len(logprobs)
    return total / count / math.log(2)
