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
loadtest/study/cache_budget.py), a noisy tenant beside a quiet one under first come first served
and fair scheduling (loadtest/study/tenants.py), and KV reuse (a shared prefix with and without the prefix cache;
documents in varying order as reusable segments, as is, re-rotated and repaired; loadtest/study/reuse.py).
The scored sections and speculation's acceptance run on every training seed of a scheme the weights
hold (models/weights/seed<N>/<scheme>, served as `<scheme>@seed<N>`); the served models are seed 1234's.
Writes reports/<run-id>/.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import cast

import grpc
import torch
from tqdm import tqdm

from contract.cli import HelpFormatter
from contract.paths import REPOSITORY_ROOT
from loadtest import speculative
from loadtest.evaluation import evaluate
from loadtest.study import reuse, routing, scored, tenants, timed
from loadtest.study.budget import Budget
from loadtest.study.held_out import HeldOut
from loadtest.study.results import Environment, Results, RunConfig, RunRecord, TrainingCurve
from loadtest.study.serving import Repository, ensure_repository
from models import emergence
from models.checkpoints import WEIGHTS_DIR, trained_schemes
from models.positional import SCHEMES

SECTIONS = ("quality", "latency", "load", "retrieval", "cache", "reuse", "speculative", "routing", "tenants")
assert set(SECTIONS) == (
    set(timed.SECTIONS)
    | set(scored.SECTIONS)
    | set(reuse.SECTIONS)
    | set(speculative.SECTIONS)
    | set(routing.SECTIONS)
    | set(tenants.SECTIONS)
)
# The sections run on every training seed of a scheme (`--seeds-only`: on the further ones only).
SEEDED = frozenset(("quality", "retrieval", "cache", "reuse", "speculative"))
# Where each seeded section keeps its figures in the results (by model name).
SEEDED_FIGURES = {"quality": "quality", "retrieval": "retrieval", "cache": "cache_budget", "reuse": "reuse",
                  "speculative": "speculative"}  # fmt: skip
# Run only when named: lm-evaluation-harness from its own virtual environment (made on first use).
OPT_IN = ("evaluation",)
# What --quick leaves out unless named (issues 64 and 61: README command 1 within ten minutes with nine
# schemes): the cache budgets, most of a minute a scheme here, and two deployment questions rather
# than positional ones: routing, one model behind HAProxy (a system package a first run may lack), and
# tenants, two tenants sharing rope (about two minutes: command 1 took 11 min 35 s with it, mla joined).
# Then, on a 2-core machine 1.3-2x slower than the one those figures came from (command 1 took 12 min 55 s),
# reuse and speculation too (122 s and 62 s of that run): features served over every scheme, whose
# verdicts the reference report holds on three seeds.
QUICK_LEAVES_OUT = ("cache", "routing", "tenants", "reuse", "speculative")


def environment() -> Environment:
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


def start_results(
    out: Path, run_id: str, sections: set[str], run: RunRecord, threads: int, schemes: list[str],
    whole: frozenset[str] = frozenset(SECTIONS),
) -> Results:  # fmt: skip
    """A full run's new results (every section of `whole`: --quick's are fewer); fewer sections update
    the run's existing ones (which sections ran, and when, is recorded in them)."""
    if sections >= whole:
        config: RunConfig = {
            "budget": run["budget"], "threads": threads, "schemes": schemes,
            "goodput_targets": {"ttft_s": timed.TTFT_TARGET_S, "itl_s": timed.ITL_TARGET_S},
            "admission_ttft_slo_s": timed.ADMISSION_TTFT_SLO_S,
        }  # fmt: skip
        results = Results(run_id, config, run["environment"], schemes)
    else:
        existing = out / "results.json"
        if not existing.is_file():
            raise SystemExit(f"--sections {' '.join(sorted(sections))}: {existing} has no earlier full run to update")
        results = Results.read(existing)
        # A scheme new to the run (a hybrid added to an earlier reference) joins the end of its list.
        results.schemes += [scheme for scheme in schemes if scheme not in results.schemes]
    results.config.setdefault("runs", []).append(run)
    return results


