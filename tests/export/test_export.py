"""Exports of the shipped weights: manifest, graph contract, parity, limits, interoperability."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from contract.graph import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOGITS,
    POSITION_IDS,
    input_names,
    left_pad_batch,
    output_names,
    past_names,
)
from contract.manifest import (
    PREFILL_FUSED,
    PREFILL_UP_PROJECTED,
    SERVING,
    SERVING_FP16,
    SERVING_FUSED,
    SERVING_FUSED_INT8,
    SERVING_INT8,
    Manifest,
    ManifestError,
    variant_dtype,
)
from export.__main__ import main
from export.evaluate import onnx_bits_per_byte
from export.repository import GRAPH_FILES, graphs_for
from export.runtime import OnnxCausalLM
from export.verify import (
    FP16_TOLERANCE,
    FP32_TOLERANCE,
    check_int8_graph,
    check_parity,
    default_prompts,
    float64_distance,
    tolerance,
    torch_reference,
)
from models.checkpoints import WEIGHTS_DIR, trained_schemes
from models.evaluation import evaluation_sequences
from models.limits import PositionLimitError
from models.tokenizer import TOKENIZER
from models.transformer import Transformer
from tests.schemes import trained_key_value_schemes

TRAINED = trained_schemes()  # the schemes with shipped weights: what the repository fixture exports
# Those that cache a K and a V a layer: the serving contract's names, int8, the fused kernels and
# onnxruntime-genai are theirs (latent attention's graphs: tests/service/engine/test_latent_serving.py).
KEY_VALUE = trained_key_value_schemes()
ALL_GRAPHS = ("float32", SERVING, "float16", SERVING_FP16, SERVING_INT8, SERVING_FUSED, PREFILL_FUSED,
              SERVING_FUSED_INT8, PREFILL_UP_PROJECTED)  # fmt: skip


@pytest.mark.parametrize("scheme", TRAINED)
def test_shipped_weights_are_small_and_documented(scheme: str) -> None:
    folder = WEIGHTS_DIR / scheme
    assert (folder / "model.safetensors").stat().st_size < 10 * 1024 * 1024
    training = json.loads((folder / "training.json").read_text())
    assert training["command"].startswith("python -m models.train")
    assert training["val_bpb"] < 4.0
    # every step logged, except spans whose lines were lost between sessions, which training.json names
    lost = sum(last - first + 1 for first, last in training.get("log_gaps", {}).get("steps", []))
    assert (folder / "train_log.jsonl").read_text().count("\n") + lost == training["train_config"]["steps"]


@pytest.mark.parametrize("scheme", TRAINED)
def test_manifest_describes_the_model(repository: Path, scheme: str) -> None:
    manifest = Manifest.load(repository / scheme)
    config = Transformer.load(WEIGHTS_DIR / scheme).config
    data = manifest.data
    assert data["scheme"] == scheme and data["name"] == scheme
    assert (data["n_layers"], data["n_heads"], data["head_dim"], data["d_model"]) == (
        config.n_layers, config.n_heads, config.head_dim, config.d_model,
    )  # fmt: skip
    assert data["vocab_size"] == 259 and data["train_context"] == 256
    assert data["max_positions"] == (256 if scheme == "learned" else None)
    assert data["dtype"] == "float32" and data["opset"] >= 18
    assert set(data["versions"]) >= {"torch", "onnx"}
    assert data["tokenizer"] == {
        "type": "bytes",
        "bos_token_id": 256,
        "eos_token_id": 257,
        "pad_token_id": 258,
        "add_bos": True,
    }
    assert list(data["variants"]) == list(graphs_for(scheme, ALL_GRAPHS))
    for variant, entry in data["variants"].items():  # type: ignore[union-attr]
        assert entry["file"] == GRAPH_FILES[variant]
    manifest.verify_all()
    if scheme not in KEY_VALUE:  # one [latent; rotated key] a token and layer, no genai_config
        width = config.latent_width + config.latent_rope_width
        assert manifest.kv_bytes_per_token() == config.n_layers * width * 4
        assert not (repository / scheme / "genai_config.json").exists()
        return
    assert manifest.kv_bytes_per_token() == 2 * config.n_layers * config.d_model * 4
    assert (
        manifest.kv_bytes_per_token(SERVING_FP16)
        == manifest.kv_bytes_per_token("float16")
        == 2 * config.n_layers * config.d_model * 2
    )


@pytest.mark.parametrize("scheme", KEY_VALUE)
def test_graph_contract(repository: Path, scheme: str) -> None:
    proto = onnx.load(str(repository / scheme / "model.onnx"))
    onnx.checker.check_model(proto, full_check=True)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
    outputs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in proto.graph.output}
    n_layers = Manifest.load(repository / scheme).n_layers
    assert list(inputs) == input_names(n_layers) and list(outputs) == output_names(n_layers)  # names: tests/contract
    assert inputs[INPUT_IDS] == ["batch", "sequence"] and inputs[POSITION_IDS] == ["batch", "sequence"]
    assert inputs[ATTENTION_MASK] == ["batch", "total_sequence"]
    for name in past_names(n_layers):
        assert inputs[name][::2] == ["batch", "past_sequence"]
    assert outputs[LOGITS] == ["batch", "sequence", 259]
    assert len(proto.graph.input) == 3 + 2 * n_layers  # one file, weights inside
    for variant in ("float16", SERVING, SERVING_FP16):
        graph = onnx.load(str(repository / scheme / GRAPH_FILES[variant])).graph
        assert [i.name for i in graph.input] == input_names(n_layers), variant
        assert [o.name for o in graph.output] == output_names(n_layers, new_only=variant != "float16"), variant


@pytest.mark.parametrize("scheme", TRAINED)
@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [("float32", FP32_TOLERANCE), ("float16", FP16_TOLERANCE), (SERVING_FP16, FP16_TOLERANCE)],
)
def test_parity_left_padded_prefill_then_32_cached_steps(
    repository: Path, scheme: str, dtype: str, tolerance: float
) -> None:
    """The graphs against PyTorch; the serving graph's new K/V is appended to its past outside it.

    serving-float32 is held to the float32 graph below instead. A model whose own float32 rounding
    in PyTorch is large (NoPE: 1.2e-4 from float64) gets twice that rounding (ParityReport.limit);
    every other scheme's limit is FP32_TOLERANCE itself.
    """
    reference = Transformer.load(WEIGHTS_DIR / scheme)
    report = check_parity(
        reference, OnnxCausalLM(repository / scheme, dtype), default_prompts(TOKENIZER.bos_token_id), steps=32
    )
    limit = report.limit(tolerance)
    assert limit == tolerance or scheme == "none", report
    assert report.prefill_max_abs <= limit and report.decode_max_abs <= limit, report
    assert report.cached_vs_full_max_abs <= limit, report
    assert report.greedy_equal, report


def test_reference_rounding_is_float32_against_float64() -> None:
    """The rounding a parity limit may grow to is PyTorch float32 against float64, on the same tokens:
    small and nonzero, and zero for the float32 run replayed against itself."""
    model = Transformer.load(WEIGHTS_DIR / "alibi")
    reference = torch_reference(model, default_prompts(TOKENIZER.bos_token_id), TOKENIZER.pad_token_id, steps=4)
    assert 0 < reference.rounding < FP32_TOLERANCE
    assert float64_distance(copy.deepcopy(model).double(), reference) == reference.rounding
    assert float64_distance(model.float(), reference) == 0.0


@pytest.mark.parametrize("scheme", TRAINED)
@pytest.mark.parametrize("variant", [SERVING, SERVING_FP16])
def test_serving_graph_reads_a_buffer_with_masked_spare_slots(repository: Path, scheme: str, variant: str) -> None:
    """What the engine relies on: unused slots in the past buffer, masked out, change nothing."""
    runtime = OnnxCausalLM(repository / scheme, variant)
    prompts = default_prompts(TOKENIZER.bos_token_id)
    ids, mask, positions = left_pad_batch(prompts, runtime.pad_token_id)
    logits, past = runtime.forward(ids, mask, positions, runtime.empty_past(len(prompts)))
    next_ids = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
    positions = positions[:, -1:] + 1
    expected, expected_present = runtime.forward(
        next_ids, np.concatenate([mask, np.ones_like(next_ids)], 1), positions, past
    )

    spare = np.random.default_rng(0).standard_normal((*past[0].shape[:2], 5, past[0].shape[3])).astype(past[0].dtype)
    buffer = [np.concatenate((layer, spare), axis=2) for layer in past]
    buffer_mask = np.concatenate([mask, np.zeros((len(prompts), 5), dtype=np.int64), np.ones_like(next_ids)], axis=1)
    got, got_present = runtime.forward(next_ids, buffer_mask, positions, buffer)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), atol=tolerance(variant))
    for new, reference in zip(got_present, expected_present, strict=True):  # the new token's K/V
        np.testing.assert_allclose(
            new[:, :, -1:].astype(np.float32), reference[:, :, -1:].astype(np.float32), atol=tolerance(variant)
        )


@pytest.mark.parametrize("scheme", TRAINED)
@pytest.mark.parametrize("variant", [SERVING, SERVING_FP16])
def test_serving_graph_equals_the_graph_of_its_dtype(repository: Path, scheme: str, variant: str) -> None:
    """Switching the engine to the in-place graph changes no logits beyond the dtype's tolerance."""
    prompts = default_prompts(TOKENIZER.bos_token_id)
    tokens, logits = OnnxCausalLM(repository / scheme, variant).greedy(prompts, 16)
    plain_tokens, plain_logits = OnnxCausalLM(repository / scheme, variant_dtype(variant)).greedy(prompts, 16)
    assert tokens == plain_tokens
    for step, (mine, plain) in enumerate(zip(logits, plain_logits, strict=True)):
        np.testing.assert_allclose(
            mine.astype(np.float32), plain.astype(np.float32), atol=tolerance(variant), err_msg=f"step {step}"
        )


