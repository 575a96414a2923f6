"""The positional-encoding comparison, measured through the running service:
`python -m loadtest.compare [--quick]`.

For every scheme: latency (time to first token versus prompt length, inter-token latency versus
context, p50/p95/p99 at 1-32 concurrent users, throughput, and goodput with and without the
server's time-to-first-token admission control), cache memory (KV
bytes per token, bytes in use at peak, pool utilisation, extra per-step memory, process peak
memory), quality through `Score` (bits per byte at 0.5x-8x the training context, rope also with
linear/ntk/yarn scaling), graded retrieval probes with 95% intervals (copy over distance and
depth, passkey, bits per byte on bytes that complete a repeated n-gram; loadtest/probes.py) and
the cache-budget comparison (window, attention sinks and int8 caches: quality against KV bytes;
loadtest/cache_budget.py).
Writes reports/<run-id>/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch
from tqdm import tqdm

from contract.cli import HelpFormatter
from contract.manifest import MANIFEST
from contract.paths import REPOSITORY_ROOT
from export.repository import ExportOptions, rope_scaled_name
from export.repository import run as export_run
from loadtest.cache_budget import CacheBudgetPlan, measure_cache_budgets, score_bpb
from loadtest.probes import Scorer, copy_text, depth_text, passkey_text
from loadtest.streaming import timed_stream
from models import emergence
from models.checkpoints import WEIGHTS_DIR
from models.config import RopeScaling
from models.corpus import load_corpus
from models.positional import SCHEMES
from models.transformer import Transformer
from service.api import generation_pb2 as pb
from service.api.retry import MAX_RETRY_AFTER_SECONDS, RETRY_AFTER_KEY
from service.process import ServerProcess

ROPE_SCALINGS = ("linear", "ntk", "yarn")
SERVER_LIMITS = (
    "--max-new-tokens-limit", "4096", "--max-sequence-tokens", "4096", "--max-batch-size", "64", "--max-queue", "512",
)  # fmt: skip
# Goodput targets: a request counts when both hold.
TTFT_TARGET_S = 0.5
ITL_TARGET_S = 0.05
# The server's --ttft-slo-seconds in the admission-control series: below the goodput target, since
# the server checks its own first token (9 in 10 requests within it) and the client sees it later.
ADMISSION_TTFT_SLO_S = 0.4
# A load client honours the server's retry hint (retry-after-ms), up to the server's own longest
# hint: a real hint is never cut short, a corrupt one cannot stall a client.
MAX_RETRY_AFTER_S = MAX_RETRY_AFTER_SECONDS


@dataclass
class Budget:
    """How much to measure; --quick shrinks every count."""

    prompt_lengths: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
    itl_contexts: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    concurrency: tuple[int, ...] = (1, 8, 16, 32)
    load_seconds: float = 15.0
    load_new_tokens: int = 32
    context_multiples: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)
    scaling_multiples: tuple[float, ...] = (2.0, 4.0, 8.0)
    score_windows: int = 24
    # Retrieval probes; lengths are multiples of the model's training context.
    retrieval_trials: int = 48  # per cell: copy and passkey trials; natural windows are a quarter
    copy_distances: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    depth_contexts: tuple[float, ...] = (1.0, 4.0, 8.0)
    retrieval_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    passkey_contexts: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    natural_context: float = 8.0
    repeats: int = 3
    # Cache budgets (loadtest/cache_budget.py): tokens the cache may hold, text lengths, cells.
    cache_budgets: tuple[int, ...] = (64, 128, 256)
    cache_multiples: tuple[float, ...] = (2.0, 4.0, 8.0)
    cache_windows: int = 3
    cache_trials: int = 16
    cache_copy_distances: tuple[int, ...] = (32, 128, 512)
    cache_passkey_context: float = 2.0
    int8_multiples: tuple[float, ...] = (1.0, 4.0)

    def cache_plan(self) -> CacheBudgetPlan:
        return CacheBudgetPlan(
            self.cache_budgets, self.cache_multiples, self.cache_windows, self.cache_trials,
            self.cache_copy_distances, self.cache_passkey_context, self.int8_multiples,
        )  # fmt: skip

    @classmethod
    def quick(cls) -> Budget:
        return cls(
            prompt_lengths=(64, 256, 1024, 2048), itl_contexts=(128, 512, 2048), concurrency=(1, 8, 32),
            load_seconds=3.0, load_new_tokens=16, score_windows=3, retrieval_trials=8,
            copy_distances=(0.125, 0.5, 2.0, 8.0), depth_contexts=(1.0, 8.0), passkey_contexts=(1.0, 8.0), repeats=1,
            cache_budgets=(64, 256), cache_multiples=(2.0, 8.0), cache_windows=1, cache_trials=6,
            cache_copy_distances=(32, 512),
        )  # fmt: skip

    @classmethod
    def tiny(cls) -> Budget:
        """For tests: every measurement once, as small as it gets."""
        return cls(
            prompt_lengths=(64, 512), itl_contexts=(128, 512), concurrency=(1, 2), load_seconds=0.5,
            load_new_tokens=4, context_multiples=(0.5, 2.0), scaling_multiples=(2.0,), score_windows=1,
            retrieval_trials=2, copy_distances=(0.125, 2.0), depth_contexts=(1.0,), retrieval_depths=(0.5,),
            passkey_contexts=(1.0, 2.0), natural_context=2.0, repeats=1, cache_budgets=(64,),
            cache_multiples=(2.0,), cache_windows=1, cache_trials=2, cache_copy_distances=(32,),
            cache_passkey_context=1.0, int8_multiples=(1.0,),
        )  # fmt: skip


@dataclass
class Results:
    run_id: str
    config: dict[str, object]
    environment: dict[str, object]
    schemes: list[str]
    models: dict[str, dict[str, object]] = field(default_factory=dict)
    ttft: dict[str, dict[str, float | None]] = field(default_factory=dict)  # scheme -> prompt bytes -> s
    itl: dict[str, dict[str, float | None]] = field(default_factory=dict)  # scheme -> context -> s
    load: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # scheme -> users -> figures
    # The same load against a server with --ttft-slo-seconds (refused requests counted, not hidden).
    load_admission: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    memory: dict[str, dict[str, float]] = field(default_factory=dict)
    quality: dict[str, dict[str, float | None]] = field(default_factory=dict)  # model -> multiple -> bpb
    # scheme -> probe -> cells (see loadtest/probes.py); each cell {value, low, high, n} or None (not servable)
    retrieval: dict[str, dict[str, object]] = field(default_factory=dict)
    # scheme -> the cache-budget comparison (loadtest/cache_budget.py)
    cache_budget: dict[str, dict[str, object]] = field(default_factory=dict)
    # The served weights' copy-emergence curves, from their training logs (models/emergence.py).
    training: dict[str, dict[str, object]] = field(default_factory=dict)


# ---------------------------------------------------------------------------------- inputs


class HeldOut:
    """Text from the corpus's test split, never seen in training."""

    def __init__(self, seed: int = 0) -> None:
        self.data = load_corpus().text_bytes("test")
        self.rng = random.Random(seed)

    def text(self, length: int) -> str:
        """About `length` bytes of held-out text, valid UTF-8, at least `length` - 3 bytes."""
        start = self.rng.randrange(0, len(self.data) - length - 1)
        return self.data[start : start + length].decode("utf-8", errors="ignore")

    def windows(self, length: int, count: int) -> list[str]:
        starts = np.linspace(0, len(self.data) - length - 1, count).astype(np.int64)
        return [self.data[s : s + length].decode("utf-8", errors="ignore") for s in starts]


