"""The hybrids' per-group caches through the real server on loopback (real client, real /metrics): what a
4,000-byte prompt holds against rope, speculation, the prefix cache, streaming, log-probabilities, Score,
PyTorch parity and a killed engine core."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from contract.kv_spec import LayerCacheSpec
from contract.manifest import Manifest
from models.checkpoints import WEIGHTS_DIR
from models.tokenizer import TOKENIZER
from models.transformer import Transformer
from service.api import generation_pb2 as pb
from service.engine.engine import Engine
from service.engine.kv import KVLayout, KVStore, sliding_window
from service.engine.messages import EngineConfig, GenerateInput
from service.metrics import ServiceMetrics
from service.process import ServerProcess
from tests.service.engine.test_engine_process import kill_core, read_until
from tests.service.engine.worker.test_fused_attention import pytorch_greedy

HYBRIDS = ("rnope-swa", "rope-swa")
CODE = (
    "def load(path):\n    with open(path) as handle:\n        return [line.strip() for line in handle]\n\n"
    "class Cache(object):\n    def __init__(self, size):\n        self.size = size\n        self.items = {}\n\n"
)


def text_of(size: int) -> str:
    return (CODE * (size // len(CODE) + 1))[:size]


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    if any(Manifest.load(repository / model).local_cache is None for model in HYBRIDS):
        pytest.skip("an export from before per-group caches")
    process = ServerProcess(repository, "--models", "rope", *HYBRIDS, "--speculative-max-batch", "4").wait_serving()
    yield process
    process.stop()


def generate(server: ServerProcess, model: str, prompt: str, new_tokens: int, **fields: object) -> pb.GenerateResponse:
    request = pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=new_tokens, **fields)
    return server.stub.Generate(request, timeout=300)


def test_a_4000_byte_prompt_holds_at_most_0_3_of_rope_s_kv_bytes(server: ServerProcess) -> None:
    """posenc_kv_cache_physical_peak_bytes with the prefix cache on (its blocks count too)."""
    prompt = text_of(4000)
    for model in ("rope", *HYBRIDS):
        generate(server, model, prompt, 16)
    peak = {model: server.metric("posenc_kv_cache_physical_peak_bytes", model=model) for model in ("rope", *HYBRIDS)}
    cached = {model: server.metric("posenc_prefix_cache_bytes", model=model) for model in ("rope", *HYBRIDS)}
    print(f"peak physical bytes {peak}, prefix cache bytes {cached}")
    assert cached["rope"] > 0 and all(cached[model] > 0 for model in HYBRIDS)
    for model in HYBRIDS:
        assert peak[model] <= 0.3 * peak["rope"], (model, peak)


SPECULATION = ["posenc_speculative_proposed_tokens_total", "posenc_speculative_accepted_tokens_total"]


@pytest.mark.parametrize("model", HYBRIDS)
def test_greedy_equals_pytorch_and_speculation_changes_no_token(server: ServerProcess, model: str) -> None:
    """Alone and two at once (one class of two rows: each verifies in place), speculative greedy text is
    plain greedy text, which is PyTorch's."""
    prompts = [text_of(300), text_of(500).replace("self", "this")]
    plain = [generate(server, model, prompt, 120, speculative_tokens=0).text for prompt in prompts]
    assert list(plain[0].encode()) == pytorch_greedy(model, prompts[0], 120)[: len(plain[0].encode())]
    before = server.sample(SPECULATION, model=model)
    assert generate(server, model, prompts[0], 120, speculative_tokens=8).text == plain[0]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda p: generate(server, model, p, 120, speculative_tokens=8).text, prompts))
    after = server.sample(SPECULATION, model=model)
    assert together == plain
    # Guesses were verified, some kept and some rejected: none of the rejected stayed in a local ring.
    proposed, accepted = (after[name] - before[name] for name in SPECULATION)
    print(f"{model}: {proposed:.0f} guesses proposed, {accepted:.0f} accepted")
    assert 0 < accepted < proposed


@pytest.mark.parametrize("model", HYBRIDS)
def test_a_repeated_2kb_prompt_hits_the_prefix_cache(server: ServerProcess, model: str) -> None:
    prompt = text_of(2000).replace("size", "span")  # its own blocks: the first test cached other prompts
    first = generate(server, model, prompt, 32)
    again = generate(server, model, prompt, 32)
    assert first.usage.cached_prompt_tokens == 0
    assert again.usage.cached_prompt_tokens == (len(prompt) + 1) // 16 * 16
    assert again.text == first.text


@pytest.mark.parametrize("model", HYBRIDS)
def test_a_prompt_sharing_only_a_cached_prompt_s_start_hits_with_its_window_recomputed(
    server: ServerProcess, model: str
) -> None:
    """The cache kept the local K/V of a prompt's last blocks only; a prompt that shares its first 1,000
    bytes and then differs for 300 hits those blocks anyway (the local window before the hit is
    recomputed from the global K/V), and its greedy text is PyTorch's."""
    shared = text_of(1000).replace("line", "item")
    generate(server, model, shared + text_of(600), 8)
    prompt = shared + "import sys\n" * 30
    hit = generate(server, model, prompt, 48)
    assert hit.usage.cached_prompt_tokens == (len(shared) + 1) // 16 * 16
    assert list(hit.text.encode()) == pytorch_greedy(model, prompt, 48)[: len(hit.text.encode())]


