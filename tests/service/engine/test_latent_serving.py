"""Latent attention (`mla`) served like every scheme: its cache holds one [latent; rotated key] a token,
and batching, the prefix cache, segments, speculation and resume after a killed core all work on it.

Through the real server and a real gRPC client. The model is the shipped `mla` where its weights are
trained, else a seeded untrained one of the same shape (what is tested here needs no trained weights).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from contract.manifest import Manifest
from export.repository import ExportOptions, run
from export.runtime import OnnxCausalLM
from export.verify import FP32_TOLERANCE, check_parity, default_prompts
from models.checkpoints import WEIGHTS_DIR
from models.positional import matched_config
from models.tokenizer import TOKENIZER
from models.transformer import Transformer
from service.api import generation_pb2 as pb
from service.engine.kv import NumpyArrays
from service.engine.prompts.segments import keys_moved
from service.process import ServerProcess, wait_for
from tests.service.engine.test_engine_process import kill_core, read_until
from tests.service.test_service import offline_greedy_text

PROMPT = "def main():\n    for line in open(path):\n"


@pytest.fixture(scope="module")
def latent_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped `mla` weights, or a seeded untrained model of the same shape."""
    if (WEIGHTS_DIR / "mla" / "model.safetensors").is_file():
        return WEIGHTS_DIR
    weights = tmp_path_factory.mktemp("latent_weights")
    torch.manual_seed(1234)
    Transformer(matched_config("mla")).save(weights / "mla")
    shutil.copy(WEIGHTS_DIR / "rope" / "tokenizer.json", weights / "mla")
    (weights / "mla" / "training.json").write_text(json.dumps({"val_bpb": None, "command": "untrained stand-in"}))
    return weights


@pytest.fixture(scope="module")
def latent_repository(tmp_path_factory: pytest.TempPathFactory, repository: Path, latent_weights: Path) -> Path:
    """A repository of `mla` beside the shipped `rope`."""
    if (repository / "mla").is_dir():
        return repository
    weights = latent_weights
    out = tmp_path_factory.mktemp("latent_repository")
    run(ExportOptions(weights=weights, out=out, schemes=("mla",), verify=False, workers=1))
    (out / "rope").symlink_to(repository / "rope")
    return out


@pytest.fixture(scope="module")
def server(latent_repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        latent_repository, "--models", "mla", "rope", "--max-new-tokens-limit", "3000", "--speculative-max-batch", "8"
    ).wait_serving()
    yield process
    process.stop()


def test_its_cache_is_one_latent_and_rotated_key_a_token_under_a_third_of_ropes(server: ServerProcess) -> None:
    models = {m.name: m for m in server.stub.ListModels(pb.ListModelsRequest(), timeout=10).models}
    mla, rope = models["mla"], models["rope"]
    assert mla.kv_cache_bytes_per_token == 4 * (64 + 16) * 4  # layers x [latent; rotated key] x float32
    assert mla.kv_cache_bytes_per_token <= 0.35 * rope.kv_cache_bytes_per_token
    spec = Manifest.load(server.repository / "mla").kv_spec
    assert (spec.entries, spec.heads, spec.width, spec.rotated_columns) == (("latent",), 1, 80, (64, 80))


@pytest.mark.parametrize("variant", ["float32", "serving-float32", "prefill-up-projected"])
def test_its_graphs_match_pytorch_and_cached_decoding_matches_recomputation(
    latent_repository: Path, latent_weights: Path, variant: str
) -> None:
    """Prefill and 32 cached steps against PyTorch; the serving graph is the absorbed form, the
    prompts' graph the up-projected one through one Attention node a layer."""
    model = Transformer.load(latent_weights / "mla")
    runtime = OnnxCausalLM(latent_repository / "mla", variant)
    report = check_parity(model, runtime, default_prompts(TOKENIZER.bos_token_id))
    assert report.max_abs <= FP32_TOLERANCE and report.cached_vs_full_max_abs <= FP32_TOLERANCE
    assert report.greedy_equal
    traced = {"float32", "serving-float32", "float16", "serving-float16"}  # no int8 or fused graph: they read K and V
    assert set(Manifest.load(latent_repository / "mla").data["variants"]) <= traced | {"prefill-up-projected"}


def test_prompts_run_through_the_up_projected_graph_and_steps_through_the_absorbed_one(
    latent_repository: Path,
) -> None:
    """The prompt graph holds one `Attention` node a layer and no absorbed query; the runner opens it
    for prompts, and the serving graph (absorbed) for decode steps."""
    import onnx

    from service.engine.worker.runner import ModelRunner, StoreConfig

    folder = latent_repository / "mla"
    manifest = Manifest.load(folder)
    nodes = [node.op_type for node in onnx.load(str(manifest.onnx_path("prefill-up-projected"))).graph.node]
    assert nodes.count("Attention") == manifest.n_layers
    runner = ModelRunner(manifest, StoreConfig(1 << 24, 16, 512), "cpu", 1)
    assert runner.prompt_graph.endswith("model.prefill.up.onnx")
    sessions = runner.prompt_sessions
    assert sessions.worker is not None and sessions.worker is not sessions.by_kind["float32"]
    assert runner.session is runner.sessions["float32"] and runner.graphs["float32"].variant == "serving-float32"


