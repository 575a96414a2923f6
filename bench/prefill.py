"""The prefill section: time to first token per prompt length and scheme, through gRPC and through the
runner alone, against what the arithmetic costs (FLOPs from the manifest, numpy's sgemm rate in the same
run) and against onnxruntime-genai's prompt phase on the same model.onnx; then the prompt graph's
nodes as ONNX Runtime's profiler times them."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from contract.graph import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, past_names
from contract.manifest import GENAI_CONFIG, Manifest
from models.tokenizer import TOKENIZER
from service.api import generation_pb2 as pb
from service.engine.messages import EngineConfig
from service.engine.prompts.prompt import PromptRun
from service.engine.worker import denormals
from service.engine.worker.denormals import flush_denormals_on_this_thread
from service.engine.worker.runner import ModelRunner, StoreConfig
from service.process import ServerProcess

PROMPT_BYTES = (256, 512, 1024, 2048, 4000)
QUICK_PROMPT_BYTES = (256, 2048, 4000)
PROFILE_BYTES = 2048  # the prompt the per-node profile is taken on
TOP_NODES = 8
_LINE = "x = [i * 2 for i in range(10)]  # a line of code\n"


def prompt_text(size: int, salt: int) -> str:
    """`size` bytes of code-like text; `salt` changes its first line, so no two runs share a prefix
    (a prefix cache would otherwise answer a repeated prompt without computing it)."""
    head = f"# run {salt}\n"
    return (head + _LINE * (size // len(_LINE) + 1))[:size]


def _attention_widths(manifest: Manifest) -> tuple[int, int, int]:
    """(the query and key width, the value width, the latent width) of a layer's attention, all heads:
    d_model twice and no latent for K/V attention; for latent attention (contract.kv_spec) each head's
    query and key carry the shared rotated part beside the no-position part, its value the head width."""
    d, spec = int(manifest.data["d_model"]), manifest.kv_spec  # type: ignore[call-overload]
    if spec.key_value:
        return d, d, 0
    latent, rotated = spec.rotated_columns[0], spec.width - spec.rotated_columns[0]
    return manifest.n_heads * (manifest.head_dim + rotated), d, latent


def linear_shapes(manifest: Manifest, rows: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of every linear layer of a call over `rows` tokens, in graph order: each block's QKV
    (latent attention: the query, the down-projection to [latent; rotated key] and the key and value
    up-projections), output projection, MLP up and down, then the LM head."""
    d, vocab = int(manifest.data["d_model"]), manifest.vocab_size  # type: ignore[call-overload]
    width = int(manifest.data.get("d_ff", 4 * d))  # type: ignore[call-overload]
    query, value, latent = _attention_widths(manifest)
    if latent:
        spec = manifest.kv_spec
        rotated = spec.width - latent
        attention = [(rows, d, query), (rows, d, latent + rotated), (rows, latent, d), (rows, latent, value)]
    else:
        attention = [(rows, d, 3 * d)]
    block = [*attention, (rows, d, d), (rows, d, width), (rows, width, d)]
    return block * manifest.n_layers + [(rows, d, vocab)]


def prefill_flops(manifest: Manifest, tokens: int) -> float:
    """FLOPs of one causal prompt of `tokens` tokens: the linear layers (linear_shapes) at 2 per
    multiply-add, and causal attention (Q K^T and weights x V over the lower triangle, T^2/2 pairs each)."""
    query, value, _ = _attention_widths(manifest)
    linear = sum(2 * m * k * n for m, k, n in linear_shapes(manifest, tokens))
    attention = manifest.n_layers * 2 * (query + value) * tokens * tokens / 2
    return float(linear + attention)


def attended_tokens(manifest: Manifest, context: int) -> list[int]:
    """Per layer, the tokens a decode step's one new query attends to over `context` cached ones, its
    own included: all of them in a global layer, the last `window` in a local one (layer_groups)."""
    windows = {layer: group.window for group in manifest.layer_groups for layer in group.layers}
    return [min(context + 1, windows.get(layer) or context + 1) for layer in range(manifest.n_layers)]


def decode_attention_products(manifest: Manifest, attended: int) -> list[tuple[int, int, int, int]]:
    """(batch, m, k, n) of one layer's attention products in a decode step over `attended` tokens: the
    scores, then the weights mixing the values, per cached head (contract.kv_spec) over the query
    heads it serves. Full and windowed attention: per head one query row against head_dim-wide keys,
    then values. Latent attention in the absorbed form the serving graph runs: every head's folded
    query a row against the whole cached entry [latent; rotated key], and the weights mixing whole
    entries (the graph drops the rotated columns after the mix)."""
    spec = manifest.kv_spec
    rows = manifest.n_heads // spec.heads
    return [(spec.heads, rows, spec.width, attended), (spec.heads, rows, attended, spec.width)]