def test_learned_position_limit_is_caught_before_onnx_runtime(repository: Path) -> None:
    runtime = OnnxCausalLM(repository / "learned")
    ids = np.zeros((1, 1), dtype=np.int64)
    past = runtime.empty_past(1)
    with pytest.raises(PositionLimitError, match="max_positions=256"):
        runtime.forward(ids, np.ones((1, 1), dtype=np.int64), np.array([[256]]), past)
    logits, _ = runtime.forward(ids, np.ones((1, 1), dtype=np.int64), np.array([[255]]), past)
    assert np.isfinite(logits).all()


def test_bits_per_byte_and_not_servable(repository: Path) -> None:
    stream = np.frombuffer(Path(__file__).read_bytes() * 4, dtype=np.uint8).astype(np.int64)
    short = evaluation_sequences(stream, 256, 2, TOKENIZER.bos_token_id)
    long = evaluation_sequences(stream, 512, 2, TOKENIZER.bos_token_id)
    bpb = onnx_bits_per_byte(OnnxCausalLM(repository / "learned"), short)
    assert bpb is not None and 0.5 < bpb < 5.0
    assert onnx_bits_per_byte(OnnxCausalLM(repository / "learned"), long) is None
    assert onnx_bits_per_byte(OnnxCausalLM(repository / "alibi"), long) is not None


