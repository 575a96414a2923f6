"""The tenants section (`python -m loadtest.compare --sections tenants`): a noisy tenant beside a
quiet one on one `rope` server without a prefix cache, first come first served against fair
scheduling (deficit round robin over tokens, service/engine/sched/fair.py).

The noisy tenant holds `tenants_noisy_users` closed-loop streams (each sends its next request when
the last ends), the quiet one `tenants_quiet_users`, each pausing `tenants_quiet_think_s` on average
between its requests (a quiet tenant asks for little: closed-loop, its 4 streams asked for as much
as the noisy tenant's 48); every request is a held-out prompt and a fixed number of new tokens. The
servers hold a row for every stream (`tenants_max_batch_size`), so the study measures how prompts
are scheduled, not the wait for a row of a full batch. Each round measures each tenant alone, then
both together under each policy (the order alternating round by round, one server per policy,
started once): each tenant's TTFT p50/p99, tokens a second and goodput (requests a second within
the timed sections' TTFT and ITL targets). The acceptance the issue set: beside the noisy tenant
the quiet one's TTFT p50 is at most 3x its solo value, and the noisy one keeps at least 0.9 of its
solo tokens a second.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from loadtest.streaming import StreamTiming, timed_stream
from loadtest.study.budget import Budget
from loadtest.study.held_out import HeldOut
from loadtest.study.results import Results
from loadtest.study.timed import ITL_TARGET_S, TTFT_TARGET_S
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.channel import open_channel
from service.process import ServerProcess

SECTIONS = ("tenants",)
MODEL = "rope"
POLICIES = ("fcfs", "fair")
TENANTS = {"noisy": "noisy-token", "quiet": "quiet-token"}
QUIET_TTFT_GOAL = 3.0  # beside the noisy tenant, at most this multiple of its solo TTFT p50
NOISY_THROUGHPUT_GOAL = 0.9  # and the noisy tenant keeps at least this share of its solo tokens a second
KEYS = ("ttft_p50_s", "ttft_p99_s", "tokens_per_s", "goodput_per_s", "requests")


def run_tenants(target: str, users: dict[str, int], prompts: list[str], budget: Budget) -> dict[str, dict[str, Any]]:
    """Every tenant's streams for `tenants_seconds`; each tenant's figures. A noisy stream sends its
    next request when the last ends; a quiet one first pauses (exponential, mean
    `tenants_quiet_think_s`), as a person or an agent does between calls."""
    stop = time.monotonic() + budget.tenants_seconds
    think = {"noisy": 0.0, "quiet": budget.tenants_quiet_think_s}
    timings: dict[str, list[StreamTiming]] = {tenant: [] for tenant in users}
    lock = threading.Lock()

    def stream(tenant: str, index: int) -> None:
        rng = random.Random(index)
        metadata = (("authorization", f"Bearer {TENANTS[tenant]}"),)
        with open_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            call = _Authorized(stub, metadata)
            while time.monotonic() < stop:
                request = pb.GenerateRequest(model=MODEL, prompt=rng.choice(prompts),
                                             max_new_tokens=budget.tenants_new_tokens, ignore_eos=True)  # fmt: skip
                timing = timed_stream(call, request, 120)  # type: ignore[arg-type]
                with lock:
                    timings[tenant].append(timing)
                if think[tenant]:
                    time.sleep(max(0.0, min(rng.expovariate(1 / think[tenant]), stop - time.monotonic())))

    started = time.monotonic()
    threads = [
        threading.Thread(target=stream, args=(tenant, index), daemon=True)
        for tenant, count in users.items()
        for index in range(count)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started
    return {tenant: figures(found, wall) for tenant, found in timings.items()}


class _Authorized:
    """A stub whose GenerateStream carries the tenant's token (and what timed_stream adds)."""

    def __init__(self, stub: generation_pb2_grpc.GenerationStub, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub, self._metadata = stub, metadata

    def GenerateStream(self, request: pb.GenerateRequest, timeout: float, metadata: Any = ()) -> Any:
        return self._stub.GenerateStream(request, timeout=timeout, metadata=(*self._metadata, *(metadata or ())))


def figures(timings: list[StreamTiming], wall: float) -> dict[str, Any]:
    done = [t for t in timings if t.error is None]
    ttfts = np.array([t.time_to_first_token or 0.0 for t in done]) if done else np.zeros(1)
    good = sum(1 for t in done if within_targets(t))
    return {
        "requests": len(done),
        "errors": len(timings) - len(done),
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "tokens_per_s": sum(t.completion_tokens for t in done) / wall,
        "goodput_per_s": good / wall,
    }


def within_targets(timing: StreamTiming) -> bool:
    return (timing.time_to_first_token or 0.0) <= TTFT_TARGET_S and (timing.mean_inter_token or 0.0) <= ITL_TARGET_S


def medians(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Each tenant's figures over the rounds: medians."""
    return {
        tenant: {key: float(statistics.median(r[tenant][key] for r in rounds)) for key in KEYS} for tenant in rounds[0]
    }


def ratios(solo: dict[str, dict[str, float]], together: dict[str, dict[str, float]]) -> dict[str, float]:
    """The acceptance's two figures: the quiet tenant's TTFT p50 over its solo one, the noisy tenant's
    tokens a second over its solo ones; and what explains the second: both tenants' tokens a second
    over the noisy one's solo (what the policy keeps of the server's capacity) and the quiet tenant's
    share of them (what its closed loop takes when its requests are served promptly)."""
    quiet, noisy = solo["quiet"]["ttft_p50_s"], solo["noisy"]["tokens_per_s"]
    total = together["noisy"]["tokens_per_s"] + together["quiet"]["tokens_per_s"]
    return {
        "quiet_ttft_vs_solo": together["quiet"]["ttft_p50_s"] / quiet if quiet else float("nan"),
        "noisy_throughput_vs_solo": together["noisy"]["tokens_per_s"] / noisy if noisy else float("nan"),
        "server_throughput_vs_solo": total / noisy if noisy else float("nan"),
        "quiet_share": together["quiet"]["tokens_per_s"] / total if total else float("nan"),
    }


def paired(solo: list[dict[str, dict[str, Any]]], together: list[dict[str, dict[str, Any]]]) -> dict[str, float]:
    """`ratios` of each round against the same round's solo figures, their median over the rounds:
    the noisy tenant's solo tokens a second moved by 10% from one 10 s measurement to the next."""
    per_round = [ratios(alone, both) for alone, both in zip(solo, together, strict=True)]
    return {key: float(statistics.median(r[key] for r in per_round)) for key in per_round[0]}


def start_servers(repository: Path, threads: int, tokens: Path, max_batch_size: int) -> dict[str, ServerProcess]:
    tokens.write_text("".join(f"{tenant}:{token}\n" for tenant, token in TENANTS.items()))
    flags = ("--models", MODEL, "--no-prefix-cache", "--auth-tokens-file", str(tokens),
             "--max-batch-size", str(max_batch_size))  # fmt: skip
    started = {
        policy: ServerProcess(repository, *flags, "--scheduling", policy, threads=threads) for policy in POLICIES
    }
    return {policy: server.wait_serving() for policy, server in started.items()}


def measure_tenants(
    repository: Path, threads: int, held_out: HeldOut, budget: Budget, results: Results, progress: tqdm
) -> None:
    """Fills results.tenants: "solo", "fcfs" and "fair" (each tenant's medians, the acceptance's
    ratios and the rounds), and the setup."""
    prompts = held_out.again().windows(budget.tenants_prompt_bytes, 64)
    users = {"noisy": budget.tenants_noisy_users, "quiet": budget.tenants_quiet_users}
    folder = tempfile.TemporaryDirectory(prefix="posenc-tenants-")  # the token file stays out of the report
    servers = start_servers(repository, threads, Path(folder.name) / "tokens", budget.tenants_max_batch_size)
    rounds: dict[str, list[dict[str, dict[str, Any]]]] = {"solo": [], **{policy: [] for policy in POLICIES}}
    try:
        for round_index in range(budget.load_rounds):
            alone = {t: run_tenants(servers["fair"].target, {t: n}, prompts, budget)[t] for t, n in users.items()}
            rounds["solo"].append(alone)
            progress.update(1)
            for policy in POLICIES if round_index % 2 == 0 else POLICIES[::-1]:
                rounds[policy].append(run_tenants(servers[policy].target, users, prompts, budget))
                progress.update(1)
    finally:
        for server in servers.values():
            server.stop()
        folder.cleanup()
    solo = medians(rounds["solo"])
    results.tenants = {
        "solo": {**solo, "rounds": rounds["solo"]},
        **{p: {**medians(rounds[p]), **paired(rounds["solo"], rounds[p]), "rounds": rounds[p]} for p in POLICIES},
        "setup": {"model": MODEL, "prefix_cache": False, "users": users,
                  "quiet_think_s": budget.tenants_quiet_think_s, "max_batch_size": budget.tenants_max_batch_size,
                  "seconds": budget.tenants_seconds,
                  "prompt_bytes": budget.tenants_prompt_bytes, "new_tokens": budget.tenants_new_tokens,
                  "rounds": budget.load_rounds, "quiet_ttft_goal": QUIET_TTFT_GOAL,
                  "noisy_throughput_goal": NOISY_THROUGHPUT_GOAL},
    }  # fmt: skip