def decode_flops(manifest: Manifest, context: int) -> float:
    """FLOPs of one decode step (batch 1) over `context` cached tokens, 2 per multiply-add: the linear
    layers at one row (linear_shapes; for latent attention its key and value up-projections are the
    absorbed query and value folds a step does, the same multiply-adds), and every layer's attention
    products (decode_attention_products) over its attended tokens."""
    linear = sum(2 * m * k * n for m, k, n in linear_shapes(manifest, 1))
    attention = sum(
        2 * b * m * k * n for tokens in attended_tokens(manifest, context)
        for b, m, k, n in decode_attention_products(manifest, tokens)
    )  # fmt: skip
    return float(linear + attention)


def sgemm_gflops(size: int = 1024, runs: int = 5) -> float:
    """numpy's float32 matrix product rate (GFLOP/s, best of `runs`), with its BLAS's own threads."""
    return gemm_gflops([(size, size, size)], runs)


def gemm_gflops(shapes: list[tuple[int, int, int]], runs: int = 5) -> float:
    """numpy's float32 rate (GFLOP/s, best of `runs`) over a sequence of products (m, k) @ (k, n), one
    per shape, each right-hand matrix its own array: a model's linear layers at m rows, whose weights
    stream from memory as the graph's do when they outgrow the cache."""
    rng = np.random.default_rng(0)
    lefts = {(m, k): rng.standard_normal((m, k)).astype(np.float32) for m, k, _ in shapes}
    rights = [rng.standard_normal((k, n)).astype(np.float32) for _, k, n in shapes]

    def once() -> float:
        started = time.perf_counter()
        for (m, k, _), right in zip(shapes, rights, strict=True):
            lefts[(m, k)] @ right
        return time.perf_counter() - started

    once()  # warm-up
    best = min(once() for _ in range(runs))
    return sum(2 * m * k * n for m, k, n in shapes) / best / 1e9


def runner_ttft(runner: ModelRunner, text: str, chunk_tokens: int) -> float:
    """Seconds to compute a prompt's cache and last logits through the runner (the prefill worker's call)."""
    ids = TOKENIZER.encode(text)
    started = time.perf_counter()
    for _ in runner.prefill([PromptRun("p", ids)], chunk_tokens):  # whole, or chunk by chunk
        pass
    return time.perf_counter() - started


def grpc_ttft(server: ServerProcess, model: str, text: str) -> float:
    """Seconds from sending a request to its first streamed chunk."""
    started = time.perf_counter()
    stream = server.stub.GenerateStream(pb.GenerateRequest(model=model, prompt=text, max_new_tokens=1), timeout=600)
    next(stream)
    elapsed = time.perf_counter() - started
    list(stream)
    return elapsed


def genai_model(folder: Path, threads: int, **model_fields: object) -> tuple[Any, Any] | None:
    """(onnxruntime_genai, its Model of folder's model.onnx with `threads` intra-op threads and
    `model_fields` over its config); None where genai is not installed or has no config for the model
    (mla's cache is no K/V it knows, so its folder has no genai_config.json)."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None
    if not (folder / GENAI_CONFIG).exists():
        return None
    config = og.Config(str(folder))
    options = {"intra_op_num_threads": threads}
    config.overlay(json.dumps({"model": {**model_fields, "decoder": {"session_options": options}}}))
    model = og.Model(config)
    denormals.flags_cleared_on_this_thread()  # its runtime cleared flush-to-zero here
    return og, model


def genai_prompt_seconds(folder: Path, text: str, threads: int) -> float | None:
    """onnxruntime-genai's prompt phase (append_tokens: one call over the whole prompt) on model.onnx;
    None where genai_model is."""
    ids = TOKENIZER.encode(text)
    if (opened := genai_model(folder, threads, context_length=len(ids) + 8)) is None:
        return None
    og, model = opened
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + 1, do_sample=False)
    warm = og.Generator(model, params)
    warm.append_tokens(np.array([ids[:64]], dtype=np.int32))
    generator = og.Generator(model, params)
    started = time.perf_counter()
    generator.append_tokens(np.array([ids], dtype=np.int32))
    return time.perf_counter() - started


def profile_prompt_graph(runner: ModelRunner, tokens: int, threads: int) -> list[tuple[str, str, float, float]]:
    """(node, op type, ms, share) of the `TOP_NODES` slowest nodes of the runner's prompt graph on one
    `tokens`-token prompt, from ONNX Runtime's profiler (SessionOptions.enable_profiling)."""
    path = runner.prompt_graph
    with tempfile.TemporaryDirectory(prefix="prefill-profile-") as scratch:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(scratch, "prefill")
        options.log_severity_level = 3
        if denormals.enabled():  # as the served sessions
            options.add_session_config_entry("session.set_denormal_as_zero", "1")
            flush_denormals_on_this_thread()
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        layout = runner.layout
        empty = np.zeros((1, layout.n_heads, 0, layout.head_dim), dtype=np.float32)
        ids = np.full((1, tokens), 65, dtype=np.int64)
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: np.ones_like(ids), POSITION_IDS: np.arange(tokens)[None]}
        feeds.update(dict.fromkeys(past_names(layout.n_layers), empty))
        session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    times: dict[tuple[str, str], float] = defaultdict(float)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            times[(event["name"].removesuffix("_kernel_time"), event["args"].get("op_name", ""))] += event["dur"]
    total = sum(times.values()) or 1.0
    top = sorted(times.items(), key=lambda item: -item[1])[:TOP_NODES]
    return [(name, op, micros / 1000, micros / total) for (name, op), micros in top]