def test_tampered_or_missing_files_are_refused_by_name(repository: Path, tmp_path: Path) -> None:
    folder = tmp_path / "none"
    shutil.copytree(repository / "none", folder)
    data = bytearray((folder / "model.onnx").read_bytes())
    data[-1] ^= 0xFF
    (folder / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"model\.onnx: sha256"):
        OnnxCausalLM(folder)
    (folder / "model.onnx").unlink()
    with pytest.raises(ManifestError, match=r"model\.onnx: ONNX file named by .* is missing"):
        OnnxCausalLM(folder)
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match=r"manifest\.json: manifest is not valid JSON"):
        Manifest.load(folder)


@pytest.mark.parametrize("scheme", KEY_VALUE)
def test_onnxruntime_genai_greedy_equals_ours(repository: Path, scheme: str) -> None:
    og = pytest.importorskip("onnxruntime_genai")
    prompt = TOKENIZER.encode("def parse_args(argv):\n    ")
    model = og.Model(str(repository / scheme))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 48, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    theirs = [int(t) for t in generator.get_sequence(0)[len(prompt) :]]
    ours, _ = OnnxCausalLM(repository / scheme).greedy([prompt], 48)
    assert len(theirs) == 48
    assert theirs == ours[0]


@pytest.mark.server  # exports a repository (one scheme, every graph): minutes
def test_export_command_prints_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    code = main(
        ["--out", str(tmp_path), "--schemes", "none", "--no-fp16", "--eval-windows", "2", "--eval-contexts", "64"]
    )
    assert code == 0
    # torch logs "torchvision is not installed. Skipping ..." on every export; export/onnx.py drops it
    assert not [record for record in caplog.records if "torchvision" in record.getMessage()]
    table = capsys.readouterr().out
    assert "test bpb@64" in table and "parity fp32" in table and "parity fused-int8" in table
    variants = json.loads((tmp_path / "none" / "manifest.json").read_text())["variants"]
    assert variants.keys() == {"float32", SERVING, SERVING_INT8, SERVING_FUSED, PREFILL_FUSED, SERVING_FUSED_INT8}
    assert "parity fused" in table and "parity prefill" in table
    assert (tmp_path / "none" / "genai_config.json").is_file()


@pytest.mark.parametrize("scheme", ["alibi", "rope"])
def test_the_int8_graph_reads_its_cache_as_pytorch_does(repository: Path, scheme: str) -> None:
    """serving-int8 dequantizes its int8 past and scales and runs the same layers: PyTorch fed the
    same dequantized cache gives the same next-token logits."""
    runtime = OnnxCausalLM(repository / scheme, SERVING_INT8)
    model = Transformer.load(WEIGHTS_DIR / scheme)
    assert check_int8_graph(model, runtime, default_prompts(TOKENIZER.bos_token_id)) <= FP32_TOLERANCE
