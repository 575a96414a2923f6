"""The width bench's roofline has two roofs: a decode step's FLOPs per layer kind, counted by hand, and
the roof that binds (issue 62)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

import bench.width
from bench.prefill import attended_tokens, decode_attention_products, decode_flops
from bench.width import binding_roof, roofline, step_floor
from contract.kv_spec import LayerCacheSpec
from contract.manifest import Manifest

# 2 layers x 8 wide, 2 heads of 4, MLP 32, 10 tokens of vocabulary: the linear layers a token are
# per layer QKV 8 x 24, out 8 x 8, MLP 8 x 32 and 32 x 8 (768 multiply-adds), then the head 8 x 10.
LINEAR_FLOPS = 2 * (2 * (192 + 64 + 256 + 256) + 80)  # 3,232


def manifest(**extra: object) -> Manifest:
    data = {"n_layers": 2, "n_heads": 2, "head_dim": 4, "d_model": 8, "d_ff": 32, "vocab_size": 10, **extra}
    return Manifest(Path("/nowhere/manifest.json"), data)


def windowed() -> Manifest:
    groups = [{"name": "local", "layers": [0], "window": 4, "rotates_keys": True},
              {"name": "global", "layers": [1], "window": None, "rotates_keys": True}]  # fmt: skip
    return manifest(layer_groups=groups)


def latent(d_c: int = 6, d_r: int = 2, **extra: object) -> Manifest:
    spec = LayerCacheSpec.latent(d_c, d_r).to_json()
    return manifest(kv_cache={"spec": spec}, **extra)


def test_full_attention_a_step_is_the_linear_layers_and_q_k_and_w_v_over_every_token() -> None:
    # 9 cached tokens and the new one: per layer 2 heads x 4 wide x (K and V) x 10 tokens, 2 FLOPs each.
    assert attended_tokens(manifest(), 9) == [10, 10]
    assert decode_attention_products(manifest(), 10) == [(2, 1, 4, 10), (2, 1, 10, 4)]
    assert decode_flops(manifest(), 9) == LINEAR_FLOPS + 2 * (2 * 2 * 4 * 2 * 10)  # 3,872


def test_a_windowed_layer_attends_to_its_window_only() -> None:
    assert attended_tokens(windowed(), 9) == [4, 10]
    assert decode_flops(windowed(), 9) == LINEAR_FLOPS + 2 * 2 * 4 * 2 * (4 + 10)  # 3,680
    assert attended_tokens(windowed(), 2) == [3, 3]  # shorter than the window: every token
    assert decode_flops(windowed(), 2) == LINEAR_FLOPS + 2 * 2 * 4 * 2 * (3 + 3)


def test_latent_attention_is_counted_in_its_absorbed_form() -> None:
    """Every head's folded query a row against whole [latent; rotated key] entries (6 + 2 wide), then the
    weights mixing whole entries: heads x tokens x (2 x 8 + 2 x 8) a layer. Its linear layers: the
    query 8 x 2 x (4 + 2), the down-projection 8 x 8, the key and value up-projections 6 x 8 each (the
    query and value folds a step does), out, MLP, head."""
    assert decode_attention_products(latent(), 10) == [(1, 2, 8, 10), (1, 2, 10, 8)]
    linear = 2 * (2 * (96 + 64 + 48 + 48 + 64 + 256 + 256) + 80)  # 3,488
    assert decode_flops(latent(), 9) == linear + 2 * (2 * 10 * (2 * 8 + 2 * 8))  # 4,768


def test_latent_attention_at_gpt2_small_width_is_the_issues_41_m_multiply_adds_a_layer() -> None:
    small = latent(384, 32, n_layers=1, n_heads=12, head_dim=64, d_model=768, d_ff=3072)
    attention = sum(2 * b * m * k * n for b, m, k, n in decode_attention_products(small, 4097))
    assert attention == 12 * 4097 * (2 * 416 + 2 * 416) == 81_808_896


def test_the_slower_roof_binds() -> None:
    assert binding_roof(100e6, 10e9, 1e9, 50e9) == pytest.approx((0.02, "compute"))  # 10 ms of bytes, 20 of FLOPs
    assert binding_roof(400e6, 10e9, 1e9, 50e9) == pytest.approx((0.04, "bandwidth"))
    assert binding_roof(100e6, 10e9, 1e9, math.inf)[1] == "bandwidth"


def test_without_a_rate_the_roofline_is_bandwidth_over_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.width, "weight_bytes", lambda _: 1_000)
    monkeypatch.setattr(bench.width, "kv_read_bytes", lambda _, context: 10 * context)
    model = latent()
    assert roofline(2_000.0, model, 100) == pytest.approx(1.0)  # 2,000 B/s over 2,000 B
    assert step_floor(model, 100, 2_000.0, math.inf) == pytest.approx((1.0, "bandwidth"))
    flops = decode_flops(model, 100)
    assert step_floor(model, 100, 2_000.0, flops / 4) == pytest.approx((4.0, "compute"))
    assert roofline(2_000.0, model, 100, flops / 4) == pytest.approx(0.25)


def test_the_read_rate_is_the_faster_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's sum is bound by its adds on some builds (15 GB/s against a matrix-vector product's 23 on
    one Zen 3 core): a slow kernel must not lower the roof, whichever of the two it is."""
    read = bench.width.Bandwidth(2, size=1 << 20)
    for slow in ("_sum", "_matvec"):
        kernel = getattr(read, slow)

        def sleepy(part: object, kernel: object = kernel) -> float:
            time.sleep(0.05)
            return kernel(part)  # type: ignore[operator]

        monkeypatch.setattr(read, slow, sleepy)
        assert read(runs=2) > (1 << 20) / 0.05
        monkeypatch.undo()
    assert len(read.readings) == 3  # the first touches the pages


def test_the_read_splits_over_any_thread_count() -> None:
    read = bench.width.Bandwidth(3, size=1 << 20)
    assert [part.shape[0] for part in read.parts] == [22, 21, 21] and read.size == 1 << 20
