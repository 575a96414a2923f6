"""Exports of the shipped weights: manifest, graph contract, parity, limits, interoperability."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from export.__main__ import main
from export.evaluate import bits_per_byte, evaluation_sequences
from export.manifest import Manifest, ManifestError
from export.runtime import OnnxCausalLM
from export.verify import FP16_TOLERANCE, FP32_TOLERANCE, check_parity, default_prompts
from models.config import SCHEMES
from models.limits import PositionLimitError
from models.tokenizer import TOKENIZER
from models.train import WEIGHTS_DIR
from models.transformer import Transformer


@pytest.mark.parametrize("scheme", SCHEMES)
def test_shipped_weights_are_small_and_documented(scheme: str) -> None:
    folder = WEIGHTS_DIR / scheme
    assert (folder / "model.safetensors").stat().st_size < 10 * 1024 * 1024
    training = json.loads((folder / "training.json").read_text())
    assert training["command"].startswith("python -m models.train")
    assert training["val_bpb"] < 4.0
    assert (folder / "train_log.jsonl").read_text().count("\n") == training["train_config"]["steps"]


@pytest.mark.parametrize("scheme", SCHEMES)
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
    manifest.verify("float32")
    manifest.verify("float16")
    assert manifest.kv_bytes_per_token() == 2 * config.n_layers * config.d_model * 4


@pytest.mark.parametrize("scheme", SCHEMES)
def test_graph_contract(repository: Path, scheme: str) -> None:
    proto = onnx.load(str(repository / scheme / "model.onnx"))
    onnx.checker.check_model(proto, full_check=True)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
    outputs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in proto.graph.output}
    n_layers = Manifest.load(repository / scheme).n_layers
    assert list(inputs)[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert inputs["input_ids"] == ["batch", "sequence"] and inputs["position_ids"] == ["batch", "sequence"]
    assert inputs["attention_mask"] == ["batch", "total_sequence"]
    for i in range(n_layers):
        for kind in ("key", "value"):
            assert inputs[f"past_key_values.{i}.{kind}"][::2] == ["batch", "past_sequence"]
            assert f"present.{i}.{kind}" in outputs
    assert outputs["logits"] == ["batch", "sequence", 259]
    assert len(proto.graph.input) == 3 + 2 * n_layers  # one file, weights inside


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", FP32_TOLERANCE), ("float16", FP16_TOLERANCE)])
def test_parity_left_padded_prefill_then_32_cached_steps(
    repository: Path, scheme: str, dtype: str, tolerance: float
) -> None:
    reference = Transformer.load(WEIGHTS_DIR / scheme)
    report = check_parity(
        reference, OnnxCausalLM(repository / scheme, dtype), default_prompts(TOKENIZER.bos_token_id), steps=32
    )
    assert report.prefill_max_abs <= tolerance and report.decode_max_abs <= tolerance, report
    assert report.cached_vs_full_max_abs <= tolerance, report
    assert report.greedy_equal, report


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
    bpb = bits_per_byte(OnnxCausalLM(repository / "learned"), short)
    assert bpb is not None and 0.5 < bpb < 5.0
    assert bits_per_byte(OnnxCausalLM(repository / "learned"), long) is None
    assert bits_per_byte(OnnxCausalLM(repository / "alibi"), long) is not None


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


@pytest.mark.parametrize("scheme", SCHEMES)
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


def test_export_command_prints_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["--out", str(tmp_path), "--schemes", "none", "--no-fp16", "--eval-windows", "2", "--eval-contexts", "64"]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "test bpb@64" in table and "parity fp32" in table
    assert (tmp_path / "none" / "genai_config.json").is_file()
