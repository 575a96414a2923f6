"""Rope scaling variants derived from the base rope graphs (export/rope_variants.py) and the export's
choice of graphs and processes (export/repository.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from contract.graph import input_names, left_pad_batch, output_names
from contract.manifest import (
    PREFILL_FUSED,
    PREFILL_UP_PROJECTED,
    SERVING,
    SERVING_FP16,
    SERVING_FUSED,
    SERVING_FUSED_INT8,
    SERVING_INT8,
    Manifest,
)
from export.onnx import export_onnx
from export.repository import ExportOptions, cuda_onnxruntime, export_model, run
from export.rope_variants import RopeRewriteError, derive_graph, derive_rope_variant, rotary_constants
from export.runtime import OnnxCausalLM
from export.sources import rope_scaled_name
from export.verify import (
    FP32_TOLERANCE,
    check_fused_graph,
    check_int8_graph,
    check_parity,
    check_prefill_graph,
    default_prompts,
)
from models.checkpoints import WEIGHTS_DIR
from models.config import ModelConfig, RopeScaling
from models.positional import matched_config, rope_rotation_frequencies
from models.tokenizer import TOKENIZER
from models.transformer import Transformer

FP32_GRAPHS = ("float32", SERVING, SERVING_INT8, SERVING_FUSED, PREFILL_FUSED, SERVING_FUSED_INT8)


def scaled(model: Transformer, scaling: RopeScaling) -> Transformer:
    """A copy of `model` that rotates with `scaling` (what tracing the variant would export)."""
    model = copy.deepcopy(model)
    model.config.rope_scaling = RopeScaling(scaling.kind, scaling.factor, model.config.train_context)
    return model


@pytest.mark.parametrize("spec", ["linear:4", "ntk:4", "yarn:8"])
def test_derived_graphs_equal_pytorch_with_that_scaling(repository: Path, tmp_path: Path, spec: str) -> None:
    """Every float32 graph of a derived variant (the fused one too) against the PyTorch model with the scaling, at 1e-4;
    the base graph against the same model is far off, so the check sees the rewritten constants."""
    scaling = RopeScaling.parse(spec)
    base = Transformer.load(WEIGHTS_DIR / "rope")
    folder = tmp_path / rope_scaled_name(scaling)
    derive_rope_variant(repository / "rope", folder, folder.name, base.config, scaling, FP32_GRAPHS)
    reference, prompts = scaled(base, scaling), default_prompts(TOKENIZER.bos_token_id)
    for variant in ("float32", SERVING):
        report = check_parity(reference, OnnxCausalLM(folder, variant), prompts)
        assert report.passed(FP32_TOLERANCE), report
    assert check_int8_graph(reference, OnnxCausalLM(folder, SERVING_INT8), prompts) <= FP32_TOLERANCE
    fused = check_fused_graph(reference, folder, prompts)  # its one inv_freq initializer, rewritten alike
    assert fused.passed(FP32_TOLERANCE), fused
    assert check_prefill_graph(reference, folder, prompts) <= FP32_TOLERANCE  # the prompt graph's, likewise
    unscaled = check_parity(reference, OnnxCausalLM(repository / "rope"), prompts)
    assert unscaled.max_abs > 100 * FP32_TOLERANCE, unscaled


def _feeds(n_layers: int, n_heads: int, head_dim: int, prompts: list[list[int]]) -> dict[str, np.ndarray]:
    ids, mask, positions = left_pad_batch(prompts, TOKENIZER.pad_token_id)
    past = np.zeros((len(prompts), n_heads, 0, head_dim), dtype=np.float32)
    names = input_names(n_layers)
    return dict(zip(names, [ids, mask, positions] + [past] * (len(names) - 3), strict=True))


def test_derived_yarn_graph_equals_a_traced_one(repository: Path, tmp_path: Path) -> None:
    """YaRN is the variant whose derivation inserts a Mul (its attention factor): the derived float32
    graph and the graph traced from the scaled model give the same logits and cache."""
    scaling = RopeScaling.parse("yarn:8")
    base = Transformer.load(WEIGHTS_DIR / "rope")
    traced = tmp_path / "traced.onnx"
    export_onnx(scaled(base, scaling), traced)
    derived = derive_graph(
        onnx.load(str(repository / "rope" / "model.onnx")), base.config, scaled(base, scaling).config
    )
    config = base.config
    feeds = _feeds(config.n_layers, config.n_heads, config.head_dim, default_prompts(TOKENIZER.bos_token_id))
    outputs = output_names(config.n_layers)
    want = ort.InferenceSession(str(traced)).run(outputs, feeds)
    got = ort.InferenceSession(derived.SerializeToString()).run(outputs, feeds)
    real = feeds["attention_mask"].astype(bool)
    np.testing.assert_allclose(got[0][real], want[0][real], atol=FP32_TOLERANCE)
    for mine, theirs in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(mine, theirs, atol=FP32_TOLERANCE)
    assert sum(node.op_type == "Mul" for node in derived.graph.node) > sum(
        node.op_type == "Mul" for node in onnx.load(str(repository / "rope" / "model.onnx")).graph.node
    )


def test_derived_manifest_records_the_scaling(repository: Path, tmp_path: Path) -> None:
    scaling = RopeScaling.parse("yarn:4")
    base = Transformer.load(WEIGHTS_DIR / "rope").config
    folder = tmp_path / "rope-yarn-x4"
    derive_rope_variant(repository / "rope", folder, folder.name, base, scaling, ("float32",))
    manifest = Manifest.load(folder)
    manifest.verify_all()
    assert manifest.name == "rope-yarn-x4" and manifest.scheme == "rope" and manifest.is_scaling_variant
    assert manifest.data["rope_scaling"] == {"kind": "yarn", "factor": 4.0, "original_max_positions": 256}
    assert list(manifest.data["variants"]) == ["float32"]  # type: ignore[arg-type]
    target = ModelConfig(**{**base.to_dict(), "rope_scaling": manifest.data["rope_scaling"]})
    eviction = manifest.cache_eviction
    assert eviction is not None and eviction.rotary_inv_freq is not None
    np.testing.assert_array_equal(eviction.rotary_inv_freq, rope_rotation_frequencies(target).numpy())
    base_manifest = Manifest.load(repository / "rope")
    assert manifest.data["parameters"] == base_manifest.data["parameters"]
    assert manifest.data["derived_from"] == {"model": "rope", "sha256": base_manifest.variant("float32")["sha256"]}
    assert json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["filename"] == "model.onnx"


def test_partial_rotary_keeps_its_unrotated_pairs(tmp_path: Path) -> None:
    """rope_rotary_dims: pairs beyond the rotated dims have frequency 0 in the base; the derived graph
    keeps them at 0 and equals PyTorch with the scaling."""
    torch.manual_seed(0)
    config = matched_config("rope", n_layers=1, rope_rotary_dims=16)
    model = Transformer(config).eval()
    base = export_model("rope", model, ExportOptions(out=tmp_path), {}, ("float32",))
    assert base.onnx_bytes.keys() == {"float32"}
    scaling = RopeScaling.parse("yarn:4")
    folder = tmp_path / "rope-yarn-x4"
    derive_rope_variant(tmp_path / "rope", folder, folder.name, config, scaling, ("float32",))
    base_freq, _ = rotary_constants(config)
    assert (base_freq == 0).sum() == (config.head_dim - 16) // 2
    graph = onnx.load(str(folder / "model.onnx")).graph
    target = scaled(model, scaling).config
    (frequencies,) = [
        numpy_helper.to_array(i)
        for i in graph.initializer
        if np.array_equal(numpy_helper.to_array(i), rotary_constants(target)[0])
    ]
    np.testing.assert_array_equal(frequencies == 0, base_freq == 0)
    report = check_parity(scaled(model, scaling), OnnxCausalLM(folder), default_prompts(TOKENIZER.bos_token_id))
    assert report.passed(FP32_TOLERANCE), report
    with pytest.raises(RopeRewriteError, match="rotate different pairs"):
        derive_graph(
            onnx.load(str(tmp_path / "rope" / "model.onnx")),
            config,
            ModelConfig(**{**config.to_dict(), "rope_rotary_dims": 8}),
        )


def test_a_graph_without_rotary_frequencies_is_refused(repository: Path) -> None:
    rope = Transformer.load(WEIGHTS_DIR / "rope").config
    target = ModelConfig(**{**rope.to_dict(), "rope_scaling": {"kind": "ntk", "factor": 2.0}})
    with pytest.raises(RopeRewriteError, match="one initializer equal to the base inverse frequencies"):
        derive_graph(onnx.load(str(repository / "alibi" / "model.onnx")), rope, target)


def test_graphs_by_device_or_as_asked() -> None:
    """CPUs serve float32: float16 graphs only with CUDA ONNX Runtime, --fp16, or --graphs naming them."""
    fp16 = ("float16", SERVING_FP16)
    default = ExportOptions().graph_variants()
    cpu = (*FP32_GRAPHS, PREFILL_UP_PROJECTED)  # the last: latent attention's alone (graphs_for)
    assert set(fp16) <= set(default) if cuda_onnxruntime() else default == cpu
    assert ExportOptions(fp16=True).graph_variants() == (
        "float32", SERVING, *fp16, SERVING_INT8, SERVING_FUSED, PREFILL_FUSED, SERVING_FUSED_INT8,
        PREFILL_UP_PROJECTED,
    )  # fmt: skip
    assert ExportOptions(fp16=False).graph_variants() == cpu
    assert ExportOptions(graphs=(SERVING_INT8,)).graph_variants() == ("float32", SERVING_INT8)
    with pytest.raises(ValueError, match="unknown graph variants"):
        ExportOptions(graphs=("bfloat16",)).graph_variants()


@pytest.mark.server  # runs a subprocess
def test_models_export_side_by_side_and_variants_derive_from_a_base_aside(tmp_path: Path) -> None:
    """Two worker processes; rope is not asked for, so its base graph is exported aside for the
    variant and left out of the repository; results come back in the asked order, verified."""
    options = ExportOptions(
        out=tmp_path, schemes=("none", "alibi"), graphs=("float32",), rope_scaling=("ntk:2",),
        eval_windows=2, eval_contexts=(64,), workers=2, extra_seeds=False,
    )  # fmt: skip
    results = run(options)
    assert [r.name for r in results] == ["none", "alibi", "rope-ntk-x2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alibi", "none", "rope-ntk-x2"]
    for result in results:
        assert not result.parity_failures() and [p.dtype for p in result.parity] == ["float32"], result
        assert result.test_bpb[64] is not None and result.onnx_bytes.keys() == {"float32"}
    assert Manifest.load(tmp_path / "rope-ntk-x2").data["rope_scaling"]["factor"] == 2.0  # type: ignore[index]
