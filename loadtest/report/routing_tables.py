"""The report's routing section: round robin against prefix affinity through HAProxy, and what a
replica killed mid-run costs (loadtest/study/routing.py)."""

from __future__ import annotations

from typing import Any

from loadtest.study.results import Results

MODES = {"round_robin": "round robin", "affinity": "prefix affinity"}


def _range(rounds: list[dict[str, Any]], key: str, digits: int, scale: float = 1.0) -> str:
    values = [r[key] * scale for r in rounds]
    return f"[{min(values):.{digits}f}-{max(values):.{digits}f}]" if len(values) > 1 else ""


def routing_section(results: Results) -> str:
    """The section's markdown, or nothing where the run did not measure it."""
    routing = results.routing
    if not routing:
        return ""
    rows = []
    for mode, name in MODES.items():
        cell, rounds = routing[mode], routing[mode]["rounds"]
        rows.append(
            f"| {name} | {cell['prefix_hit_rate']:.0%} {_range(rounds, 'prefix_hit_rate', 0, 100)} "
            f"| {cell['ttft_p50_s'] * 1000:.0f} {_range(rounds, 'ttft_p50_s', 0, 1000)} "
            f"| {cell['ttft_p99_s'] * 1000:.0f} {_range(rounds, 'ttft_p99_s', 0, 1000)} "
            f"| {cell['goodput_per_s']:.1f} {_range(rounds, 'goodput_per_s', 1)} |"
        )
    rr, affinity, kill, setup = routing["round_robin"], routing["affinity"], routing["kill"], routing["setup"]
    hits = affinity["prefix_hit_rate"] / rr["prefix_hit_rate"] if rr["prefix_hit_rate"] else float("inf")
    ttft = affinity["ttft_p50_s"] / rr["ttft_p50_s"] if rr["ttft_p50_s"] else float("nan")
    errors = "; ".join(kill["errors"]) or "none"
    table = "\n".join(rows)
    return f"""## Routing: round robin against prefix affinity

{setup['replicas']} replicas of `{setup['model']}` with small KV budgets behind HAProxy
(deploy/haproxy/haproxy.cfg), {setup['users']} users streaming {setup['prefixes']} prefixes of
{setup['prefix_bytes']} bytes, each {setup['uses']} times with a different tail, in a random order
(the prefixes' K/V about twice what one replica's prefix cache keeps); every round on new prefixes,
{len(rr['rounds'])} rounds, medians [min-max]. Affinity hashes the x-routing-key header (the
prompt's first 256 bytes) onto a consistent-hash ring with a bound on load.

| routing | prefix hit rate | TTFT p50 ms | TTFT p99 ms | goodput req/s |
|---|---|---|---|---|
{table}

Affinity's hit rate is {hits:.2f}x round robin's and its TTFT p50 {ttft:.2f}x. One replica killed
(SIGKILL) a third into an affinity run: {kill['requests']} requests served, {kill['failed_before_start']}
failed before their first token (the proxy retried the rest on the other replica), {kill['cut_streams']}
streams cut after it ({errors}).

"""
