"""The model family: KV cache, padding, parameter budget, limits, persistence."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import models.config
from models.config import ModelConfig
from models.limits import PositionLimitError
from models.positional import SCHEME_REGISTRY, SCHEMES, matched_config
from models.transformer import Transformer

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 4, "train_context": 64}


def tiny_model(scheme: str, **overrides: object) -> Transformer:
    torch.manual_seed(0)
    return Transformer(matched_config(scheme, **(TINY | overrides))).eval()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_cached_forward_equals_full_forward(scheme: str) -> None:
    model = tiny_model(scheme)
    ids = torch.randint(0, 256, (3, 24))
    mask = torch.ones(3, 24, dtype=torch.long)
    mask[1, :6] = 0  # left padding
    mask[2, :11] = 0
    with torch.no_grad():
        full, _ = model(ids, mask)
        first, past = model(ids[:, :10], mask[:, :10])
        pieces = [first]
        for start in range(10, 24, 3):  # chunks of 3, then single tokens
            chunk, past = model(ids[:, start : start + 3], mask[:, : start + 3], past_key_values=past)
            pieces.append(chunk)
    real = mask.bool()
    assert torch.allclose(torch.cat(pieces, dim=1)[real], full[real], atol=1e-5)
    assert past[0][0].shape == (3, 4, 24, 8)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_left_padded_row_equals_lone_sequence(scheme: str) -> None:
    model = tiny_model(scheme)
    seq = torch.randint(0, 256, (1, 9))
    padded = torch.cat([torch.full((1, 5), 258), seq], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
    with torch.no_grad():
        alone, _ = model(seq)
        batched, _ = model(padded, mask)
    assert torch.allclose(batched[:, 5:], alone, atol=1e-5)
    assert torch.isfinite(batched).all()


def test_every_scheme_has_the_same_parameter_budget() -> None:
    counts = {scheme: Transformer(matched_config(scheme)).num_parameters() for scheme in SCHEMES}
    reference = counts["none"]
    for scheme, count in counts.items():
        assert abs(count - reference) / reference < 0.01, (scheme, count, reference)
    assert matched_config("learned").d_ff < matched_config("none").d_ff  # the table is paid for


def test_learned_positions_refuse_beyond_the_table() -> None:
    model = tiny_model("learned")
    assert model.positional.max_positions == 64
    with torch.no_grad():
        model(torch.zeros(1, 64, dtype=torch.long))
        with pytest.raises(PositionLimitError, match="max_positions=64"):
            model(torch.zeros(1, 65, dtype=torch.long))


def test_sinusoidal_and_nope_extrapolate_without_limit() -> None:
    for scheme in ("sinusoidal", "none", "alibi", "rope", "relative"):
        with torch.no_grad():
            logits, _ = tiny_model(scheme)(torch.zeros(1, 200, dtype=torch.long))
        assert torch.isfinite(logits).all()


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="scheme must be one of sinusoidal, learned"):
        Transformer(ModelConfig(scheme="xpos"))


def test_the_registry_is_the_one_list_of_schemes() -> None:
    assert (
        SCHEMES
        == tuple(SCHEME_REGISTRY)
        == ("sinusoidal", "learned", "relative", "rope", "alibi", "none", "rnope-swa", "rope-swa")
    )


def test_config_does_not_import_the_schemes() -> None:
    """No cycle: positional imports config, never the other way (not even inside a function)."""
    tree = ast.parse((Path(models.config.__file__)).read_text())
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert "models.positional" not in imported and "models.transformer" not in imported, imported


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    model = tiny_model("relative")
    model.save(tmp_path)
    loaded = Transformer.load(tmp_path)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids)[0], loaded(ids)[0])
    assert loaded.config == model.config


@pytest.mark.parametrize("scheme", SCHEMES)
def test_in_place_attention_over_a_padded_buffer_equals_concatenation(scheme: str) -> None:
    """The serving layout: past in a buffer with unused (masked) slots, only new K/V out."""
    model = tiny_model(scheme)
    ids = torch.randint(0, 256, (2, 14))
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        full, _ = model(ids, mask)
        _, past = model(ids[:, :10], mask[:, :10])
        # A buffer of capacity 16: 10 filled columns, 6 unused slots masked out.
        buffer = [tuple(torch.cat((t, torch.randn(2, 4, 6, 8)), dim=2) for t in layer) for layer in past]
        buffer_mask = torch.cat((mask[:, :10], torch.zeros(2, 6, dtype=torch.long), mask[:, 10:]), dim=1)
        positions = mask.cumsum(-1)[:, 10:] - 1
        serving = tiny_model(scheme).return_new_key_values_only()
        logits, new = serving(ids[:, 10:], buffer_mask, positions, buffer)
    assert torch.allclose(logits, full[:, 10:], atol=1e-5)
    assert new[0][0].shape == (2, 4, 4, 8)


def test_hybrids_split_three_local_layers_and_one_global() -> None:
    for scheme, global_rotates in (("rnope-swa", False), ("rope-swa", True)):
        local, global_ = Transformer(matched_config(scheme)).positional.layer_groups()
        assert (local.layers, local.window, local.positional.rotates_keys) == ((0, 1, 2), 64, True)
        assert (global_.layers, global_.window, global_.positional.rotates_keys) == ((3,), None, global_rotates)


@pytest.mark.parametrize("scheme", ["rnope-swa", "rope-swa"])
def test_a_local_layer_sees_only_its_window(scheme: str) -> None:
    """One local layer of window 8 (no global layer): the token 8 places back is out of sight, the
    one 7 places back (with the query itself, 8 tokens) still counts; left padding does not move it."""
    model = tiny_model(scheme, n_layers=1, sliding_window=8, global_every=100)
    ids = torch.randint(0, 256, (1, 20))
    changed = ids.clone()
    changed[0, 4] = (ids[0, 4] + 1) % 256
    padded = torch.cat([torch.full((1, 3), 258), changed], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 20, dtype=torch.long)], dim=1)
    with torch.no_grad():
        before, _ = model(ids)
        after, _ = model(changed)
        padded_after, _ = model(padded, mask)
    moved = (before - after).abs().amax(dim=-1)[0]  # (T,)
    assert (moved[4:12] > 1e-4).all() and (moved[12:] < 1e-6).all()
    assert torch.allclose(padded_after[:, 3:], after, atol=1e-5)


def test_the_global_layer_sees_past_the_window() -> None:
    model = tiny_model("rnope-swa", n_layers=2, sliding_window=4, global_every=2)
    ids = torch.randint(0, 256, (1, 30))
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] + 1) % 256
    with torch.no_grad():
        moved = (model(ids)[0] - model(changed)[0]).abs().amax(dim=-1)[0]
    assert (moved[20:] > 1e-5).all()
