"""The fused decode graph (serving-fused, export/fused.py) against PyTorch and against the explicit
serving graph it stands in for: one GroupQueryAttention per layer, parity within FP32_TOLERANCE, the
new K/V written into the bound buffer by the kernel (rope scaling variants: test_rope_variants.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from contract.graph import ATTENTION_MASK, input_names, layer_kv_names, new_kv_names, past_names, present_names
from contract.manifest import PREFILL_FUSED, SERVING, SERVING_FUSED, Manifest
from export.fused import FUSED_POSITIONS
from export.manifest import layer_cache_spec
from export.repository import GRAPH_FILES
from export.runtime import FusedDecoder, OnnxCausalLM
from export.verify import FP32_TOLERANCE, check_fused_graph, check_prefill_graph, default_prompts
from models.checkpoints import WEIGHTS_DIR, trained_schemes
from models.config import ModelConfig
from models.positional import SCHEMES
from models.tokenizer import TOKENIZER
from models.transformer import Transformer
from tests.schemes import trained_key_value_schemes

# The trained schemes that cache a K and a V a layer: the ones with a fused graph (mla's is absorbed).
KEY_VALUE = trained_key_value_schemes()


def test_every_scheme_that_caches_keys_and_values_has_a_fused_unit() -> None:
    """GroupQueryAttention reads a K and a V: latent attention (one [latent; rotated key]) has no fused graph."""
    key_value = {scheme for scheme in SCHEMES if layer_cache_spec(ModelConfig(scheme=scheme)).key_value}
    assert set(FUSED_POSITIONS) == key_value and "mla" not in key_value


@pytest.mark.parametrize("scheme", KEY_VALUE)
def test_one_attention_kernel_per_layer_and_the_serving_contract(repository: Path, scheme: str) -> None:
    manifest = Manifest.load(repository / scheme)
    fused = manifest.fused_attention
    assert fused is not None and fused.variant == SERVING_FUSED and fused.shares_cache_buffer
    assert fused.policies == ("full",) and fused.op == "com.microsoft.GroupQueryAttention"
    graph = onnx.load(str(manifest.verify(SERVING_FUSED))).graph
    assert GRAPH_FILES[SERVING_FUSED] == manifest.variant(SERVING_FUSED)["file"]
    ops = [node.op_type for node in graph.node]
    assert ops.count("GroupQueryAttention") == manifest.n_layers
    # No attention outside the kernel: no Softmax, and MatMuls only for qkv, out_proj, up, down, lm head.
    assert "Softmax" not in ops and ops.count("MatMul") == 4 * manifest.n_layers + 1
    assert [i.name for i in graph.input] == fused_inputs(manifest)
    assert [o.name for o in graph.output][1:] == present_names(manifest.n_layers)


def fused_inputs(manifest: Manifest) -> list[str]:
    """The fused graphs' inputs: the serving contract's, and a hybrid's local mask after attention_mask,
    its local layers' past taking a length dimension of their own (contract.manifest.LocalCache)."""
    names = input_names(manifest.n_layers)
    local = manifest.local_cache
    if local is not None:
        names.insert(names.index(ATTENTION_MASK) + 1, local.mask)
    return names


@pytest.mark.parametrize("scheme", trained_schemes())
def test_a_hybrid_s_local_layers_read_a_past_of_their_own(repository: Path, scheme: str) -> None:
    manifest = Manifest.load(repository / scheme)
    local = manifest.local_cache
    if local is None:
        assert not manifest.is_hybrid or manifest.fused_attention is None
        return
    assert local.layers == next(g.layers for g in manifest.layer_groups if g.window is not None)
    for variant in (SERVING_FUSED, PREFILL_FUSED):
        graph = onnx.load(str(manifest.verify(variant))).graph
        dims = {i.name: i.type.tensor_type.shape.dim[2].dim_param for i in graph.input if "past" in i.name}
        local_names = set(layer_kv_names(past_names(manifest.n_layers), local.layers))
        assert {name for name, dim in dims.items() if dim.startswith("local_")} == local_names


