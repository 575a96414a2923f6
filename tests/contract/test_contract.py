"""The contract between export and service: neutral imports, graph names, feeding, the manifest reader."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from contract.graph import (
    input_names,
    left_pad_batch,
    new_kv_names,
    output_names,
    past_names,
    present_names,
    target_logprobs,
)
from contract.manifest import (
    REQUIRED_KEYS,
    SERVING,
    SERVING_FP16,
    Manifest,
    ManifestError,
    serving_variant,
    variant_dtype,
)

CONTRACT = Path(__file__).resolve().parents[2] / "contract"


def test_contract_imports_only_the_standard_library_and_numpy() -> None:
    allowed = set(sys.stdlib_module_names) | {"numpy", "contract"}
    for path in CONTRACT.glob("*.py"):
        tree = ast.parse(path.read_text())
        modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert {m.split(".")[0] for m in modules} <= allowed, (path.name, modules)


@pytest.mark.server  # runs a subprocess
def test_importing_the_contract_loads_neither_side() -> None:
    code = (
        "import sys, contract.graph, contract.manifest; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'models', 'export', 'service', 'onnx'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_names_in_graph_order() -> None:
    assert past_names(2) == [
        "past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value",
    ]  # fmt: skip
    assert present_names(1) == ["present.0.key", "present.0.value"]
    assert new_kv_names(1) == ["new_key_values.0.key", "new_key_values.0.value"]
    assert input_names(1) == ["input_ids", "attention_mask", "position_ids", *past_names(1)]
    assert output_names(1) == ["logits", *present_names(1)]
    assert output_names(1, new_only=True) == ["logits", *new_kv_names(1)]


def test_serving_variant_names() -> None:
    assert serving_variant("float32") == SERVING == "serving-float32"
    assert serving_variant("float16") == SERVING_FP16 == "serving-float16"
    assert [variant_dtype(v) for v in ("float32", "float16", SERVING, SERVING_FP16)] == ["float32", "float16"] * 2
    with pytest.raises(ValueError, match="bfloat16"):
        serving_variant("bfloat16")
    with pytest.raises(ValueError, match="not a graph variant"):
        variant_dtype("serving-int8")


def test_left_padding_keeps_lone_positions() -> None:
    ids, mask, positions = left_pad_batch([[5, 6, 7], [9], []], pad_token_id=0)
    np.testing.assert_array_equal(ids, [[5, 6, 7], [0, 0, 9], [0, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1], [0, 0, 0]])
    np.testing.assert_array_equal(positions, [[0, 1, 2], [0, 0, 0], [0, 0, 0]])
    assert ids.dtype == mask.dtype == positions.dtype == np.int64


def test_target_logprobs_is_a_log_softmax_pick() -> None:
    logits = np.random.default_rng(0).standard_normal((4, 7)).astype(np.float16)
    expected = np.log(np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(target_logprobs(logits, [0, 3, 6, 2]), expected[np.arange(4), [0, 3, 6, 2]])


def test_manifest_reader_refuses_incomplete_folders(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="manifest is missing"):
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(ManifestError, match="manifest lacks scheme"):
        Manifest.load(tmp_path)
    data = {key: None for key in REQUIRED_KEYS} | {"variants": {"float32": {"file": "m.onnx", "sha256": "0"}}}
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    manifest = Manifest.load(tmp_path)
    with pytest.raises(ManifestError, match=r"no serving-float16 variant \(have float32\)"):
        manifest.variant(SERVING_FP16)
    with pytest.raises(ManifestError, match=r"m\.onnx: ONNX file named by .* is missing"):
        manifest.verify_all()
