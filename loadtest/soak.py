"""Soak / stress run (a script, not a test): `python -m loadtest.soak --minutes 10`.

Starts the service, runs Locust headless at high concurrency with random client cancellations,
and reports requests served, errors by code, p99 latencies, and the server's resident memory (its
front end and engine core processes together) at start and end (the growth is the figure to watch).
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from contract.cli import HelpFormatter
from contract.paths import REPOSITORY_ROOT
from service.process import ServerProcess, wait_for


def settle(server: ServerProcess, timeout: float = 30.0) -> None:
    """Wait until no sequence runs or waits on any model (the load generator has stopped and the
    server has finished or cancelled what was in flight), so memory is measured at rest."""
    gauges = ("posenc_running_sequences", "posenc_queued_sequences", "posenc_kv_cache_used_bytes")
    wait_for(lambda: not any(server.metric(name) for name in gauges), timeout=timeout, interval=0.5)
    time.sleep(2.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--model-repository", type=Path, default=REPOSITORY_ROOT / "model_repository",
        help="model repository to serve (written by python -m export)",
    )  # fmt: skip
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the measured run")
    parser.add_argument("--users", type=int, default=64, help="concurrent Locust users")
    parser.add_argument("--cancel-fraction", type=float, default=0.2, help="share of streams the client cancels")
    parser.add_argument(
        "--models", default="alibi:1,rope:1,relative:1,none:1,sinusoidal:1,learned:1", help="Locust model mix"
    )
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per request")
    parser.add_argument(
        "--warmup-seconds", type=int, default=60, help="load before the start figure (arenas at their peak shapes)"
    )
    return parser.parse_args(argv)


def locust_command(args: argparse.Namespace, target: str, seconds: int, *extra: str) -> list[str]:
    """Headless Locust at the soak's load for `seconds`: the warm-up and the measured run differ only in length
    and in `extra` flags."""
    return [
        sys.executable, "-m", "locust", "-f", str(REPOSITORY_ROOT / "loadtest/locustfile.py"), "--headless",
        "-u", str(args.users), "-r", str(args.users), "-t", f"{seconds}s", "--host", target,
        "--models", args.models, "--max-new-tokens", str(args.max_new_tokens), "--prompt-bytes", "uniform:16:200",
        "--cancel-fraction", str(args.cancel_fraction), *extra, "--only-summary",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = ServerProcess(args.model_repository, "--max-queue", "1024", threads=0).wait_serving()
    out = Path(tempfile.mkdtemp(prefix="posenc-soak-"))
    try:
        # Warm up at the soak's own load, so the start figure already holds what steady state
        # needs (loaded sessions, ONNX Runtime's arenas at the peak batch shapes); growth from
        # there is what leaks.
        warmup = locust_command(args, server.target, args.warmup_seconds)
        subprocess.run(warmup, cwd=REPOSITORY_ROOT, capture_output=True, check=True)
        settle(server)
        start_rss = server.memory_bytes()
        started = time.monotonic()
        samples: list[tuple[float, int]] = []
        sampling = threading.Event()

        def sample_memory() -> None:
            while not sampling.wait(args.minutes * 60 / 20):
                samples.append((time.monotonic() - started, server.memory_bytes()))

        sampler = threading.Thread(target=sample_memory, daemon=True)
        sampler.start()
        measured = locust_command(args, server.target, int(args.minutes * 60), "--csv", str(out / "soak"))
        result = subprocess.run(measured, cwd=REPOSITORY_ROOT, capture_output=True, text=True)
        elapsed = time.monotonic() - started
        sampling.set()
        settle(server)
        end_rss = server.memory_bytes()
        print(
            f"soak: {elapsed / 60:.1f} min, {args.users} users, cancel fraction {args.cancel_fraction}, "
            f"locust exit {result.returncode}"
        )
        print_requests(out)
        print_memory(start_rss, end_rss, samples)
        print_cache_left(server, args.models)
    finally:
        server.stop()
    return 0


def print_requests(out: Path) -> None:
    """Locust's counts and percentiles per entry, token latencies apart, and its failures by gRPC code."""
    rows = list(csv.DictReader((out / "soak_stats.csv").open()))
    failures = list(csv.DictReader((out / "soak_failures.csv").open()))
    codes: Counter[str] = Counter()
    for failure in failures:
        match = re.search(r"StatusCode\.([A-Z_]+)", failure["Error"])
        codes[match.group(1) if match else failure["Error"][:60]] += int(failure["Occurrences"])
    print(f"{'entry':<28}{'requests':>10}{'failures':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for row in rows:
        print(f"{row['Name']:<28}{row['Request Count']:>10}{row['Failure Count']:>10}{row['50%']:>10}{row['99%']:>10}")
    for row in csv.DictReader((out / "soak_token_latency.csv").open()):  # TTFT and ITL, apart from the RPCs
        name, p50, p99 = f"{row['Type']} {row['Name']}", row["50% (ms)"], row["99% (ms)"]
        print(f"{name:<28}{row['Count']:>10}{'':>10}{p50:>10}{p99:>10}")
    print(f"errors by code: {dict(codes) or 'none'}")


def print_memory(start_rss: int, end_rss: int, samples: list[tuple[float, int]]) -> None:
    """Resident memory at rest before and after, and under load: growth between halves is what leaks."""
    growth = (end_rss - start_rss) / start_rss * 100 if start_rss else float("nan")
    print(f"server resident memory: start {start_rss / 1e6:.0f} MB, end {end_rss / 1e6:.0f} MB ({growth:+.1f}%)")
    print("  under load (s: MB): " + ", ".join(f"{t:.0f}: {rss / 1e6:.0f}" for t, rss in samples))
    if len(samples) >= 4:
        half = len(samples) // 2
        first, second = (statistics.median(r for _, r in part) for part in (samples[:half], samples[half:]))
        print(
            f"  median under load: first half {first / 1e6:.0f} MB, second half {second / 1e6:.0f} MB "
            f"({(second - first) / first * 100:+.1f}%)"
        )


def print_cache_left(server: ServerProcess, models: str) -> None:
    """KV bytes still held by each model under load once the server is at rest (a leak if not 0)."""
    for model in (spec.partition(":")[0] for spec in models.split(",")):
        try:
            used = server.metric("posenc_kv_cache_used_bytes", model=model)
            print(f"kv cache used at end ({model}): {used:.0f} bytes")
        except KeyError:
            pass


if __name__ == "__main__":
    raise SystemExit(main())