# ---------------------------------------------------------------------------------- measurements


def generate(
    server: ServerProcess, model: str, prompt: str, new_tokens: int, timeout: float = 300
) -> pb.GenerateResponse:
    return server.stub.Generate(
        pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=new_tokens), timeout=timeout
    )


def servable(limit: int, prompt: str, new_tokens: int) -> bool:
    return not limit or len(prompt.encode()) + 1 + new_tokens <= limit


ITL_NEW_TOKENS = 16


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


def load_prompt_bytes(limit: int) -> int:
    return 200 if limit else 512


def measure_load(server: ServerProcess, model: str, prompts: list[str], users: int, budget: Budget) -> dict[str, float]:
    """Closed loop: `users` clients stream generations of `prompts` for `load_seconds`; /metrics
    sampled for peaks."""
    records: list[tuple[float, float, float, int]] = []  # latency, ttft, mean itl, tokens
    errors = refused = 0
    lock = threading.Lock()
    stop_at = time.monotonic() + budget.load_seconds
    peak = {"kv": 0.0}
    sampling = threading.Event()

    def sample_metrics() -> None:
        while not sampling.is_set():
            try:
                peak["kv"] = max(peak["kv"], server.metric("posenc_kv_cache_used_bytes", model=model))
            except Exception:  # a scrape racing the server is not a result
                pass
            time.sleep(0.05)

    def client(index: int) -> None:
        nonlocal errors, refused
        rng = random.Random(index)
        while time.monotonic() < stop_at:
            request = pb.GenerateRequest(
                model=model,
                prompt=rng.choice(prompts),
                max_new_tokens=budget.load_new_tokens,
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
    latencies = np.array([r[0] for r in records]) if records else np.zeros(1)
    good = sum(1 for r in records if r[1] <= TTFT_TARGET_S and r[2] <= ITL_TARGET_S)
    capacity = server.metric("posenc_kv_cache_capacity_bytes", model=model)
    return {
        "requests": len(records),
        "errors": errors,
        "refused": refused,
        "refused_per_s": refused / wall,
        "p50_s": float(np.percentile(latencies, 50)),
        "p95_s": float(np.percentile(latencies, 95)),
        "p99_s": float(np.percentile(latencies, 99)),
        "ttft_p50_s": float(np.median([r[1] for r in records])) if records else 0.0,
        "itl_p50_s": float(np.median([r[2] for r in records])) if records else 0.0,
        "requests_per_s": len(records) / wall,
        "tokens_per_s": sum(r[3] for r in records) / wall,
        "goodput_per_s": good / wall,
        "kv_peak_bytes": peak["kv"],
        "pool_utilisation": peak["kv"] / capacity if capacity else 0.0,
    }


def measure_load_series(
    args: argparse.Namespace, schemes: list[str], held_out: HeldOut, budget: Budget, results: Results,
    progress: tqdm,
) -> None:  # fmt: skip
    """The load series (`budget.concurrency` users, each level a round over every scheme on the same
    prompts), then memory at its end; then the series again against servers started with
    --ttft-slo-seconds (the same limits), so refusals and goodput can be set beside it."""
    admission = ("--ttft-slo-seconds", str(ADMISSION_TTFT_SLO_S))
    prompts: dict[int, list[str]] = {}
    for series, flags in (("load", ()), ("load, admission control", admission)):
        progress.set_postfix(part=series)
        loads: dict[str, dict[str, dict[str, float]]] = {s: {} for s in schemes}
        with serving(args, schemes, *flags) as servers:
            limits = served_limits(servers, results)
            for n in {load_prompt_bytes(limit) for limit in limits.values()} - set(prompts):
                prompts[n] = [held_out.text(n) for _ in range(64)]
            for turn, users in enumerate(budget.concurrency):
                for scheme in rotated(schemes, turn):
                    chosen = prompts[load_prompt_bytes(limits[scheme])]
                    loads[scheme][str(users)] = measure_load(servers[scheme], scheme, chosen, users, budget)
                    progress.update()
            if not flags:
                for scheme, server in servers.items():
                    results.memory[scheme] = {
                        "process_peak_bytes": server.memory_bytes("VmHWM"),  # front end + engine core
                        "kv_peak_bytes": max(v["kv_peak_bytes"] for v in loads[scheme].values()),
                        **per_step_extra_bytes(scheme),
                    }
        (results.load_admission if flags else results.load).update(loads)


@contextmanager
def serving(args: argparse.Namespace, schemes: list[str], *flags: str) -> Iterator[dict[str, ServerProcess]]:
    """One server per scheme (its peak memory is that scheme's alone), all started together and
    stopped together."""
    servers: dict[str, ServerProcess] = {}
    try:
        for scheme in schemes:
            servers[scheme] = ServerProcess(
                args.model_repository, "--models", scheme, *SERVER_LIMITS, *flags, threads=args.threads
            )
        for scheme, server in servers.items():
            server.wait_serving()
            generate(server, scheme, "def main():\n", 2)  # warm: a first call is not a measurement
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def model_info(server: ServerProcess, scheme: str, results: Results) -> pb.ModelInfo:
    """The served model's description, recorded in the results."""
    info = {m.name: m for m in server.stub.ListModels(pb.ListModelsRequest(), timeout=30).models}[scheme]
    results.models[scheme] = {
        "max_positions": info.max_positions or None, "kv_bytes_per_token": info.kv_cache_bytes_per_token,
        "kv_capacity_bytes": info.kv_cache_capacity_bytes, "train_context": info.train_context,
    }  # fmt: skip
    return info


def served_limits(servers: dict[str, ServerProcess], results: Results) -> dict[str, int]:
    """Each served scheme's position limit (0: none); its description goes into the results."""
    return {scheme: model_info(server, scheme, results).max_positions for scheme, server in servers.items()}


def measure_timed_sections(
    args: argparse.Namespace, schemes: list[str], sections: set[str], held_out: HeldOut, budget: Budget,
    results: Results, progress: tqdm,
) -> None:  # fmt: skip
    """Latency and load, in rounds that visit every scheme (in an order rotated each round) against
    servers started together, rather than one scheme after another: this VM's speed drifts by tens
    of percent over minutes (the reference run measured NoPE's first token at 2048 bytes in 697 ms
    at its end and a rerun 400 ms minutes later), and measured in sequence that drift lands between
    schemes, where it reads as what a positional scheme costs."""
    if "latency" in sections:
        progress.set_postfix(part="latency")
        with serving(args, schemes) as servers:
            measure_latency(servers, served_limits(servers, results), held_out, budget, results)
        progress.update(len(schemes))
    if "load" in sections:
        measure_load_series(args, schemes, held_out, budget, results, progress)


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


def measure_retrieval(
    server: ServerProcess, model: str, limit: int, train_context: int, held_out: HeldOut, budget: Budget
) -> dict[str, object]:
    """Every graded probe at every length the budget names (None where the model cannot take it)."""
    rng = random.Random(7)
    scorer = Scorer(server.stub, model, limit)
    trials, lead = budget.retrieval_trials, 64

    def length(multiple: float) -> int:
        return int(multiple * train_context)

    copy = {
        str(length(m)): scorer.accuracy([copy_text(held_out.text, rng, lead, length(m)) for _ in range(trials)])
        for m in budget.copy_distances
    }
    depth = {
        str(length(c)): {
            f"{d:g}": scorer.accuracy([depth_text(held_out.text, rng, length(c), d) for _ in range(trials)])
            for d in budget.retrieval_depths
        }
        for c in budget.depth_contexts
    }
    passkey = {
        str(length(c)): scorer.accuracy([passkey_text(held_out.text, rng, length(c)) for _ in range(trials)])
        for c in budget.passkey_contexts
    }
    window = length(budget.natural_context)
    natural = scorer.natural(held_out.windows(window, max(4, trials // 4)), window)
    return {"copy": copy, "copy_depth": depth, "passkey": passkey, "natural": natural}


# ---------------------------------------------------------------------------------- the run


def ensure_repository(repository: Path, schemes: list[str], budget: Budget) -> list[str]:
    """Export any missing model, including rope scaling variants; return the rope variant names.

    The variants are derived from the repository's rope graphs by rewriting their rotary constants
    (export/rope_variants.py): well under a second for all nine, where tracing took a minute each.
    """
    scalings = (
        [f"{kind}:{m:g}" for kind in ROPE_SCALINGS for m in budget.scaling_multiples] if "rope" in schemes else []
    )
    names = [rope_scaled_name(RopeScaling.parse(s)) for s in scalings]
    missing_schemes = [s for s in schemes if not (repository / s / MANIFEST).is_file()]
    missing_scalings = [s for s, n in zip(scalings, names, strict=True) if not (repository / n / MANIFEST).is_file()]
    if missing_schemes or missing_scalings:
        export_run(
            ExportOptions(
                out=repository,
                schemes=tuple(missing_schemes),
                rope_scaling=tuple(missing_scalings),
                verify=False,
                fp16=False,
            )
        )
    return names


def environment() -> dict[str, object]:
    import onnxruntime

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPOSITORY_ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain"], cwd=REPOSITORY_ROOT, capture_output=True, text=True
            ).stdout.strip()
        )
    except OSError:
        commit, dirty = "unknown", False
    memory = Path("/proc/meminfo").read_text().split("\n")[0] if Path("/proc/meminfo").exists() else ""
    return {
        "machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
        "memory": memory, "platform": platform.platform(), "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__, "torch": torch.__version__, "grpcio": grpc.__version__,
        "commit": commit + ("+dirty" if dirty else ""),
    }  # fmt: skip


SECTIONS = ("quality", "latency", "load", "retrieval", "cache")
TIMED_SECTIONS = ("latency", "load")  # measured in rounds over every scheme


def run(args: argparse.Namespace) -> Path:
    budget = Budget.tiny() if args.tiny else Budget.quick() if args.quick else Budget()
    if args.retrieval_trials:
        budget.retrieval_trials = args.retrieval_trials
    schemes = list(args.schemes)
    sections = set(args.sections)
    run_id = args.run_id or time.strftime("%Y%m%d-%H%M%S")
    out = args.out or REPOSITORY_ROOT / "reports" / run_id
    out.mkdir(parents=True, exist_ok=True)
    rope_variants = ensure_repository(args.model_repository, schemes, budget)
    measured = {"sections": sorted(sections), "environment": environment(), "budget": asdict(budget)}
    if sections == set(SECTIONS):
        results = Results(
            run_id, {"budget": asdict(budget), "threads": args.threads, "schemes": schemes,
                     "goodput_targets": {"ttft_s": TTFT_TARGET_S, "itl_s": ITL_TARGET_S},
                     "admission_ttft_slo_s": ADMISSION_TTFT_SLO_S},
            measured["environment"], schemes,
        )  # fmt: skip
    else:  # some sections again, into the run's existing results; which ones and when is recorded
        existing = out / "results.json"
        if not existing.is_file():
            raise SystemExit(f"--sections {' '.join(sorted(sections))}: {existing} has no earlier full run to update")
        results = Results(**json.loads(existing.read_text()))
    results.config.setdefault("runs", []).append(measured)  # type: ignore[union-attr]
    results.training = emergence.curves(WEIGHTS_DIR)
    held_out = HeldOut()
    untimed = [section for section in SECTIONS if section in sections and section not in TIMED_SECTIONS]
    steps = (
        len(schemes) * ("latency" in sections)
        + 2 * len(budget.concurrency) * len(schemes) * ("load" in sections)
        + len(schemes) * len(untimed)
        + len(rope_variants) * ("quality" in sections)
    )
    with tqdm(total=steps, desc="compare", unit="task") as progress:
        if sections & set(TIMED_SECTIONS):
            measure_timed_sections(args, schemes, sections, held_out, budget, results, progress)
        for scheme in schemes if untimed else []:
            # One server per scheme, with rope's scaling variants beside rope.
            server = ServerProcess(
                args.model_repository, "--models", scheme, *([v for v in rope_variants] if scheme == "rope" else []),
                *SERVER_LIMITS, threads=args.threads,
            )  # fmt: skip
            try:
                server.wait_serving()
                info = model_info(server, scheme, results)
                limit = info.max_positions
                if "quality" in sections:
                    progress.set_postfix(scheme=scheme, part="quality")
                    contexts = [int(m * info.train_context) for m in budget.context_multiples]
                    results.quality[scheme] = {
                        f"{m:g}": score_bpb(server, scheme, held_out.windows(c, budget.score_windows))
                        for m, c in zip(budget.context_multiples, contexts, strict=True)
                    }
                    if scheme == "rope":
                        for name in rope_variants:
                            factor = float(name.rsplit("-x", 1)[1])
                            length = int(factor * info.train_context)
                            results.quality[name] = {
                                f"{factor:g}": score_bpb(server, name, held_out.windows(length, budget.score_windows))
                            }
                            progress.update()
                    progress.update()
                if "retrieval" in sections:
                    progress.set_postfix(scheme=scheme, part="retrieval")
                    results.retrieval[scheme] = measure_retrieval(
                        server, scheme, limit, info.train_context, held_out, budget
                    )
                    progress.update()
                if "cache" in sections:
                    progress.set_postfix(scheme=scheme, part="cache budgets")
                    results.cache_budget[scheme] = measure_cache_budgets(
                        server, scheme, info, held_out.text, held_out.windows, budget.cache_plan()
                    )
                    progress.update()
            finally:
                server.stop()
    (out / "results.json").write_text(json.dumps(asdict(results), indent=2) + "\n")
    from loadtest.report import write_report

    write_report(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.compare", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--model-repository", type=Path, default=REPOSITORY_ROOT / "model_repository",
        help="model repository to serve from; missing schemes and rope scaling variants are exported into it",
    )  # fmt: skip
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES), help="schemes to compare")
    parser.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores (smaller every count)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help="threads per ONNX Runtime session (0: half the cores)")
    parser.add_argument(
        "--retrieval-trials", type=int, default=0,
        help="trials per retrieval cell (0: the budget's, 48 in a full run and 8 with --quick)",
    )  # fmt: skip
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
        help=f"what to measure, from {' '.join(SECTIONS)}; fewer than all updates those parts of the run's "
        "existing results.json (which sections ran, when and at which commit is recorded there)",
    )  # fmt: skip
    parser.add_argument("--run-id", default=None, help="names the report folder (default: the start time)")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default reports/<run-id>)")
    args = parser.parse_args(argv)
    out = run(args)
    print(f"\nreport: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