def unscored(served: Repository, results: Results, sections: set[str]) -> Repository:
    """`--seeds-only`: each scheme's further seeds that one of `sections` of the results does not hold
    yet (a seed already scored in all of them is left as it is)."""

    def held(model: str) -> bool:
        return all(model in getattr(results, SEEDED_FIGURES[section]) for section in sections)

    models = {scheme: [scheme, *(m for m in names[1:] if not held(m))] for scheme, names in served.models.items()}
    return replace(served, models=models)


@contextmanager
def timer(seconds: dict[str, float], sections: set[str]) -> Iterator[None]:
    """Records how long the sections measured together took (as "latency+load"), for the run's record."""
    started = time.perf_counter()
    yield
    seconds["+".join(s for s in SECTIONS + OPT_IN if s in sections)] = round(time.perf_counter() - started, 1)


def run(args: argparse.Namespace) -> Path:
    budget = Budget.tiny() if args.tiny else Budget.quick() if args.quick else Budget()
    if args.retrieval_trials:
        budget.retrieval_trials = args.retrieval_trials
    schemes = list(args.schemes)
    whole = frozenset(s for s in SECTIONS if not (args.quick and s in QUICK_LEAVES_OUT))
    sections = set(args.sections or whole)
    if "routing" in sections and shutil.which("haproxy") is None:
        raise SystemExit("the routing section needs haproxy (apt-get install haproxy), or leave it out: --sections")
    run_id = args.run_id or time.strftime("%Y%m%d-%H%M%S")
    out = args.out or REPOSITORY_ROOT / "reports" / run_id
    out.mkdir(parents=True, exist_ok=True)
    repository, threads = args.model_repository, args.threads
    if args.extra_seeds is not None:
        budget.extra_seeds = args.extra_seeds
    if args.seeds_only:
        if not budget.extra_seeds or sections - SEEDED:
            raise SystemExit(f"--seeds-only scores further training seeds in {' '.join(SEEDED)} only, "
                             f"with --extra-seeds; asked for {' '.join(sorted(sections))}")  # fmt: skip
        budget.seeds_only = True
    served = ensure_repository(repository, schemes, budget.scaling_multiples, budget.extra_seeds, args.weights)
    record: RunRecord = {"sections": sorted(sections), "environment": environment(), "budget": asdict(budget),
                         "schemes": schemes}  # fmt: skip
    results = start_results(out, run_id, sections, record, threads, schemes, whole)
    results.add_seeds(served.seeds)
    if budget.seeds_only:
        served = unscored(served, results, sections)
    # models/emergence.py reads the training logs as plain JSON objects of this shape.
    results.training = cast(dict[str, TrainingCurve], emergence.curves(WEIGHTS_DIR))
    held_out = HeldOut()
    untimed = [section for section in SECTIONS if section in sections and section in scored.SECTIONS]
    # Every training seed of every scheme (with --seeds-only, the further ones).
    models = sum(len(served.models[scheme]) - budget.seeds_only for scheme in schemes)
    steps = (
        len(schemes) * ("latency" in sections)
        + (2 * budget.load_rounds * len(budget.concurrency) + budget.budget_load) * len(schemes) * ("load" in sections)
        + models * len(untimed)
        + len(served.rope_variants) * ("quality" in sections and not budget.seeds_only)
        + (2 * len(schemes) * (not budget.seeds_only) + models) * ("reuse" in sections)
        + models * ("speculative" in sections)
        + (2 * budget.load_rounds + 1) * ("routing" in sections)
        + 3 * budget.load_rounds * ("tenants" in sections)
        + len(schemes) * ("evaluation" in sections)
    )
    seconds: dict[str, float] = {}
    with tqdm(total=steps, desc="compare", unit="task") as progress:
        if sections & set(timed.SECTIONS):
            with timer(seconds, sections & set(timed.SECTIONS)):
                timed.measure_timed_sections(repository, threads, schemes, sections, held_out, budget, results,
                                             progress)  # fmt: skip
        if untimed:
            with timer(seconds, set(untimed)):
                scored.measure_scored_sections(repository, threads, schemes, sections, served, held_out, budget,
                                               results, progress)  # fmt: skip
        if "reuse" in sections:
            with timer(seconds, {"reuse"}):
                reuse.measure_reuse(repository, threads, served.models, held_out, budget, results, progress)
        if "speculative" in sections:
            seeded = [m for s in schemes for m in (served.extra(s) if budget.seeds_only else served.models[s])]
            with timer(seconds, {"speculative"}):
                speculative.measure_speculative(repository, threads, seeded, held_out.data, budget, results,
                                                progress)  # fmt: skip
        if "routing" in sections:
            with timer(seconds, {"routing"}):
                routing.measure_routing(repository, threads, held_out, budget, results, progress, out)
        if "tenants" in sections:
            with timer(seconds, {"tenants"}):
                tenants.measure_tenants(repository, threads, held_out, budget, results, progress)
        if "evaluation" in sections:
            with timer(seconds, {"evaluation"}):
                results.evaluation = evaluate(repository, schemes, budget.score_windows, budget.evaluation_choices,
                                              threads=threads)  # fmt: skip
            progress.update(len(schemes))
    record["seconds"] = seconds
    print("seconds per section: " + ", ".join(f"{name} {value:.0f}" for name, value in seconds.items()))
    results.write(out / "results.json")
    from loadtest.report.document import write_report  # matplotlib, only once there is something to draw

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
    parser.add_argument(
        "--weights", type=Path, default=WEIGHTS_DIR,
        help="weights folder (models/weights' layout) that missing models and further seeds are exported from",
    )  # fmt: skip
    parser.add_argument(
        "--schemes", nargs="+", choices=SCHEMES, default=list(trained_schemes()),
        help="schemes to compare (default: every one with shipped weights)",
    )  # fmt: skip
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a first look in minutes: fewer lengths and trials, the served seeds only, and neither the cache "
        "budgets nor routing unless --sections names them",
    )
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help="threads per ONNX Runtime session (0: half the cores)")
    parser.add_argument(
        "--retrieval-trials", type=int, default=0,
        help=f"trials per retrieval cell (0: the budget's, {Budget().retrieval_trials} in a full run and "
        f"{Budget.quick().retrieval_trials} with --quick)",
    )  # fmt: skip
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS + OPT_IN, default=None, metavar="SECTION",
        help=f"what to measure, from {' '.join(SECTIONS)} (all by default; --quick leaves out "
        f"{' '.join(QUICK_LEAVES_OUT)}) and {' '.join(OPT_IN)} (only when "
        "named: lm-evaluation-harness against the service, python -m loadtest.evaluation); fewer than all "
        "updates those parts of the run's "
        "existing results.json (which sections ran, when and at which commit is recorded there)",
    )  # fmt: skip
    parser.add_argument(
        "--extra-seeds", action=argparse.BooleanOptionalAction, default=None,
        help="score every further training seed of each scheme (models/weights/seed<N>/<scheme>, exported as "
        "<scheme>@seed<N>) in the quality, retrieval, cache, reuse and speculative sections; default: yes, "
        "except with --quick",
    )  # fmt: skip
    parser.add_argument(
        "--seeds-only", action="store_true",
        help="score only the further training seeds the results do not hold yet (the served models' figures "
        "stay): a seed trained after the run was measured joins it without measuring the rest again",
    )  # fmt: skip
    parser.add_argument("--run-id", default=None, help="names the report folder (default: the start time)")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default reports/<run-id>)")
    args = parser.parse_args(argv)
    out = run(args)
    print(f"\nreport: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
