"""Bits per byte: one definition for torch and numpy log-probabilities, the same held-out windows
as lists (export) and as a batch (training)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models.evaluation import bits_per_byte, evaluation_sequences, evaluation_windows, windows_bits_per_byte
from models.positional import matched_config
from models.tokenizer import TOKENIZER
from models.transformer import Transformer


def test_a_uniform_guess_over_256_bytes_costs_8_bits_in_torch_and_numpy() -> None:
    uniform = math.log(1 / 256)
    as_torch = bits_per_byte(lambda n: torch.full((n, 3), uniform), [1, 2])
    as_numpy = bits_per_byte(lambda n: np.full(n, uniform), [4, 5])
    assert as_torch == pytest.approx(8.0) and as_numpy == pytest.approx(8.0)
    # every predicted token counts once, whatever the shapes of the items
    assert bits_per_byte(lambda bits: np.full(bits[1], -bits[0] * math.log(2)), [(1.0, 1), (4.0, 3)]) == 3.25


def test_windows_are_the_sequences_split_into_inputs_and_targets() -> None:
    stream = np.arange(1000, dtype=np.int16) % 200
    sequences = evaluation_sequences(stream, 32, 5, TOKENIZER.bos_token_id)
    inputs, targets = evaluation_windows(stream, 5, 32)
    assert inputs.shape == targets.shape == (5, 32) and inputs.dtype == torch.int64
    assert torch.equal(torch.cat([inputs, targets[:, -1:]], dim=1), torch.tensor(sequences))


def test_windows_bits_per_byte_agrees_with_the_sequences_and_leaves_the_model_training() -> None:
    torch.manual_seed(0)
    model = Transformer(matched_config("alibi", d_model=32, n_layers=1, n_heads=2, train_context=32))
    stream = np.frombuffer(b"def add(a, b):\n    return a + b\n" * 20, dtype=np.uint8).astype(np.int16)
    windowed = windows_bits_per_byte(model, *evaluation_windows(stream, 6, 32), batch=4)
    assert model.training

    @torch.no_grad()
    def target_logprobs(ids: list[int]) -> torch.Tensor:
        logits, _ = model(torch.tensor([ids[:-1]]))
        return torch.log_softmax(logits[0].double(), -1).gather(1, torch.tensor(ids[1:])[:, None])

    model.eval()
    sequences = evaluation_sequences(stream, 32, 6, TOKENIZER.bos_token_id)
    assert windowed == pytest.approx(bits_per_byte(target_logprobs, sequences), rel=1e-5)
