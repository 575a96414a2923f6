"""Named sizes: the registry shared by training and serving, and random weights drawn from a fixed seed.
Never the full 85 M model: a one- and two-layer stand-in of the same width give its size."""

from __future__ import annotations

import pytest
import torch

from models.sizes import RANDOM_SCHEMES, SIZES, random_model, size_config
from models.train_config import PRESETS


def test_small_is_gpt2_small_for_every_scheme_and_training_shares_the_registry() -> None:
    assert SIZES["small"] == {"d_model": 768, "n_layers": 12, "n_heads": 12}
    assert PRESETS is SIZES and SIZES["tiny"] == {"d_model": 128, "n_layers": 4, "n_heads": 4}
    for scheme in RANDOM_SCHEMES:
        config = size_config(scheme, "small")
        assert (config.n_layers, config.d_model, config.head_dim, config.vocab_size) == (12, 768, 64, 259)
    hybrid = size_config("rnope-swa", "small")
    assert (hybrid.sliding_window, hybrid.global_every) == (64, 4)  # the hybrids keep their window and ratio
    assert size_config("rnope-swa", "small", n_layers=2).global_every == 2  # a stand-in keeps a global layer
    with pytest.raises(ValueError, match="size must be one of"):
        size_config("rope", "huge")


def test_small_has_over_50m_parameters_counted_from_stand_ins_of_its_width() -> None:
    one, two = (random_model("rope", "small", n_layers=n).num_parameters() for n in (1, 2))
    parameters = one + 11 * (two - one)  # embedding and head once, twelve blocks
    assert 84e6 < parameters < 86e6


def test_random_weights_are_the_same_every_time_and_leave_the_callers_generator_alone() -> None:
    torch.manual_seed(7)
    expected_next = torch.rand(1)
    torch.manual_seed(7)
    first = random_model("alibi", "small", n_layers=1)
    after = torch.rand(1)
    second = random_model("alibi", "small", n_layers=1)
    assert torch.equal(after, expected_next)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
