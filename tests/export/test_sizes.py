"""Random weights at a named size (`python -m export --size small`): exported by the same exporter into a
repository of its own, served like any model, reported as random everywhere; and `python -m bench --size`
on it. Built on a 2-layer stand-in of the small width, never the full 85 M model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from contract.manifest import Manifest
from contract.paths import REPOSITORY_ROOT, sized_repository
from export.__main__ import parse_args
from export.repository import GRAPH_FILES, RANDOM_GRAPHS, ExportOptions, graphs_for, model_variants, run
from models.sizes import RANDOM_SCHEMES
from service.api import generation_pb2 as pb
from service.process import ServerProcess

STANDIN = ("rope", "rnope-swa")


@pytest.fixture(scope="module")
def small_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("small")
    run(ExportOptions(out=out, schemes=STANDIN, size="small", n_layers=2, verify=False, workers=1))
    return out


def test_a_size_needs_no_weights_and_writes_beside_the_trained_repository(tmp_path: Path) -> None:
    options = parse_args(["--size", "small", "--weights", str(tmp_path / "none")])
    assert options.out == sized_repository("small") and options.out.name == "model_repository-small"
    assert parse_args([]).out.name == "model_repository"
    specs = model_variants(options)  # no weights folder: nothing is read
    assert [spec.name for spec in specs] == list(RANDOM_SCHEMES)
    assert all(spec.size == "small" for spec in specs)
    assert options.graph_variants() == ("float32", *RANDOM_GRAPHS)


@pytest.mark.server  # the stand-in's export, servers
def test_the_stand_in_is_exported_at_the_small_width_and_says_its_weights_are_random(small_repository: Path) -> None:
    for scheme in STANDIN:
        manifest = Manifest.load(small_repository / scheme)
        manifest.verify_all()
        assert (manifest.size, manifest.random_weights, manifest.n_layers, manifest.n_heads) == ("small", True, 2, 12)
        assert manifest.data["d_model"] == 768
        files = {path.name for path in (small_repository / scheme).glob("*.onnx")}
        assert files == {GRAPH_FILES[variant] for variant in graphs_for(scheme, ("float32", *RANDOM_GRAPHS))}


@pytest.mark.server  # the stand-in's export, servers
def test_the_service_serves_it_unchanged_and_lists_it_as_random(small_repository: Path) -> None:
    server = ServerProcess(small_repository, "--models", "rope").wait_serving(timeout=300)
    try:
        (info,) = server.stub.ListModels(pb.ListModelsRequest(), timeout=10).models
        assert (info.name, info.random_weights, info.kv_cache_bytes_per_token) == ("rope", True, 2 * 2 * 768 * 4)
        body = {"model": "rope", "prompt": "def main():\n", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)  # README's curl
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
        (model,) = httpx.get(f"{server.http_url}/v1/models", timeout=10).json()["data"]
        assert model["random_weights"] is True
    finally:
        server.stop()


@pytest.mark.server  # the stand-in's export, servers
def test_bench_size_prints_the_lines_scripts_look_for(small_repository: Path) -> None:
    """As a user runs it: its own process (the bench flushes denormals on its threads, which must not
    leak into the test process)."""
    argv = ["--size", "small", "--quick", "--model-repository", str(small_repository), "--schemes", *STANDIN]
    result = subprocess.run(
        [sys.executable, "-m", "bench", *argv], cwd=REPOSITORY_ROOT, capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"^size small: .*RANDOM weights.* 14\.4M parameters; weights 58 MB; memory bandwidth [0-9.]+ GB/s",
                     out, re.MULTILINE), out  # fmt: skip
    value = r" [0-9]+\.[0-9]{2}$"
    lines = [f"{scheme} {name}" for scheme in STANDIN for name in ("decode/roofline", "decode@4096/roofline")]
    for line in (*lines, "gRPC/genai", "prefill/sgemm", "rnope-swa / rope ITL@4096"):
        assert re.search("^" + re.escape(line) + value, out, re.MULTILINE), (line, out)
    for scheme in STANDIN:  # the same steps against both roofs, bytes and FLOPs
        roof = re.escape(f"{scheme} decode@4096/two-roof roofline") + r" [0-9]+\.[0-9]{2}, (bandwidth|compute) binds \("
        assert re.search("^" + roof, out, re.MULTILINE), (scheme, out)