def test_int8_and_bounded_policies_are_refused_by_name(server: ServerProcess) -> None:
    for policy in ("int8", "window:128", "sinks:4+window:128"):
        request = pb.GenerateRequest(model="mla", prompt="x", max_new_tokens=4, cache_policy=policy)
        with pytest.raises(Exception) as refused:
            server.stub.Generate(request, timeout=30)
        assert "cache_policy" in str(refused.value) and "latent attention" in str(refused.value)


def test_physical_peak_bytes_of_a_4000_byte_prompt_are_under_a_third_of_ropes(server: ServerProcess) -> None:
    prompt = (Path(__file__).read_text() * 4)[:4000]
    peaks = {}
    for model in ("rope", "mla"):
        before = server.metric("posenc_kv_cache_physical_peak_bytes", model=model)
        server.stub.Generate(pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=8), timeout=120)
        peaks[model] = server.metric("posenc_kv_cache_physical_peak_bytes", model=model)
        assert peaks[model] > before
    assert peaks["mla"] <= 0.35 * peaks["rope"], peaks


def test_greedy_output_is_the_offline_runs_and_identical_with_speculation(server: ServerProcess) -> None:
    expected, _ = offline_greedy_text(server.repository, "mla", PROMPT, 96)
    texts = []
    for k in (0, 8):
        request = pb.GenerateRequest(
            model="mla", prompt=PROMPT, max_new_tokens=96, ignore_eos=True, speculative_tokens=k
        )
        texts.append(server.stub.Generate(request, timeout=120).text)
    assert texts[0] == texts[1]
    assert texts[0].startswith(expected)  # the offline run stops at EOS, the served ones ignore it


def test_a_repeated_2kb_prompt_hits_the_prefix_cache(server: ServerProcess) -> None:
    prompt = (Path(__file__).read_text() * 2)[:2048]
    request = pb.GenerateRequest(model="mla", prompt=prompt, max_new_tokens=8)
    first = server.stub.Generate(request, timeout=120)
    second = server.stub.Generate(request, timeout=120)
    assert second.usage.cached_prompt_tokens >= 1024 and second.text == first.text


def test_a_killed_core_resumes_an_mla_stream_to_the_same_text(server: ServerProcess) -> None:
    request = pb.GenerateRequest(model="mla", prompt=PROMPT, max_new_tokens=400, ignore_eos=True)
    alone = server.stub.Generate(request, timeout=120).text
    stream = server.stub.GenerateStream(request, timeout=120)
    text: list[str] = []
    read_until(stream, text, 20)
    kill_core(server)
    text.extend(chunk.text for chunk in stream)
    assert "".join(text) == alone
    assert wait_for(lambda: server.metric("posenc_running_sequences", model="mla") == 0, timeout=60)


def test_a_reused_document_at_another_offset_rewrites_only_its_rotated_keys() -> None:
    """Placing a cached document elsewhere turns each layer's rotated key (columns 64-80) and leaves
    every latent byte as it was: the latent carries no position."""
    backend = NumpyArrays()
    kv = np.random.default_rng(0).standard_normal((4, 1, 9, 80)).astype(np.float32)  # layers, head, T, width
    inv_freq = 1.0 / 10000 ** (np.arange(0, 16, 2) / 16)
    moved = keys_moved(backend, kv, [0, 1, 2, 3], (64, 80), 37, inv_freq, "float32")
    changed = np.nonzero((moved != kv).reshape(-1, 80).any(axis=0))[0]
    assert changed.min() >= 64 and len(changed) == 16
    np.testing.assert_array_equal(moved[..., :64], kv[..., :64])
    back = keys_moved(backend, moved, [0, 1, 2, 3], (64, 80), -37, inv_freq, "float32")
    np.testing.assert_allclose(back, kv, atol=1e-5)


def test_a_segment_is_reused_at_another_offset(server: ServerProcess) -> None:
    document = "def area(radius):\n    return 3.14159 * radius * radius\n"
    segments = [pb.PromptSegment(text=document, reusable=True), pb.PromptSegment(text="# area of a", reusable=False)]
    request = pb.GenerateRequest(model="mla", segments=segments, max_new_tokens=8)
    server.stub.Generate(request, timeout=60)
    moved = [pb.PromptSegment(text="import math\n"), *segments]
    reply = server.stub.Generate(pb.GenerateRequest(model="mla", segments=moved, max_new_tokens=8), timeout=60)
    assert reply.usage.reused_prompt_tokens >= len(document) - 1
