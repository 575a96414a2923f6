"""The KV store through the real server: memory bounded by the budget, refused budgets, the torch path."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from bench.mixed import mixed_lengths_workload
from export.runtime import OnnxCausalLM
from models.tokenizer import TOKENIZER
from service.api import generation_pb2 as pb
from service.engine.engine import Engine
from service.engine.kv import KVLayout, KVStore
from service.engine.messages import EngineConfig
from service.metrics import ServiceMetrics
from service.process import ServerProcess, wait_for

TOKEN_BYTES = 4096  # every shipped model: 4 layers x 4 heads x 32 x 2 (K, V) x 4 bytes


def test_a_scrape_during_a_gauge_update_sees_all_of_it(repository: Path) -> None:
    """The engine sets its used-bytes gauges, then the physical bytes: a scrape landing between them
    (seen once in CI on a loaded machine: used 4.4 MB against physical 2.2 MB) waits for the update
    to finish instead of pairing new used bytes with old physical ones."""
    metrics = ServiceMetrics(CollectorRegistry())
    model = Engine.from_repository(repository, EngineConfig(threads=1), metrics, ["alibi"]).models["alibi"]
    physical = model.metrics.physical
    set_physical = physical.set
    scraped: list[bytes] = []
    scraper = threading.Thread(target=lambda: scraped.append(metrics.exposition()))

    def set_late(value: float) -> None:  # a scrape arrives after the used gauges, before this one
        scraper.start()
        scraper.join(timeout=0.3)
        set_physical(value)

    physical.set = set_late  # type: ignore[method-assign]
    model.store.physical_bytes = 12345 * TOKEN_BYTES  # as if a class had just been allocated
    model._update_gauges(time.monotonic())
    scraper.join()
    physical_seen = [
        sample.value
        for family in text_string_to_metric_families(scraped[0].decode())
        for sample in family.samples
        if sample.name == "posenc_kv_cache_physical_bytes" and sample.labels.get("model") == "alibi"
    ]
    assert physical_seen == [12345 * TOKEN_BYTES]


def test_physical_cache_never_exceeds_the_budget_under_mixed_lengths(repository: Path) -> None:
    """A long prompt and short ones, growing through capacity classes, in a budget they must share:
    what /metrics shows allocated (and the store's own high-water mark, which counts an old and
    a new array while a class is re-allocated) stays within the budget; nothing is left after."""
    layout = KVLayout(4, 4, 32, "float32")
    budget = KVStore.minimum_budget(layout, 1024, 16) + 160 * TOKEN_BYTES  # tight: some sequences must wait
    server = ServerProcess(
        repository, "--models", "alibi", "--kv-cache-bytes", str(budget), "--max-sequence-tokens", "1024"
    ).wait_serving()
    try:
        figures = mixed_lengths_workload(
            server, "alibi", long_prompt_bytes=700, short_streams=10, short_prompt_bytes=50, new_tokens=250,
            delay=0.3, interval=0.02,
        )  # fmt: skip
        assert all(text for text in figures.texts)  # every stream was served
        assert len(figures.samples) > 20
        assert max(s["posenc_running_sequences"] for s in figures.samples) >= 4
        assert max(s["posenc_kv_cache_physical_bytes"] for s in figures.samples) > budget // 4  # it was pressed
        for sample in figures.samples:
            assert sample["posenc_kv_cache_physical_bytes"] <= sample["posenc_kv_cache_capacity_bytes"] <= budget
            assert sample["posenc_kv_cache_used_bytes"] <= sample["posenc_kv_cache_physical_bytes"] + 16 * TOKEN_BYTES
        assert figures.peak_physical <= figures.capacity
        assert wait_for(lambda: server.sequence_bytes("posenc_kv_cache_physical_bytes", model="alibi") == 0)
        assert server.sequence_bytes("posenc_kv_cache_used_bytes", model="alibi") == 0
    finally:
        server.stop()


def test_a_budget_too_small_for_one_sequence_refuses_to_start_naming_flag_and_minimum(repository: Path) -> None:
    server = ServerProcess(repository, "--models", "alibi", "--kv-cache-bytes", "1000000")
    assert server.process.wait(timeout=60) == 2
    output = server.output()
    minimum = KVStore.minimum_budget(KVLayout(4, 4, 32, "float32"), 4096, 16)
    assert "refusing to start" in output and "--kv-cache-bytes 1000000" in output
    assert f"the minimum is {minimum} bytes" in output and "--max-sequence-tokens" in output
    assert "Traceback" not in output
    server.stop()


def test_the_torch_store_path_serves_the_same_greedy_tokens(repository: Path) -> None:
    """`--kv-backend torch` runs the CUDA path's code (torch tensors bound by pointer) on the CPU:
    concurrent greedy requests of different lengths give exactly ONNX Runtime's offline tokens."""
    prompts = ["def parse_args(argv):\n    parser = ", "import os\n", "class Stack:\n" * 30]
    server = ServerProcess(repository, "--models", "relative", "--kv-backend", "torch").wait_serving()
    try:

        def generate(prompt: str) -> str:
            request = pb.GenerateRequest(model="relative", prompt=prompt, max_new_tokens=90)
            return server.stub.Generate(request, timeout=120).text

        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(generate, prompts))
    finally:
        server.stop()
    runtime = OnnxCausalLM(repository / "relative")
    for prompt, text in zip(prompts, texts, strict=True):
        tokens, _ = runtime.greedy([TOKENIZER.encode(prompt)], 90)
        out = tokens[0]
        if TOKENIZER.eos_token_id in out:
            out = out[: out.index(TOKENIZER.eos_token_id)]
        assert text == TOKENIZER.decode(out)
