"""Bits per byte: the one definition of the models' quality figure, and the held-out windows it is
measured on. Training, the copy probe and export (through ONNX Runtime) all call `bits_per_byte`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from models.tokenizer import TOKENIZER
from models.transformer import Transformer

Item = TypeVar("Item")


def bits_per_byte(target_logprobs: Callable[[Item], Tensor | np.ndarray], items: Iterable[Item]) -> float:
    """Mean negative log-likelihood in bits over every predicted token (one token = one byte).

    `target_logprobs` maps each item (a batch of windows, one sequence) to the natural-log
    probabilities of the tokens it predicts, as a torch tensor or a numpy array of any shape.
    """
    total, count = 0.0, 0
    for item in items:
        logprobs = target_logprobs(item)
        total -= float(logprobs.sum())
        count += math.prod(logprobs.shape)
    return total / count / math.log(2)


def evaluation_sequences(stream: np.ndarray, context: int, count: int, bos_token_id: int) -> list[list[int]]:
    """`count` evenly spaced windows of `context` tokens to predict, each preceded by BOS: the same
    ones for every scheme and step. The model sees `context` tokens (positions 0..context-1), as in
    training."""
    starts = np.linspace(0, len(stream) - context - 1, count).astype(np.int64)
    return [[bos_token_id, *stream[s : s + context].tolist()] for s in starts]


def evaluation_windows(stream: np.ndarray, count: int, context: int) -> tuple[Tensor, Tensor]:
    """`evaluation_sequences` as a batch: inputs (count, context) and next-token targets (count, context)."""
    tokens = torch.tensor(evaluation_sequences(stream, context, count, TOKENIZER.bos_token_id))
    return tokens[:, :-1], tokens[:, 1:]


@torch.no_grad()
def windows_bits_per_byte(model: Transformer, inputs: Tensor, targets: Tensor, batch: int = 16) -> float:
    """Bits per byte of `model` on `evaluation_windows`, `batch` windows per forward pass; leaves the
    model in training mode."""
    model.eval()
    device = next(model.parameters()).device

    def target_logprobs(rows: slice) -> Tensor:
        logits, _ = model(inputs[rows].to(device))  # (b, T, vocab)
        targets_flat = targets[rows].flatten().to(device)
        return -F.cross_entropy(logits.float().flatten(0, 1), targets_flat, reduction="none")

    result = bits_per_byte(target_logprobs, (slice(i, i + batch) for i in range(0, len(inputs), batch)))
    model.train()
    return result