@pytest.mark.parametrize("scheme", KEY_VALUE)
def test_fused_decode_equals_pytorch(repository: Path, scheme: str) -> None:
    """Three prompts of different lengths in one batch, 32 greedy steps: logits within 1e-4 of
    PyTorch run on each prompt alone, and the same greedy token at every step."""
    model = Transformer.load(WEIGHTS_DIR / scheme)
    report = check_fused_graph(model, repository / scheme, default_prompts(TOKENIZER.bos_token_id), steps=32)
    assert report.passed(FP32_TOLERANCE), report


@pytest.mark.parametrize("scheme", ["alibi", "rope", "relative"])
def test_the_kernel_writes_the_new_kv_the_explicit_graph_returns(repository: Path, scheme: str) -> None:
    """Share-buffer: after a step, column `length` of each row holds what the explicit serving graph
    returns as new_key_values for the same token; columns beyond stay untouched."""
    prompts = default_prompts(TOKENIZER.bos_token_id)
    plain = OnnxCausalLM(repository / scheme)
    caches = []
    for ids in prompts:
        prompt, mask, positions = np.asarray([ids]), np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None]
        _, past = plain.forward(prompt, mask, positions, plain.empty_past(1))
        caches.append(np.concatenate(past))  # (2L, heads, P, hd)
    capacity = max(map(len, prompts)) + 4
    decoder = FusedDecoder(repository / scheme, len(prompts), capacity)
    for row, cache in enumerate(caches):
        decoder.write(row, cache)
    decoder.cache[:, :, :, capacity - 1] = 7.0  # a spare column nobody may write
    tokens = np.array([65, 66, 67])
    lengths = decoder.lengths.copy()
    decoder.step(tokens)

    serving = OnnxCausalLM(repository / scheme, SERVING)
    n_layers = serving.manifest.n_layers
    for row, (ids, cache) in enumerate(zip(prompts, caches, strict=True)):
        feeds = {"input_ids": tokens[row : row + 1, None], "attention_mask": np.ones((1, len(ids) + 1), np.int64)}
        feeds["position_ids"] = np.array([[len(ids)]])
        feeds.update(zip(past_names(n_layers), (layer[None] for layer in cache), strict=True))
        _, *new = serving.session.run(["logits", *new_kv_names(n_layers)], feeds)
        written = decoder.cache[:, row, :, lengths[row]]  # (2L, heads, hd)
        np.testing.assert_allclose(written, np.concatenate(new)[:, :, 0], atol=1e-5)
    assert (decoder.cache[:, :, :, capacity - 1] == 7.0).all()


@pytest.mark.parametrize("scheme", ["rope", "alibi"])
def test_more_rows_than_tokens(repository: Path, scheme: str) -> None:
    """Eight one-byte prompts: the batch outnumbers the longest row (rope pads its per-row cos/sin
    cache up to the batch, not to T)."""
    model = Transformer.load(WEIGHTS_DIR / scheme)
    prompts = [[TOKENIZER.bos_token_id, byte] for byte in b"abcdefgh"]
    report = check_fused_graph(model, repository / scheme, prompts, steps=3)
    assert report.passed(FP32_TOLERANCE), report


@pytest.mark.parametrize("scheme", trained_schemes())
def test_the_fused_prompt_graph_has_no_score_tensor_and_equals_pytorch(repository: Path, scheme: str) -> None:
    """prefill-fused: one GroupQueryAttention per layer and no Softmax (no S x T scores in the graph);
    every position's logits within 1e-4 of PyTorch, in one right-padded batch and in chunks."""
    manifest = Manifest.load(repository / scheme)
    if PREFILL_FUSED not in manifest.data["variants"]:  # type: ignore[operator]
        pytest.skip("an export without the fused prompt graph")
    graph = onnx.load(str(manifest.verify(PREFILL_FUSED))).graph
    ops = [node.op_type for node in graph.node]
    assert ops.count("GroupQueryAttention") == manifest.n_layers
    assert "Softmax" not in ops and ops.count("MatMul") == 4 * manifest.n_layers + 1
    assert [i.name for i in graph.input] == fused_inputs(manifest)
    assert [o.name for o in graph.output][1:] == present_names(manifest.n_layers)
    model = Transformer.load(WEIGHTS_DIR / scheme)
    assert check_prefill_graph(model, repository / scheme, default_prompts(TOKENIZER.bos_token_id)) <= FP32_TOLERANCE
