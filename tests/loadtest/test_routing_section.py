"""The routing section, tiny: two real replicas behind Debian's haproxy, both modes, a replica
killed mid-run, results.json's shape and the report's table."""

from __future__ import annotations

import random
import shutil
import socket
from pathlib import Path

import pytest

from loadtest.haproxy import listening_socket
from loadtest.report.routing_tables import routing_section
from loadtest.study import routing
from loadtest.study.budget import Budget
from loadtest.study.held_out import HeldOut
from loadtest.study.results import Results


class Progress:
    def __init__(self) -> None:
        self.steps = 0

    def update(self, steps: int) -> None:
        self.steps += steps


def test_a_workload_uses_each_prefix_with_different_tails() -> None:
    budget = Budget.tiny()
    rng = random.Random(0)
    data = bytes(rng.randrange(32, 127) for _ in range(20_000))  # printable, aperiodic
    workload = routing.Workload.draw(data, random.Random(1), budget)
    assert len(workload.prefixes) == budget.routing_prefixes
    assert len(workload.requests) == budget.routing_prefixes * budget.routing_uses
    for prefix in workload.prefixes:
        uses = [r for r in workload.requests if r.startswith(prefix)]
        assert len(uses) == budget.routing_uses and len(set(uses)) == len(uses)


def test_replicas_keep_half_the_prefixes_beside_their_sequences(repository: Path) -> None:
    flags = routing.replica_flags(repository, Budget())
    kv_bytes = int(flags[flags.index("--kv-cache-bytes") + 1])
    token_bytes = 2 * 4 * 4 * 32 * 4  # alibi: K and V, 4 layers, 4 heads of 32, float32
    prefixes = Budget().routing_prefixes * Budget().routing_prefix_bytes * token_bytes
    assert 1.5 * kv_bytes <= prefixes <= 2.5 * kv_bytes  # about twice what one replica's cache holds


def test_the_tiny_section_fills_results_and_the_report(repository: Path, tmp_path: Path) -> None:
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy not installed (.ci/run installs it)")
    results = Results("tiny", {}, {}, ["alibi"])  # type: ignore[typeddict-item]
    progress = Progress()
    budget = Budget.tiny()
    routing.measure_routing(repository, 1, HeldOut(), budget, results, progress, tmp_path)  # type: ignore[arg-type]
    assert progress.steps == 2 * budget.load_rounds + 1
    for mode in routing.MODES:
        cell = results.routing[mode]
        assert 0.0 <= cell["prefix_hit_rate"] <= 1.0 and cell["ttft_p50_s"] > 0
        assert len(cell["rounds"]) == budget.load_rounds
        assert all(r["failed_before_start"] == 0 and r["cut_streams"] == 0 for r in cell["rounds"])
        sent = budget.load_rounds * budget.routing_prefixes * budget.routing_uses
        assert sum(r["requests"] for r in cell["rounds"]) == sent
    assert results.routing["affinity"]["prefix_hit_rate"] > 0  # repeated prefixes hit under affinity
    assert results.routing["kill"]["failed_before_start"] == 0  # retried by the proxy
    text = routing_section(results)
    assert "| prefix affinity |" in text and "| round robin |" in text


def test_the_proxy_socket_is_ours_alone() -> None:
    """haproxy gets sockets we bound: nothing else, SO_REUSEPORT or not, can share their port (a port
    picked and then bound by haproxy once met another listener, and a gRPC call met the HTTP one)."""
    with listening_socket() as ours, socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with pytest.raises(OSError):
            other.bind(ours.getsockname())
