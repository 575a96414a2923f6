"""The timed sections: latency (first token by prompt length, inter-token by context) and the
closed-loop load series, without and with admission control, then memory at the load's end.

Both are measured in rounds that visit every scheme, in an order rotated each round, against
servers started together, rather than one scheme after another: a shared machine's speed drifts
over minutes, and measured in sequence that drift lands between schemes, where it reads as what a
positional scheme costs.

Their servers run without the prefix cache (`COMPUTED`): these sections price computing prompts,
and they send the same prompts again (latency's rounds, the load's pool of 64 per length), which
with the cache on would be hits, measuring the cache instead of the scheme. What reuse buys is the
`reuse` section's (loadtest/study/reuse.py).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import torch
from tqdm import tqdm

from loadtest.streaming import timed_stream
from loadtest.study.budget import Budget
from loadtest.study.held_out import HeldOut
from loadtest.study.kv_footprint import FIXED_BUDGET_BYTES
from loadtest.study.results import LoadFigures, Results
from loadtest.study.rounds import medians
from loadtest.study.serving import COMPUTED, generate, servable, served_limits, serving
from loadtest.workloads import load_prompt_bytes
from models.checkpoints import WEIGHTS_DIR
from models.transformer import Transformer
from service.api import generation_pb2 as pb
from service.api.retry import MAX_RETRY_AFTER_SECONDS, RETRY_AFTER_KEY
from service.process import ServerProcess

# Goodput targets: a request counts when both hold.
TTFT_TARGET_S = 0.5
ITL_TARGET_S = 0.05
# The server's --ttft-slo-seconds in the admission-control series: below the goodput target, since
# the server checks its own first token (9 in 10 requests within it) and the client sees it later.
ADMISSION_TTFT_SLO_S = 0.4
# A load client honours the server's retry hint (retry-after-ms), up to the server's own longest
# hint: a real hint is never cut short, a corrupt one cannot stall a client.
MAX_RETRY_AFTER_S = MAX_RETRY_AFTER_SECONDS
ITL_NEW_TOKENS = 16
# How often a load level scrapes /metrics for the KV peak: at most every 0.5 s, and 20 times a level.
# Every 50 ms taxed what it measured (a rope prefix-cache hit at one user: TTFT p50 12.2-18.5 ms
# against 11.4-12.3 scraped once a second, ITL +20%).
METRICS_SAMPLE_SECONDS = 0.5
SECTIONS = ("latency", "load")


def rotated(schemes: list[str], turn: int) -> list[str]:
    """`schemes` from a different one each turn, so that no scheme is always measured first."""
    shift = turn % len(schemes)
    return schemes[shift:] + schemes[:shift]


def measure_latency(
    servers: dict[str, ServerProcess], limits: dict[str, int], held_out: HeldOut, budget: Budget, results: Results
) -> None:
    """Time to first token by prompt length and inter-token latency by context, for every scheme on
    the same prompts, `budget.repeats` rounds each visiting every scheme once (medians)."""
    schemes = list(servers)
    ttft_prompts = {str(length): held_out.text(length) for length in budget.prompt_lengths}
    itl_prompts = {str(context): held_out.text(context) for context in budget.itl_contexts}
    ttft: dict[str, dict[str, list[float]]] = {s: {length: [] for length in ttft_prompts} for s in schemes}
    itl: dict[str, dict[str, list[float]]] = {s: {context: [] for context in itl_prompts} for s in schemes}
    for turn in range(budget.repeats):
        for scheme in rotated(schemes, turn):
            server, limit = servers[scheme], limits[scheme]
            for length, prompt in ttft_prompts.items():
                if servable(limit, prompt, 1):
                    response = generate(server, scheme, prompt, 1)
                    if response.usage.cached_prompt_tokens:
                        raise RuntimeError(f"{scheme}: a latency prompt was served from the prefix cache")
                    ttft[scheme][length].append(response.timings.time_to_first_token_seconds)
            for context, prompt in itl_prompts.items():
                if servable(limit, prompt, ITL_NEW_TOKENS):
                    response = generate(server, scheme, prompt, ITL_NEW_TOKENS)
                    steps = max(1, response.usage.completion_tokens - 1)
                    timings = response.timings
                    itl[scheme][context].append((timings.total_seconds - timings.time_to_first_token_seconds) / steps)
    for scheme in schemes:
        results.ttft[scheme] = {k: statistics.median(v) if v else None for k, v in ttft[scheme].items()}
        results.itl[scheme] = {k: statistics.median(v) if v else None for k, v in itl[scheme].items()}
    for name, rounds in (("ttft", ttft), ("itl", itl)):
        results.latency_rounds.setdefault(name, {}).update(rounds)


def load_figures(
    records: list[tuple[float, float, float, int]], errors: int, refused: int, wall: float,
    peak: dict[str, float], capacity: float, running: bool,
) -> LoadFigures:  # fmt: skip
    """A load level's figures from its requests' (latency, ttft, mean itl, tokens) and the peaks sampled."""
    latencies = np.array([r[0] for r in records]) if records else np.zeros(1)
    ttfts = np.array([r[1] for r in records]) if records else np.zeros(1)
    good = sum(1 for r in records if r[1] <= TTFT_TARGET_S and r[2] <= ITL_TARGET_S)
    return {
        "requests": len(records),
        "errors": errors,
        "refused": refused,
        "refused_per_s": refused / wall,
        "p50_s": float(np.percentile(latencies, 50)),
        "p95_s": float(np.percentile(latencies, 95)),
        "p99_s": float(np.percentile(latencies, 99)),
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "itl_p50_s": float(np.median([r[2] for r in records])) if records else 0.0,
        "requests_per_s": len(records) / wall,
        "tokens_per_s": sum(r[3] for r in records) / wall,
        "goodput_per_s": good / wall,
        "kv_peak_bytes": peak["kv"],
        "pool_utilisation": peak["kv"] / capacity if capacity else 0.0,
        **({"running_peak": peak["running"]} if running else {}),
    }


def measure_load(
    server: ServerProcess, model: str, prompt: Callable[[random.Random], str], users: int, seconds: float,
    new_tokens: int, running: bool = False,
) -> LoadFigures:  # fmt: skip
    """Closed loop: `users` clients stream generations of `new_tokens` for `seconds`, each request's
    prompt drawn by `prompt` from the client's own generator; /metrics sampled for peaks (with
    `running`, the most sequences running at once too, in the same scrape)."""
    records: list[tuple[float, float, float, int]] = []  # latency, ttft, mean itl, tokens
    errors = refused = 0
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds
    peak = {"kv": 0.0, "running": 0.0}
    names = ["posenc_kv_cache_used_bytes", *(["posenc_running_sequences"] if running else [])]
    sampling = threading.Event()
    interval = min(METRICS_SAMPLE_SECONDS, seconds / 20)

    def sample_metrics() -> None:
        while not sampling.is_set():
            try:
                values = server.sample(names, model=model)
                peak["kv"] = max(peak["kv"], values["posenc_kv_cache_used_bytes"])
                peak["running"] = max(peak["running"], values.get("posenc_running_sequences", 0.0))
            except Exception:  # a scrape racing the server is not a result
                pass
            sampling.wait(interval)

    def client(index: int) -> None:
        nonlocal errors, refused
        rng = random.Random(index)
        while time.monotonic() < stop_at:
            request = pb.GenerateRequest(
                model=model,
                prompt=prompt(rng),
                max_new_tokens=new_tokens,
                temperature=0.8,
                seed=index,
            )
            timing = timed_stream(server.stub, request, 120)
            if timing.error is not None and timing.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                with lock:
                    refused += 1
                # A well-behaved client backs off as the server asks (retry-after-ms).
                hint = dict(timing.error.trailing_metadata() or ()).get(RETRY_AFTER_KEY)
                pause = min(MAX_RETRY_AFTER_S, int(hint) / 1000 if hint else 0.1)
                time.sleep(min(pause, max(0.0, stop_at - time.monotonic())))
                continue
            with lock:
                if timing.error is not None:
                    errors += 1
                    continue
                ttft = timing.time_to_first_token or 0.0
                records.append((timing.seconds, ttft, timing.mean_inter_token or 0.0, timing.completion_tokens))

    sampler = threading.Thread(target=sample_metrics, daemon=True)
    sampler.start()
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=users) as pool:
        list(pool.map(client, range(users)))
    wall = time.monotonic() - started
    sampling.set()
    sampler.join()
    capacity = server.metric("posenc_kv_cache_capacity_bytes", model=model)
    return load_figures(records, errors, refused, wall, peak, capacity, running)


def measure_load_series(
    repository: Path, threads: int, schemes: list[str], held_out: HeldOut, budget: Budget, results: Results,
    progress: tqdm,
) -> None:  # fmt: skip
    """The load series (`budget.concurrency` users), `budget.load_rounds` rounds each measuring every
    level for every scheme on the same prompts, in an order rotated by level and round; each level's
    figures are its rounds' medians (every round kept in `results.load_rounds`). Then memory at its
    end; then the series again against servers started with --ttft-slo-seconds (the same limits), so
    refusals and goodput can be set beside it."""
    admission = ("--ttft-slo-seconds", str(ADMISSION_TTFT_SLO_S))
    prompts: dict[int, list[str]] = {}
    for series, flags in (("load", ()), ("load, admission control", admission)):
        progress.set_postfix(part=series)
        rounds: dict[str, dict[str, list[LoadFigures]]] = {s: {str(u): [] for u in budget.concurrency} for s in schemes}
        with serving(repository, threads, schemes, *COMPUTED, *flags) as servers:
            limits = served_limits(servers, results)
            for n in {load_prompt_bytes(limit) for limit in limits.values()} - set(prompts):
                prompts[n] = [held_out.text(n) for _ in range(64)]
            for round_index in range(budget.load_rounds):
                for turn, users in enumerate(budget.concurrency):
                    for scheme in rotated(schemes, turn + round_index):
                        chosen = prompts[load_prompt_bytes(limits[scheme])]
                        figures = measure_load(
                            servers[scheme], scheme, lambda rng, c=chosen: rng.choice(c), users,
                            budget.load_seconds, budget.load_new_tokens,
                        )  # fmt: skip
                        rounds[scheme][str(users)].append(figures)
                        progress.update()
            loads = {scheme: medians(rounds[scheme]) for scheme in schemes}
            if not flags:
                for scheme, server in servers.items():
                    results.memory[scheme] = {
                        "process_peak_bytes": server.memory_bytes("VmHWM"),  # front end + engine core
                        "kv_peak_bytes": max(v["kv_peak_bytes"] for v in loads[scheme].values()),
                        **per_step_extra_bytes(scheme),
                    }
        (results.load_admission if flags else results.load).update(loads)
        results.load_rounds.setdefault("load_admission" if flags else "load", {}).update(rounds)


BUDGET_PROMPT_BYTES = 4000  # "4 KB prompts": with BOS and the answer within the servers' 4,096 tokens


def measure_budget_load(
    repository: Path, threads: int, schemes: list[str], held_out: HeldOut, budget: Budget, results: Results,
    progress: tqdm,
) -> None:  # fmt: skip
    """The load under one fixed KV budget (`--kv-cache-bytes`, what 8 rope sequences of 4,096 tokens
    take) with 4 KB prompts at the most users: what a scheme's memory buys in goodput on this machine.
    A scheme that holds fewer bytes a token runs more of these requests at once within the budget;
    whether that shows as goodput is what prefill on this machine allows. Schemes whose position
    limit cannot take the prompt are left out."""
    users = max(budget.concurrency)
    flags = (*COMPUTED, "--kv-cache-bytes", str(FIXED_BUDGET_BYTES))
    prompts = [held_out.text(BUDGET_PROMPT_BYTES) for _ in range(16)]
    progress.set_postfix(part="load, one KV budget")
    with serving(repository, threads, schemes, *flags) as servers:
        limits = served_limits(servers, results)
        for scheme in rotated(schemes, 0):
            if servable(limits[scheme], prompts[0], budget.load_new_tokens):
                figures = measure_load(
                    servers[scheme], scheme, lambda rng: rng.choice(prompts), users, budget.load_seconds,
                    budget.load_new_tokens, running=True,
                )  # fmt: skip
                results.load_budget[scheme] = {**figures, "users": users, "kv_budget_bytes": FIXED_BUDGET_BYTES,
                                               "prompt_bytes": BUDGET_PROMPT_BYTES}  # fmt: skip
            progress.update()


def measure_timed_sections(
    repository: Path, threads: int, schemes: list[str], sections: set[str], held_out: HeldOut, budget: Budget,
    results: Results, progress: tqdm,
) -> None:  # fmt: skip
    """Latency and load, each in rounds over every scheme (see the module's docstring)."""
    if "latency" in sections:
        progress.set_postfix(part="latency")
        with serving(repository, threads, schemes, *COMPUTED) as servers:
            measure_latency(servers, served_limits(servers, results), held_out, budget, results)
        progress.update(len(schemes))
    if "load" in sections:
        measure_load_series(repository, threads, schemes, held_out, budget, results, progress)
        if budget.budget_load:
            measure_budget_load(repository, threads, schemes, held_out, budget, results, progress)


def per_step_extra_bytes(scheme: str, context: int = 2048) -> dict[str, int]:
    """Bytes a scheme adds per decode step (one query over `context` keys), per sequence,
    measured from its positional module: input embedding, logit bias, rotary tables."""
    model = Transformer.load(WEIGHTS_DIR / scheme)
    context = min(context, model.positional.max_positions or context)  # learned: its whole table
    query = torch.tensor([[context - 1]])
    keys = torch.arange(context)[None]
    positional = model.positional
    embedding = positional.input_embedding(query)
    bias = positional.attention_bias(query, keys)
    rotation = positional.rotation(query)
    tables = sum(t.numel() * 4 for t in vars(rotation).values() if isinstance(t, torch.Tensor))
    return {
        "input_embedding_bytes": 0 if embedding is None else embedding.numel() * 4,
        "attention_bias_bytes": 0 if bias is None else bias.numel() * 4,
        "rotary_bytes": int(tables),
    }
