"""The report's tenants section: a noisy tenant beside a quiet one, first come first served against
fair scheduling (loadtest/study/tenants.py), and its Findings line."""

from __future__ import annotations

from typing import Any

from loadtest.study.results import Results

POLICIES = {"fcfs": "first come, first served", "fair": "fair (deficit round robin)"}
ANCHOR = "#tenants-a-noisy-tenant-beside-a-quiet-one"


def _range(rounds: list[dict[str, Any]], tenant: str, key: str, digits: int, scale: float = 1.0) -> str:
    values = [r[tenant][key] * scale for r in rounds]
    return f" [{min(values):.{digits}f}-{max(values):.{digits}f}]" if len(values) > 1 else ""


def _row(name: str, cell: dict[str, Any], tenant: str) -> str:
    rounds, figures = cell["rounds"], cell[tenant]
    return (
        f"| {name} | {tenant} | {figures['ttft_p50_s'] * 1000:.0f}{_range(rounds, tenant, 'ttft_p50_s', 0, 1000)} "
        f"| {figures['ttft_p99_s'] * 1000:.0f}{_range(rounds, tenant, 'ttft_p99_s', 0, 1000)} "
        f"| {figures['tokens_per_s']:.0f}{_range(rounds, tenant, 'tokens_per_s', 0)} "
        f"| {figures['goodput_per_s']:.1f}{_range(rounds, tenant, 'goodput_per_s', 1)} |"
    )


def verdict(results: Results, policy: str) -> str:
    """One policy against the acceptance: the quiet tenant's TTFT p50 and the noisy one's tokens a
    second, each beside its solo value."""
    cell, goals = results.tenants[policy], results.tenants["setup"]
    quiet, noisy = cell["quiet_ttft_vs_solo"], cell["noisy_throughput_vs_solo"]
    met = quiet <= goals["quiet_ttft_goal"] and noisy >= goals["noisy_throughput_goal"]
    server = cell.get("server_throughput_vs_solo")
    kept = "" if server is None else (
        f"; the server's tokens/s {server:.2f}x the noisy tenant's solo, {cell['quiet_share']:.0%} of them the quiet "
        "tenant's"
    )  # fmt: skip
    return (
        f"{POLICIES[policy]}: quiet TTFT p50 {cell['quiet']['ttft_p50_s'] * 1000:.0f} ms ({quiet:.1f}x solo), "
        f"noisy {noisy:.2f}x its solo tokens/s ({'meets' if met else 'misses'} <= {goals['quiet_ttft_goal']:g}x "
        f"and >= {goals['noisy_throughput_goal']:g}x){kept}"
    )


def tenants_finding(results: Results) -> str:
    """The Findings block, or nothing where the run did not measure the section."""
    if not results.tenants:
        return ""
    users = results.tenants["setup"]["users"]
    lines = "\n".join(f"- {verdict(results, policy)}" for policy in POLICIES)
    return f"**[Tenants: {users['quiet']} quiet streams beside {users['noisy']} noisy ones]({ANCHOR})**\n\n{lines}\n"


def _solo_share(tenants: dict[str, Any]) -> float:
    noisy = tenants["solo"]["noisy"]["tokens_per_s"]
    return tenants["solo"]["quiet"]["tokens_per_s"] / noisy if noisy else float("nan")


def _rows(setup: dict[str, Any]) -> str:
    rows = setup.get("max_batch_size")
    return f" and with a row for every stream (`--max-batch-size {rows}`)" if rows else ""


def _pause(setup: dict[str, Any]) -> str:
    think = setup.get("quiet_think_s", 0.0)
    return f", each pausing {think:g} s on average (exponential) between its requests" if think else ", closed-loop too"


def _closed_loop_note(setup: dict[str, Any]) -> str:
    if setup.get("quiet_think_s", 0.0):
        return ""
    return (": its streams send their next request as soon as the last ends, so the faster it is served the more"
            " it asks, and whatever share it takes beside the noisy tenant is the noisy one's loss unless the"
            " policy wastes capacity (the verdicts give both)")  # fmt: skip


def tenants_section(results: Results) -> str:
    """The section's markdown, or nothing where the run did not measure it."""
    tenants = results.tenants
    if not tenants:
        return ""
    setup = tenants["setup"]
    rows = [_row("alone", tenants["solo"], tenant) for tenant in ("quiet", "noisy")]
    rows += [_row(name, tenants[policy], tenant) for policy, name in POLICIES.items() for tenant in ("quiet", "noisy")]
    table = "\n".join(rows)
    verdicts = "\n".join(f"- {verdict(results, policy)}" for policy in POLICIES)
    return f"""## Tenants: a noisy tenant beside a quiet one

One `{setup["model"]}` server without a prefix cache{_rows(setup)}, two tenants of
`--auth-tokens-file`: the noisy one holds {setup["users"]["noisy"]} closed-loop streams, the quiet one
{setup["users"]["quiet"]}{_pause(setup)}, each request a {setup["prompt_bytes"]}-byte held-out
prompt and {setup["new_tokens"]} new tokens, {setup["seconds"]:g} s a measurement; each tenant alone,
then both under `--scheduling fcfs` and `--scheduling fair` (deficit round robin over tokens,
docs/engine.md), {setup["rounds"]} rounds, medians [min-max].
Goodput: requests a second within the load sections' TTFT and ITL targets. Alone the quiet
tenant's {setup["users"]["quiet"]} streams use {tenants["solo"]["quiet"]["tokens_per_s"]:.0f} tokens/s,
{_solo_share(tenants):.2f}x what the noisy tenant's {setup["users"]["noisy"]} use{_closed_loop_note(setup)}.

| scheduling | tenant | TTFT p50 ms | TTFT p99 ms | tokens/s | goodput req/s |
|---|---|---|---|---|---|
{table}

{verdicts}

"""
