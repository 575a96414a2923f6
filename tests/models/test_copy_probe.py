"""The copy probe gives the extremes: 0 for a model that cannot copy, ~1 for one that copies."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from models.copy_probe import PREFIX, SPAN, copy_accuracy, copy_trials, probe
from models.positional import matched_config
from models.tokenizer import TOKENIZER
from models.transformer import Transformer

TEXT = b"def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 40


def no_memory(ids: Tensor) -> tuple[Tensor, None]:
    """Always guesses byte 0: never an alphanumeric."""
    return torch.zeros(*ids.shape, TOKENIZER.vocab_size), None


def induction_oracle(ids: Tensor) -> tuple[Tensor, None]:
    """Predicts the byte that followed the latest earlier occurrence of the last 4 bytes."""
    logits = torch.zeros(*ids.shape, TOKENIZER.vocab_size)
    for b, row in enumerate(ids.tolist()):
        for t in range(4, len(row)):
            key = row[t - 3 : t + 1]
            for j in range(t - 1, 3, -1):
                if row[j - 3 : j + 1] == key:
                    logits[b, t, row[j + 1]] = 1.0
                    break
    return logits, None


def test_trials_repeat_a_random_alphanumeric_span_after_the_distance() -> None:
    ids = copy_trials(TEXT, distance=32, trials=5, seed=3)
    assert ids.shape == (5, 1 + PREFIX + SPAN + 32 + SPAN)
    assert bool((ids[:, 0] == TOKENIZER.bos_token_id).all())
    first, second = ids[:, 1 + PREFIX : 1 + PREFIX + SPAN], ids[:, -SPAN:]
    assert torch.equal(first, second)
    assert all(chr(c).isalnum() for c in second.flatten().tolist())
    assert len({tuple(row) for row in second.tolist()}) == 5
    assert torch.equal(ids, copy_trials(TEXT, distance=32, trials=5, seed=3))


def test_a_model_without_memory_scores_zero_and_a_copier_one() -> None:
    for distance in (32, 64):
        assert copy_accuracy(no_memory, TEXT, distance, trials=16) == 0.0
        assert copy_accuracy(induction_oracle, TEXT, distance, trials=16) > 0.95


def test_probe_on_an_untrained_model_and_a_bounded_scheme() -> None:
    torch.manual_seed(0)
    tiny = {"d_model": 32, "n_layers": 1, "n_heads": 2, "train_context": 64}
    stream = np.frombuffer(TEXT, dtype=np.uint8).astype(np.int16)
    untrained = probe(Transformer(matched_config("alibi", **tiny)), TEXT, stream, (32,), trials=16, bpb_windows=4)
    assert untrained["copy"]["32"] < 0.1  # type: ignore[index]
    assert 6.0 < untrained["test_bpb"] < 10.0  # type: ignore[operator]
    learned = probe(Transformer(matched_config("learned", **tiny)), TEXT, stream, (32, 64), trials=4, bpb_windows=4)
    assert learned["copy"]["64"] is None  # type: ignore[index]  # 137 positions > its table of 64
