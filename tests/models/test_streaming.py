"""The PyTorch reference of the cache policies: full equals one forward pass, and a bounded cache
equals a fresh forward over exactly the tokens the policy keeps, at the positions it promises."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from contract.cache_policy import FULL_POLICY, CachePolicy, parse_cache_policy
from models.config import ModelConfig, RopeScaling
from models.limits import PositionLimitError
from models.positional import (
    SCHEMES,
    RotaryPositions,
    apply_rope,
    build_positional,
    rope_angles,
    rope_rotation_frequencies,
)
from models.streaming import stream_logits, stream_logprobs
from models.transformer import Transformer

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 2, "train_context": 32}
# Bounded policies (window, sinks) apply to these; a hybrid serves full and int8 only.
BOUNDED = tuple(s for s in SCHEMES if build_positional(ModelConfig(scheme=s, **TINY)).bounded_policies)
BIAS_OR_NONE = ("none", "alibi", "relative")
ATOL = 1e-4


def tiny_model(scheme: str, **overrides: object) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(scheme=scheme, **(TINY | overrides))).eval()  # type: ignore[arg-type]
    with torch.no_grad():  # larger weights than the 0.02 init, so positions visibly matter
        for param in model.parameters():
            param.mul_(10.0 if param.dim() > 1 else 1.0)
    return model


def random_ids(length: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def forward_last(model: Transformer, ids: list[int], positions: list[int] | None = None) -> torch.Tensor:
    """Logits of the last token of one fresh forward pass (positions 0.. unless given)."""
    position_ids = None if positions is None else torch.tensor([positions])
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]), position_ids=position_ids)
    return logits[0, -1]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_full_policy_equals_one_forward_pass(scheme: str) -> None:
    model, ids = tiny_model(scheme), random_ids(30)
    with torch.no_grad():
        full, _ = model(torch.tensor([ids]))
    streamed = stream_logits(model, ids, FULL_POLICY)
    assert streamed.dtype == torch.float32 and streamed.shape == (30, model.config.vocab_size)
    torch.testing.assert_close(streamed, full[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("scheme", BOUNDED)
@pytest.mark.parametrize("policy", ["window:20", "window:40", "sinks:4+window:16"])
def test_a_budget_never_reached_equals_full(scheme: str, policy: str) -> None:
    model, ids = tiny_model(scheme), random_ids(20)
    full = stream_logits(model, ids, FULL_POLICY)
    torch.testing.assert_close(stream_logits(model, ids, parse_cache_policy(policy)), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("scheme", BOUNDED)
def test_a_reached_budget_changes_the_logits(scheme: str) -> None:
    """Eviction really happens: the first token beyond the budget sees less than under full."""
    model, ids = tiny_model(scheme), random_ids(24)
    full = stream_logits(model, ids, FULL_POLICY)
    bounded = stream_logits(model, ids, CachePolicy(window=6))
    torch.testing.assert_close(bounded[:7], full[:7], atol=ATOL, rtol=0)  # 6 cached + itself
    assert (bounded[7:] - full[7:]).abs().max() > 1e-2


@pytest.mark.parametrize("scheme", BOUNDED)
def test_window_equals_a_fresh_forward_over_the_window(scheme: str) -> None:
    """One layer: a token's K/V depend only on itself (and, for absolute schemes, its position),
    so under window:W token t sees exactly a fresh forward over ids[t-W : t+1]."""
    model, ids, window = tiny_model(scheme, n_layers=1), random_ids(28), 7
    streamed = stream_logits(model, ids, CachePolicy(window=window))
    original = model.positional.eviction_positions == "original"
    assert original == (scheme in ("sinusoidal", "learned"))
    for t in range(window, len(ids)):
        positions = list(range(t - window, t + 1)) if original else None
        fresh = forward_last(model, ids[t - window : t + 1], positions)
        torch.testing.assert_close(streamed[t], fresh, atol=ATOL, rtol=0)


@pytest.mark.parametrize("scheme", BOUNDED)
def test_sinks_equal_a_fresh_forward_over_sinks_and_window(scheme: str) -> None:
    """Under sinks:S+window:W token t sees ids[:S] + ids[t-W : t+1]: at contiguous positions
    0..S+W for the schemes that re-index (for rope, via `move_keys` of the sinks), at their
    original positions for the absolute ones."""
    model, ids, sinks, window = tiny_model(scheme, n_layers=1), random_ids(30), 3, 6
    streamed = stream_logits(model, ids, CachePolicy(sinks=sinks, window=window))
    original = model.positional.eviction_positions == "original"
    for t in range(sinks + window, len(ids)):
        kept = ids[:sinks] + ids[t - window : t + 1]
        positions = list(range(sinks)) + list(range(t - window, t + 1)) if original else None
        torch.testing.assert_close(streamed[t], forward_last(model, kept, positions), atol=ATOL, rtol=0)


def test_rope_sinks_need_moving() -> None:
    """Without moving the sink keys the rope stream would differ from the re-indexed forward."""
    model, ids, sinks, window = tiny_model("rope", n_layers=1), random_ids(30, seed=2), 3, 6
    t = len(ids) - 1
    kept = ids[:sinks] + ids[t - window : t + 1]
    stale = list(range(sinks)) + list(range(t - window, t + 1))  # the sinks left where they were
    moved = stream_logits(model, ids, CachePolicy(sinks=sinks, window=window))[t]
    torch.testing.assert_close(moved, forward_last(model, kept), atol=ATOL, rtol=0)
    assert (moved - forward_last(model, kept, stale)).abs().max() > 1e-2


@pytest.mark.parametrize("scaling", [None, RopeScaling("linear", 4.0), RopeScaling("yarn", 4.0, 32)])
def test_move_keys_equals_rotating_at_the_later_position(scaling: RopeScaling | None) -> None:
    config = ModelConfig(scheme="rope", **(TINY | {"rope_scaling": scaling}))  # type: ignore[arg-type]
    scheme = RotaryPositions(config)
    keys = torch.randn(2, config.n_heads, 5, config.head_dim, generator=torch.Generator().manual_seed(3))
    positions, offset = torch.arange(5) + 2, 37

    def rotated_at(where: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_angles(where, config.head_dim, config.rope_base, scaling)
        return apply_rope(keys, cos, sin)

    moved = scheme.move_keys(rotated_at(positions), offset)
    torch.testing.assert_close(moved, rotated_at(positions + offset), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scheme.move_keys(rotated_at(positions), 0), rotated_at(positions))

    # The service's numpy recipe with the manifest's frequencies gives the same keys.
    inv_freq = rope_rotation_frequencies(config).numpy()
    freqs = offset * inv_freq
    emb = np.concatenate((freqs, freqs))
    k = rotated_at(positions).numpy()
    half = k.shape[-1] // 2
    rotate_half = np.concatenate((-k[..., half:], k[..., :half]), axis=-1)
    np.testing.assert_allclose(k * np.cos(emb) + rotate_half * np.sin(emb), moved.numpy(), atol=1e-5)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_only_rope_moves_keys(scheme: str) -> None:
    positional = build_positional(ModelConfig(scheme=scheme, **TINY))  # type: ignore[arg-type]
    keys = torch.randn(1, 2, 4, 16)
    assert positional.rotates_keys == (scheme in ("rope", "rnope-swa", "rope-swa", "mla"))
    assert positional.eviction_positions in ("cache", "original")
    if not positional.rotates_keys:
        assert positional.move_keys(keys, 5) is keys


def test_learned_stream_beyond_the_table_raises() -> None:
    """Original positions keep counting under a window: the table still ends the sequence."""
    model = tiny_model("learned", max_positions=16)
    stream_logits(model, random_ids(16), CachePolicy(window=4))
    with pytest.raises(PositionLimitError, match="max_positions=16"):
        stream_logits(model, random_ids(17), CachePolicy(window=4))


def test_serving_layout_gives_the_same_stream() -> None:
    """Layers that return only the new K/V (the export's layout) stream the same."""
    ids, policy = random_ids(20), parse_cache_policy("sinks:2+window:5")
    reference = stream_logits(tiny_model("rope"), ids, policy)
    served = stream_logits(tiny_model("rope").return_new_key_values_only(), ids, policy)
    torch.testing.assert_close(served, reference, atol=ATOL, rtol=0)


def test_stream_logprobs_match_the_logits() -> None:
    model, ids = tiny_model("alibi"), random_ids(12)
    policy = CachePolicy(window=5)
    logprobs = stream_logprobs(model, ids, policy)
    expected = torch.log_softmax(stream_logits(model, ids, policy), dim=-1)[torch.arange(11), ids[1:]]
    assert logprobs.shape == (11,) and logprobs.dtype == np.float32
    np.testing.assert_allclose(logprobs, expected.numpy(), atol=1e-6)
    assert stream_logprobs(model, ids[:1], policy).shape == (0,)