@torch.no_grad()
@pytest.mark.parametrize("model", HYBRIDS)
def test_streaming_log_probabilities_and_score_are_pytorch_s(server: ServerProcess, model: str) -> None:
    prompt = text_of(200)
    chunks = list(server.stub.GenerateStream(pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=40,
                                                                logprobs=1), timeout=120))  # fmt: skip
    assert "".join(chunk.text for chunk in chunks) == generate(server, model, prompt, 40).text
    entries = [entry for chunk in chunks for entry in chunk.logprobs]
    tokens = TOKENIZER.encode(prompt) + [entry.token_id for entry in entries]
    reference = Transformer.load(WEIGHTS_DIR / model).float().eval()(torch.tensor([tokens]))[0][0]
    expected = torch.log_softmax(reference.double(), -1).numpy()
    start = len(TOKENIZER.encode(prompt)) - 1
    served = [entry.logprob for entry in entries]
    np.testing.assert_allclose(served, [expected[start + k, t.token_id] for k, t in enumerate(entries)], atol=1e-3)
    scored = server.stub.Score(pb.ScoreRequest(model=model, text=prompt), timeout=60)
    ids = TOKENIZER.encode(prompt)
    np.testing.assert_allclose(scored.token_logprobs, [expected[k, ids[k + 1]] for k in range(len(ids) - 1)], atol=1e-3)


@pytest.mark.parametrize("model", HYBRIDS)
def test_a_stream_resumes_after_kill_9_of_the_core_with_the_uninterrupted_text(
    server: ServerProcess, model: str
) -> None:
    prompt = text_of(150)
    request = pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=400, ignore_eos=True)
    alone = server.stub.Generate(request, timeout=300).text
    stream = server.stub.GenerateStream(request, timeout=300)
    text: list[str] = []
    read_until(stream, text, 40)
    kill_core(server)
    text += [chunk.text for chunk in stream]
    assert "".join(text) == alone
    server.wait_serving()


def test_one_budget_admits_three_times_as_many_4kb_hybrid_requests(repository: Path) -> None:
    """The engine's own scheduler and store (the runner's layout, as the service builds them) under one
    --kv-cache-bytes that admits N concurrent 4,000-byte rope requests: at least 3N of each hybrid's."""
    if any(Manifest.load(repository / model).local_cache is None for model in HYBRIDS):
        pytest.skip("an export from before per-group caches")
    budget = 3 * KVStore.minimum_budget(KVLayout(4, 4, 32, "float32"), 4096, 16)
    config = EngineConfig(kv_cache_bytes=budget, threads=1, max_batch_size=64, max_queue=64)
    engine = Engine.from_repository(repository, config, ServiceMetrics(CollectorRegistry()), ["rope", *HYBRIDS])
    admitted = {}
    for name, model in engine.models.items():
        for index in range(40):
            raw = GenerateInput(name, text_of(4000), max_new_tokens=90)
            model.scheduler.add(model.inputs.request(raw, f"{name}-{index}"))
        admitted[name] = len(model.scheduler.schedule().admitted)
    print(f"admitted under {budget} bytes: {admitted}")
    assert admitted["rope"] >= 1
    assert all(admitted[model] >= 3 * admitted["rope"] for model in HYBRIDS), admitted


def test_a_budget_between_the_hybrid_and_rope_minimum_starts_only_the_hybrid(repository: Path) -> None:
    """The startup check applies the store's own minimum to the layout it will get: a split hybrid's
    4,096-token row needs its global layers' K/V a token and its local columns, a quarter of rope's
    whole rows, so a --kv-cache-bytes between the two serves the hybrid and refuses rope, naming the
    flag and rope's minimum."""
    hybrid = Manifest.load(repository / "rnope-swa").local_cache
    if hybrid is None:
        pytest.skip("an export from before per-group caches")
    local = sliding_window(tuple(hybrid.layers), hybrid.window, 16, LayerCacheSpec.full(4, 32), "float32")
    split = KVLayout(4, 4, 32, "float32", local=local)
    low, high = (KVStore.minimum_budget(layout, 4096, 16) for layout in (split, KVLayout(4, 4, 32, "float32")))
    budget = (low + high) // 2
    assert (low, high) == (8880128, 31981568)
    server = ServerProcess(repository, "--models", "rnope-swa", "--kv-cache-bytes", str(budget)).wait_serving()
    try:
        (info,) = server.stub.ListModels(pb.ListModelsRequest(), timeout=10).models
        assert (info.kv_cache_bytes_per_token, info.kv_cache_bytes_per_sequence) == (1024, 442368)
        assert info.kv_cache_capacity_bytes <= budget
    finally:
        server.stop()
    refused = ServerProcess(repository, "--models", "rope", "--kv-cache-bytes", str(budget))
    assert refused.process.wait(timeout=60) == 2
    output = refused.output()
    assert f"--kv-cache-bytes {budget}" in output and f"the minimum is {high} bytes" in output
    assert "Traceback" not in output
    refused.stop()
