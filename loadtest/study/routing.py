"""The routing section (`python -m loadtest.compare --sections routing`): two replicas with small
caches behind HAProxy (deploy/haproxy/haproxy.cfg), round robin against prefix affinity.

The workload: prefixes of held-out text whose K/V together hold about twice what one replica's prefix
cache can keep beside its running sequences, each used by several requests with different tails, in
a random order, from a few concurrent users streaming through the proxy with the routing key the
Python client sends (a hash of the prompt's first 256 bytes). Round robin shows every prefix to both
replicas, whose caches then churn; affinity shows each prefix to one. Each mode is measured over
rounds, alternating, every round on prefixes never sent before (no cache carries over): the prefix hit
rate (cached prompt tokens over prompt tokens), TTFT p50/p99 and goodput (requests/s within the
timed sections' TTFT and ITL targets). Last, one replica is killed (SIGKILL) mid-run under affinity:
requests it had not started answering are retried (by the proxy, or by the client's retry policy
where the proxy refused the stream), and streams it was sending end with an error, each counted.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from contract.manifest import MANIFEST
from loadtest.haproxy import HAProxy, Replica
from loadtest.streaming import StreamTiming, timed_stream
from loadtest.study.budget import Budget
from loadtest.study.held_out import HeldOut
from loadtest.study.results import Results
from loadtest.study.timed import ITL_TARGET_S, TTFT_TARGET_S
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.channel import open_channel
from service.engine.kv import KVLayout, KVStore
from service.process import ServerProcess
from service.routing import PREFIX_BYTES

SECTIONS = ("routing",)
MODEL = "alibi"  # no position limit: any prefix length fits
MODES = ("round_robin", "affinity")
BLOCK = 16
TAIL_BYTES = 12
NEW_TOKENS = 8


@dataclass(frozen=True)
class Workload:
    prefixes: list[str]
    requests: list[str]  # prompts, in the order they are sent

    @classmethod
    def draw(cls, data: bytes, rng: random.Random, budget: Budget) -> Workload:
        """`routing_prefixes` prefixes of held-out text, each followed by `routing_uses` different tails.
        With BOS a prefix ends on a block boundary and a tail is shorter than a block, so the prefix
        cache keeps whole prefixes and never a block of a tail (which no later prompt could hit)."""

        def text(length: int) -> str:
            start = rng.randrange(len(data) - 2 * length)
            return data[start : start + 2 * length].decode("ascii", "ignore")[:length].ljust(length)

        assert budget.routing_prefix_bytes % BLOCK == 0 and TAIL_BYTES < BLOCK
        assert budget.routing_prefix_bytes > PREFIX_BYTES, "the routing key must not reach into the tails"
        body = budget.routing_prefix_bytes - 8  # BOS and "# NNNN\n" make up the rest
        prefixes = [f"# {index:04d}\n" + text(body) for index in range(budget.routing_prefixes)]
        requests = [prefix + text(TAIL_BYTES) for prefix in prefixes for _ in range(budget.routing_uses)]
        rng.shuffle(requests)
        return cls(prefixes, requests)


def replica_flags(repository: Path, budget: Budget) -> list[str]:
    """A replica whose prefix cache keeps half the workload's prefixes beside its running sequences."""
    manifest = json.loads((repository / MODEL / MANIFEST).read_text())
    layout = KVLayout(manifest["n_layers"], manifest["n_heads"], manifest["head_dim"], "float32")
    prefix_tokens = budget.routing_prefix_bytes  # BOS and the prefix's bytes
    sequence = -(-(prefix_tokens + TAIL_BYTES + NEW_TOKENS + 8) // BLOCK) * BLOCK
    kept = budget.routing_prefixes // 2 * prefix_tokens
    rows = budget.routing_users // 2  # one replica's share of the running sequences
    wanted = layout.token_bytes * (kept + rows * sequence)
    kv_bytes = max(wanted, KVStore.minimum_budget(layout, sequence, BLOCK))
    return ["--models", MODEL, "--kv-cache-bytes", str(kv_bytes), "--max-sequence-tokens", str(sequence),
            "--max-new-tokens-limit", str(NEW_TOKENS)]  # fmt: skip


def run_workload(target: str, workload: Workload, users: int, kill: ServerProcess | None = None) -> dict[str, Any]:
    """Every request of the workload streamed through the proxy by `users` clients; `kill`: SIGKILL
    that replica once a third of the requests are sent."""
    pending = list(reversed(workload.requests))
    lock = threading.Lock()
    timings: list[StreamTiming] = []
    killed = threading.Event()

    def client(_: int) -> None:
        # The retry channel every client should use: a stream the proxy refused (REFUSED_STREAM, as
        # UNAVAILABLE) when its replica died under it is sent again.
        with open_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while True:
                with lock:
                    if not pending:
                        return
                    prompt = pending.pop()
                    if kill is not None and not killed.is_set() and len(pending) < len(workload.requests) * 2 // 3:
                        killed.set()
                        kill_all(kill)
                request = pb.GenerateRequest(model=MODEL, prompt=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
                timing = timed_stream(stub, request, 120)
                with lock:
                    timings.append(timing)

    started = time.monotonic()
    with ThreadPoolExecutor(users) as pool:
        list(pool.map(client, range(users)))
    return figures(timings, time.monotonic() - started)


def kill_all(replica: ServerProcess) -> None:
    """SIGKILL the replica's processes, front end and engine core, as a crashed pod's (a core left
    alive holds the front end's listening sockets: connections are accepted and never answered)."""
    for pid in replica.pids():
        os.kill(pid, signal.SIGKILL)


def figures(timings: list[StreamTiming], wall: float) -> dict[str, Any]:
    done = [t for t in timings if t.error is None]
    failed = [t for t in timings if t.error is not None]
    ttfts = np.array([t.time_to_first_token or 0.0 for t in done]) if done else np.zeros(1)
    good = sum(1 for t in done if within_targets(t))
    return {
        "requests": len(done),
        # Failed before their first chunk (the proxy should have retried them) and cut after it.
        "failed_before_start": sum(1 for t in failed if t.time_to_first_token is None),
        "cut_streams": sum(1 for t in failed if t.time_to_first_token is not None),
        "errors": sorted({f"{t.error.code().name}: {t.error.details()}" for t in failed}),  # type: ignore[union-attr]
        "prefix_hit_rate": sum(t.cached_prompt_tokens for t in done) / max(1, sum(t.prompt_tokens for t in done)),
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "goodput_per_s": good / wall,
        "wall_s": wall,
    }


def within_targets(timing: StreamTiming) -> bool:
    """Good in the load sections' sense: its first token and its tokens after within their targets."""
    return (timing.time_to_first_token or 0.0) <= TTFT_TARGET_S and (timing.mean_inter_token or 0.0) <= ITL_TARGET_S


def medians(rounds: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("prefix_hit_rate", "ttft_p50_s", "ttft_p99_s", "goodput_per_s")
    return {key: statistics.median(r[key] for r in rounds) for key in keys}


def start_replicas(repository: Path, threads: int, flags: list[str]) -> list[ServerProcess]:
    started = [ServerProcess(repository, *flags, threads=threads) for _ in range(2)]
    return [replica.wait_serving() for replica in started]


def measure_routing(
    repository: Path, threads: int, held_out: HeldOut, budget: Budget, results: Results, progress: tqdm, out: Path
) -> None:
    """Fills results.routing: each mode's medians and rounds, the kill run, and the setup."""
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        raise SystemExit("the routing section needs haproxy (apt-get install haproxy)")
    rng = random.Random(54)
    flags = replica_flags(repository, budget)
    replicas = start_replicas(repository, threads, flags)
    addresses = [Replica(r.target, r.http_url.removeprefix("http://")) for r in replicas]
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        proxies = {mode: HAProxy(haproxy, out / "haproxy" / mode, addresses, mode) for mode in MODES}
        time.sleep(1.5)  # the first health checks
        for round_index in range(budget.load_rounds):
            order = MODES if round_index % 2 == 0 else MODES[::-1]
            for mode in order:
                workload = Workload.draw(held_out.data, rng, budget)
                rounds[mode].append(run_workload(proxies[mode].target, workload, budget.routing_users))
                progress.update(1)
        kill = run_workload(proxies["affinity"].target, Workload.draw(held_out.data, rng, budget),
                            budget.routing_users, kill=replicas[1])  # fmt: skip
        progress.update(1)
        for proxy in proxies.values():
            proxy.stop()
    finally:
        for replica in replicas:
            replica.stop()
    setup = {
        "replicas": 2, "model": MODEL, "flags": flags, "prefixes": budget.routing_prefixes,
        "uses": budget.routing_uses, "prefix_bytes": budget.routing_prefix_bytes, "tail_bytes": TAIL_BYTES,
        "new_tokens": NEW_TOKENS, "users": budget.routing_users,
    }  # fmt: skip
    results.routing = {
        **{mode: {**medians(rounds[mode]), "rounds": rounds[mode]} for mode in MODES},
        "kill": kill,
        "setup": setup,
    }
