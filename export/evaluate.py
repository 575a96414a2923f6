"""Quality through ONNX Runtime: bits per byte on held-out text at a given context length."""

from __future__ import annotations

from export.runtime import OnnxCausalLM
from models.evaluation import bits_per_byte
from models.limits import PositionLimitError


def onnx_bits_per_byte(runtime: OnnxCausalLM, sequences: list[list[int]]) -> float | None:
    """Bits per byte of the exported graph on `sequences` (`models.evaluation.evaluation_sequences`),
    or None when the model cannot represent their length."""
    try:
        return bits_per_byte(runtime.token_logprobs, sequences)
    except PositionLimitError:
        return None