def print_prefill(args: argparse.Namespace, repository: Path, server_threads: int, device_flags: list[str]) -> None:
    """TTFT per scheme and prompt length (gRPC and runner), effective GFLOP/s against numpy's sgemm,
    onnxruntime-genai's prompt phase, and the prompt graph's top nodes."""
    sizes = QUICK_PROMPT_BYTES if args.quick else PROMPT_BYTES
    runs = 1 if args.quick else 3
    threads = os.cpu_count() or 1  # the prefill session's threads (the server's default: every core)
    chunk = EngineConfig().prefill_tokens
    folders = [
        f for f in sorted(p for p in repository.iterdir() if (p / "manifest.json").is_file())
        if Manifest.load(f).served_by_default and Manifest.load(f).max_positions is None
    ]  # fmt: skip
    sgemm = sgemm_gflops()
    print(
        f"\nPrefill: time to first token (ms, median of {runs}) per prompt length in bytes, {threads} prefill "
        f"thread(s), chunks of {chunk} tokens; effective GFLOP/s = FLOPs of the prompt (from the manifest) / TTFT; "
        f"numpy sgemm (1024^3, its own threads) {sgemm:.1f} GFLOP/s in this run; load {os.getloadavg()[0]:.1f}:"
    )
    print("  " + f"{'model':<12}{'path':<10}" + "".join(f"{s:>18}" for s in sizes))
    names = [Manifest.load(f).name for f in folders]
    server = ServerProcess(repository, "--models", *names, "--max-new-tokens-limit", "16", *device_flags,
                           threads=server_threads)  # fmt: skip
    salt = iter(range(10**9))
    at_2048: dict[str, dict[str, float]] = {}
    try:
        server.wait_serving()
        for folder, name in zip(folders, names, strict=True):
            manifest = Manifest.load(folder)
            grpc_ttft(server, name, prompt_text(300, next(salt)))  # warm-up
            runner = ModelRunner(manifest, StoreConfig(1 << 30, 16, 8192), "cpu", 0)
            runner_ttft(runner, prompt_text(300, 0), chunk)
            rows: dict[str, list[float]] = {"gRPC": [], "runner": [], "genai": []}
            for size in sizes:
                rows["gRPC"].append(statistics.median(grpc_ttft(server, name, prompt_text(size, next(salt)))
                                                      for _ in range(runs)))  # fmt: skip
                rows["runner"].append(statistics.median(runner_ttft(runner, prompt_text(size, 0), chunk)
                                                        for _ in range(runs)))  # fmt: skip
                genai = genai_prompt_seconds(folder, prompt_text(size, 0), threads)
                rows["genai"].append(math.nan if genai is None else genai)
            for path, seconds in rows.items():
                cells = []
                for size, s in zip(sizes, seconds, strict=True):
                    rate = prefill_flops(manifest, size + 1) / s / 1e9
                    cells.append(f"{s * 1000:8.1f} ({rate:5.1f})")
                print(f"  {name:<12}{path:<10}" + "".join(f"{c:>18}" for c in cells))
            if 2048 in sizes:
                at = sizes.index(2048)
                at_2048[name] = {path: seconds[at] for path, seconds in rows.items()}
    finally:
        server.stop()
    if at_2048:
        flops = prefill_flops(Manifest.load(folders[0]), 2049)
        print(f"  at 2048 bytes ({flops / 1e9:.2f} GFLOP): gRPC rate / numpy sgemm (goal >= 0.4), "
              "gRPC TTFT / onnxruntime-genai prompt phase (goal <= 1):")  # fmt: skip
        for name, figures in at_2048.items():
            rate = prefill_flops(Manifest.load(repository / name), 2049) / figures["gRPC"] / 1e9
            print(f"    {name:<12} {rate / sgemm:5.2f}   {figures['gRPC'] / figures['genai']:5.2f}")
    runner = ModelRunner(Manifest.load(repository / args.model), StoreConfig(1 << 30, 16, 8192), "cpu", 0)
    tokens = PROFILE_BYTES + 1
    print(f"\nPrompt graph of {args.model} ({Path(runner.prompt_graph).name}), {tokens} tokens in one call, "
          f"{threads} thread(s): top nodes by ONNX Runtime's profiler")  # fmt: skip
    for node, op, ms, share in profile_prompt_graph(runner, tokens, threads):
        print(f"  {node:<44}{op:<28}{ms:8.2f} ms {share * 100:5.1f}%")
