"""Parity: ONNX Runtime versus PyTorch, and ONNX cached decoding versus full recomputation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from contract.graph import left_pad_batch
from contract.manifest import variant_dtype
from export.runtime import OnnxCausalLM
from models.transformer import Transformer

# Tolerances on logits (max absolute difference).
FP32_TOLERANCE = 1e-4
# fp16 keeps ~3 significant digits; logits here reach ~20 in magnitude.
FP16_TOLERANCE = 0.1


def tolerance(variant: str) -> float:
    """The logit tolerance of a graph variant: set by its dtype, serving graphs alike."""
    return FP32_TOLERANCE if variant_dtype(variant) == "float32" else FP16_TOLERANCE


PARITY_PROMPTS = [
    b"def fibonacci(n):\n    ",
    b"import os\n",
    b'class Config:\n    """Settings."""\n\n    def __init__(self',
]


@dataclass
class ParityReport:
    name: str
    dtype: str
    prefill_max_abs: float
    decode_max_abs: float
    cached_vs_full_max_abs: float
    greedy_equal: bool
    steps: int

    @property
    def max_abs(self) -> float:
        return max(self.prefill_max_abs, self.decode_max_abs)

    def passed(self, tolerance: float) -> bool:
        return self.max_abs <= tolerance and self.cached_vs_full_max_abs <= tolerance and self.greedy_equal


def default_prompts(bos_token_id: int) -> list[list[int]]:
    return [[bos_token_id, *prompt] for prompt in PARITY_PROMPTS]


@torch.no_grad()
def check_parity(model: Transformer, runtime: OnnxCausalLM, prompts: list[list[int]], steps: int = 32) -> ParityReport:
    """Batched left-padded prefill, then `steps` cached decode steps fed the same tokens.

    PyTorch runs in float32 as the reference; the ONNX graph may be float16 or a serving graph
    (whose new K/V the runtime appends to the past).
    """
    model = model.float().eval()
    ids, mask, positions = left_pad_batch(prompts, runtime.pad_token_id)
    torch_logits, torch_past = model(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(positions))
    onnx_logits, onnx_past = runtime.forward(ids, mask, positions, runtime.empty_past(len(prompts)))
    real = mask.astype(bool)
    prefill = float(np.abs(onnx_logits.astype(np.float32) - torch_logits.numpy())[real].max())

    decode, cached_steps, tokens = 0.0, [], []
    last = torch_logits[:, -1]
    for _ in range(steps):
        next_ids = last.argmax(-1).numpy().astype(np.int64)[:, None]  # (B, 1)
        tokens.append(next_ids)
        mask = np.concatenate([mask, np.ones_like(next_ids)], axis=1)
        positions = positions[:, -1:] + 1
        torch_logits, torch_past = model(
            torch.from_numpy(next_ids), torch.from_numpy(mask), torch.from_numpy(positions), torch_past
        )
        onnx_logits, onnx_past = runtime.forward(next_ids, mask, positions, onnx_past)
        decode = max(decode, float(np.abs(onnx_logits.astype(np.float32) - torch_logits.numpy()).max()))
        cached_steps.append(onnx_logits[:, -1].astype(np.float32))
        last = torch_logits[:, -1]

    # The same sequences recomputed from scratch in one ONNX call.
    full_ids = np.concatenate([ids, *tokens], axis=1)
    full_positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    full_logits, _ = runtime.forward(full_ids, mask, full_positions, runtime.empty_past(len(prompts)))
    # Decode step k fed the token at index P + k, so its logits sit there in the full pass.
    recomputed = full_logits[:, ids.shape[1] :].astype(np.float32)  # (B, steps, V)
    cached = np.stack(cached_steps, axis=1)  # (B, steps, V)
    cached_vs_full = float(np.abs(cached - recomputed).max())
    greedy_equal = bool((cached.argmax(-1) == recomputed.argmax(-1)).all())
    return ParityReport(runtime.manifest.name, runtime.dtype, prefill, decode, cached_vs_full, greedy_equal, steps)
