"""Mathematical properties of the positional pure functions and scheme modules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.config import ModelConfig, RopeScaling
from models.limits import PositionLimitError, check_positions
from models.positional import (
    alibi_slopes,
    apply_rope,
    matched_config,
    relative_position_bucket,
    rope_angles,
    rope_inverse_frequencies,
    sinusoidal_table,
)
from models.transformer import CausalSelfAttention, Transformer


def test_sinusoidal_bounded_and_row_zero_alternates() -> None:
    table = sinusoidal_table(512, 64)
    assert table.shape == (512, 64)
    assert isinstance(table, np.ndarray)
    assert np.all(np.abs(table) <= 1.0)
    np.testing.assert_array_equal(table[0], np.tile([0.0, 1.0], 32))


def test_sinusoidal_matches_the_paper_formula() -> None:
    n, d = 50, 16
    pos = np.arange(n)[:, None]
    i = np.arange(0, d, 2)
    angle = pos / 10000 ** (i / d)
    expected = np.zeros((n, d))
    expected[:, 0::2], expected[:, 1::2] = np.sin(angle), np.cos(angle)
    np.testing.assert_allclose(sinusoidal_table(n, d), expected, atol=1e-5)


def _full_attention(x: torch.Tensor) -> torch.Tensor:
    """Our attention layer with no mask (bias 0): order can only come from the input."""
    torch.manual_seed(0)
    attention = CausalSelfAttention(ModelConfig(d_model=16, n_heads=2)).eval()
    empty = torch.zeros(1, 2, 0, 8)
    with torch.no_grad():
        out, _ = attention(x, torch.zeros(()), lambda q, k: (q, k), (empty, empty))
    return out


def test_attention_is_permutation_equivariant_without_positions_only() -> None:
    torch.manual_seed(1)
    x = torch.randn(1, 7, 16)
    reverse = torch.arange(6, -1, -1)
    assert torch.allclose(_full_attention(x[:, reverse]), _full_attention(x)[:, reverse], atol=1e-6)

    pe = torch.from_numpy(sinusoidal_table(7, 16))
    with_pe = _full_attention(x + pe)
    reversed_with_pe = _full_attention(x[:, reverse] + pe)
    assert not torch.allclose(reversed_with_pe, with_pe[:, reverse], atol=1e-3)


@pytest.mark.parametrize(
    "scaling", [None, RopeScaling("linear", 4.0), RopeScaling("ntk", 4.0), RopeScaling("yarn", 4.0)]
)
def test_rope_scores_depend_only_on_offset(scaling: RopeScaling | None) -> None:
    rng = np.random.default_rng(0)
    head_dim = 32
    q, k = rng.standard_normal(head_dim), rng.standard_normal(head_dim)

    def score(m: int, n: int) -> float:
        cos, sin = rope_angles(np.array([m, n]), head_dim, scaling=scaling)
        rotated_q = apply_rope(q[None].astype(np.float32), cos[:1], sin[:1])
        rotated_k = apply_rope(k[None].astype(np.float32), cos[1:], sin[1:])
        return float((rotated_q @ rotated_k.T).item())

    for offset in (0, 3, 40):
        reference = score(10 + offset, 10)
        for shift in (0, 1, 57, 1000):
            assert score(10 + offset + shift, 10 + shift) == pytest.approx(reference, rel=1e-3, abs=1e-3)
    assert score(13, 10) != pytest.approx(score(50, 10), abs=1e-3)


def test_rope_kinds_and_shapes() -> None:
    positions = torch.arange(12)
    cos, sin = rope_angles(positions, 16)
    assert isinstance(cos, torch.Tensor) and cos.shape == (12, 16) and sin.shape == (12, 16)
    cos_np, _ = rope_angles(np.arange(12), 16)
    assert isinstance(cos_np, np.ndarray)
    np.testing.assert_allclose(cos_np, cos.numpy(), atol=1e-6)
    # Position interpolation: position p at factor 4 looks like p / 4 unscaled.
    linear_cos, _ = rope_angles(np.array([8.0]), 16, scaling=RopeScaling("linear", 4.0))
    plain_cos, _ = rope_angles(np.array([2.0]), 16)
    np.testing.assert_allclose(linear_cos, plain_cos, atol=1e-6)
    # NTK keeps the highest frequency and slows the lowest.
    ntk_cos, _ = rope_angles(np.array([100.0]), 16, scaling=RopeScaling("ntk", 8.0))
    base_cos, _ = rope_angles(np.array([100.0]), 16)
    assert ntk_cos[0, 0] == pytest.approx(base_cos[0, 0], abs=1e-6)
    assert ntk_cos[0, 7] != pytest.approx(base_cos[0, 7], abs=1e-4)
    # YaRN scales cos/sin by its attention temperature 0.1 ln(s) + 1.
    yarn_cos, _ = rope_angles(np.array([0.0]), 16, scaling=RopeScaling("yarn", 4.0))
    np.testing.assert_allclose(yarn_cos, 0.1 * np.log(4.0) + 1.0, atol=1e-6)


def test_apply_rope_preserves_norm_and_kind() -> None:
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    cos, sin = rope_angles(np.arange(5), 8)
    rotated = apply_rope(x, cos, sin)
    assert isinstance(rotated, np.ndarray)
    np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    assert isinstance(apply_rope(torch.from_numpy(x), torch.from_numpy(cos), torch.from_numpy(sin)), torch.Tensor)


@pytest.mark.parametrize("n_heads", [1, 2, 4, 8, 16])
def test_alibi_slopes_power_of_two_are_geometric(n_heads: int) -> None:
    slopes = alibi_slopes(n_heads)
    start = 2.0 ** (-8.0 / n_heads)
    np.testing.assert_allclose(slopes, start ** np.arange(1, n_heads + 1), rtol=1e-6)
    if n_heads > 1:
        np.testing.assert_allclose(slopes[1:] / slopes[:-1], start, rtol=1e-6)


def test_alibi_slopes_paper_values() -> None:
    np.testing.assert_allclose(alibi_slopes(8), [2.0**-i for i in range(1, 9)])
    # 6 heads: the 4-head sequence, then every other slope of the 8-head sequence.
    np.testing.assert_allclose(alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    twelve = alibi_slopes(12)
    assert len(twelve) == 12 and len(set(twelve.tolist())) == 12
    np.testing.assert_allclose(twelve[:8], alibi_slopes(8))


def test_relative_buckets_monotone_and_saturating() -> None:
    distance = np.arange(0, 600)
    buckets = relative_position_bucket(-distance, bidirectional=False, num_buckets=32, max_distance=128)
    assert isinstance(buckets, np.ndarray)
    assert np.all(np.diff(buckets) >= 0)
    np.testing.assert_array_equal(buckets[:16], np.arange(16))  # exact for small distances
    assert buckets[100] < 31 and np.all(buckets[128:] == 31)  # saturates at max_distance
    # Causal: keys after the query all share bucket 0.
    future = relative_position_bucket(torch.arange(1, 50), bidirectional=False)
    assert isinstance(future, torch.Tensor) and torch.all(future == 0)


def test_relative_buckets_bidirectional_t5_semantics() -> None:
    rel = np.array([-1, 0, 1, 5, -200, 200])
    buckets = relative_position_bucket(rel, bidirectional=True, num_buckets=32, max_distance=128)
    # Positive offsets use the upper half; each half saturates at its last bucket.
    np.testing.assert_array_equal(buckets, [1, 0, 17, 21, 15, 31])


def test_check_positions_names_the_limit() -> None:
    check_positions(np.array([[0, 255]]), 256)
    check_positions(np.array([[0, 10_000]]), None)
    with pytest.raises(PositionLimitError, match="max_positions=256"):
        check_positions(torch.tensor([[255, 256]]), 256)


def test_partial_rotary_rotates_the_first_pairs_and_passes_the_rest() -> None:
    """rotary_dims=8 of 32: NeoX's partial rotary (frequencies of an 8-wide head), the other pairs unrotated."""
    partial, _ = rope_inverse_frequencies(32, rotary_dims=8)
    narrow, _ = rope_inverse_frequencies(8)
    assert partial.shape == (16,)
    torch.testing.assert_close(partial[:4], narrow)
    assert not partial[4:].any()
    x = torch.randn(3, 32)
    cos, sin = rope_angles(torch.tensor([0, 7, 300]), 32, rotary_dims=8)
    rotated = apply_rope(x, cos, sin)
    unrotated = [i for i in range(32) if i % 16 >= 4]  # pair j is (j, j + 16); pairs 4..15 pass
    torch.testing.assert_close(rotated[:, unrotated], x[:, unrotated])
    assert not torch.allclose(rotated[1:], x[1:])
    full, _ = rope_inverse_frequencies(32, rotary_dims=32)
    torch.testing.assert_close(full, rope_inverse_frequencies(32)[0])
    with pytest.raises(ValueError, match="rotary_dims"):
        rope_inverse_frequencies(32, rotary_dims=7)
    model = Transformer(matched_config("rope", rope_rotary_dims=8))
    assert model.positional.move_keys(torch.ones(1, 32), 5)[0, unrotated].eq(1).all()
