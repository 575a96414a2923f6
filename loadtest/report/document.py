"""report.md: every section in order, drawn from a comparison's results.json, beside its figures."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.report.analysis import chance_fraction
from loadtest.report.cache_tables import cache_budget_section, memory_section
from loadtest.report.evaluation_tables import evaluation_section
from loadtest.report.figures import plot
from loadtest.report.findings import compact_headline, findings_section
from loadtest.report.html import write_html
from loadtest.report.reuse_tables import reuse_section
from loadtest.report.routing_tables import routing_section
from loadtest.report.speculative_tables import speculative_section
from loadtest.report.tables import (
    budget_load_table,
    depth_table,
    footprint_table,
    goodput_section,
    grid_table,
    headline_table,
    load_table,
    memory_table,
    probe_table,
    rounds_note,
    runs_line,
    training_section,
    what_each_scheme_buys,
)
from loadtest.report.tenants_tables import tenants_section
from loadtest.study.results import Results


def retrieval_tables(results: Results) -> str:
    tables = [
        probe_table(
            "Copy: share of the repeat predicted, by filler bytes between the copies", results, "copy", "bytes"
        ),
        probe_table("Passkey: share of the key's digits predicted, by context bytes", results, "passkey", "bytes"),
        probe_table(
            "Bits per byte on bytes completing a repeated 8-byte n-gram, by distance to its previous "
            "occurrence (bucket upper edge; `all`: every byte)",
            results,
            "natural",
            "bytes",
        ),
        depth_table(results),
    ]
    return "\n".join(tables)


def write_report(out: Path) -> Path:
    """Draw the figures and write report.md into `out`, from its results.json."""
    results = Results.read(out / "results.json")
    plot(results, out)
    sections = (_title, _headline, _latency, _memory_and_retrieval, _the_rest, _appendix)
    text = "".join(section(results) for section in sections)
    (out / "report.md").write_text(text)
    write_html(out / "report.md")  # report.html beside it, figures embedded
    return out / "report.md"


def _title(results: Results) -> str:
    """The title and where the figures come from (machine, versions, commit), then the findings."""
    env = results.environment
    return f"""# Positional-encoding comparison — run {results.run_id}

Measured through the gRPC service (`python -m loadtest.compare`); every raw figure is in
`results.json`. Machine: {env["cpus"]} CPUs, {env["machine"]}, {env["memory"]}; {env["platform"]}.
Versions: Python {env["python"]}, onnxruntime {env["onnxruntime"]}, torch {env["torch"]}, grpcio {env["grpcio"]}.
Commit: `{env["commit"]}` (later reruns of single sections: the appendix).

{findings_section(results)}
"""


def _headline(results: Results) -> str:
    """The compact headline and quality against context, with the goodput targets it counts by."""
    targets = results.config["goodput_targets"]
    train_context = results.train_context
    return f"""## Headline

{compact_headline(results)}

bpb: bits per byte on held-out text (the stdlib test split) through the `Score` RPC at multiples
of the {train_context}-byte training context; "not servable" where the scheme has no positions for that length. Goodput
counts requests with time to first token <= {targets["ttft_s"]} s and
mean inter-token latency <= {targets["itl_s"] * 1000:.0f} ms; the headline's is without admission
control (every request admitted), where the findings quote it with admission control (the Goodput
section has both).

![bits per byte](bpb_vs_context.png)

{grid_table("Bits per byte versus context multiple (rope-* rows: inference-time scaling)", results.quality, 1.0, 3)}
"""


def _latency(results: Results) -> str:
    """Latency unloaded and under load, and goodput without and with admission control."""
    budget = results.config["budget"]
    return f"""## Latency

The latency and load servers run without the prefix cache, so every prompt is computed (these
sections send the same prompts again); what reuse buys is the KV reuse section's.

![inter-token latency](itl_vs_context.png) ![time to first token](ttft_vs_prompt.png)

{
        grid_table(
            "Time to first token (ms, median [min-max] of the rounds) versus prompt bytes",
            results.ttft,
            1000.0,
            1,
            results.latency_rounds.get("ttft"),
        )
    }
{
        grid_table(
            "Inter-token latency (ms, median [min-max] of the rounds) versus context bytes",
            results.itl,
            1000.0,
            2,
            results.latency_rounds.get("itl"),
        )
    }
### Under load (closed loop, {budget["load_seconds"]} s per level, {budget["load_new_tokens"]} new tokens, sampling)

{rounds_note(results)}

![throughput](throughput_vs_concurrency.png)

{load_table(results)}

### Goodput, without and with admission control

{goodput_section(results)}
{budget_load_table(results)}
"""


def _memory_and_retrieval(results: Results) -> str:
    """What each scheme holds in memory, and what it retrieves over distance."""
    budget = results.config["budget"]
    return f"""## Memory

{memory_section(results)}
{memory_table(results)}

{footprint_table(results)}

Per-step extras are per sequence for one decode step over 2048 keys, measured from each scheme's
positional module (a bias tensor of heads x keys for `relative` and `alibi`, rotary tables for
`rope`, an embedding row for `sinusoidal` and `learned`).

## Retrieval over distance

Graded probes through the `Score` RPC, teacher-forced, counting the bytes the model's greedy
prediction gets right ({budget["retrieval_trials"]} trials per cell; 95% Wilson intervals with one
observation per trial, since a trial's bytes are not independent). **Copy**: a random 16-character
span in held-out text, repeated after a filler of D bytes; the share of the repeat's last 8
characters predicted. **Passkey**: a 5-digit key in a line of code at a random depth, asked for at
the end (`# what was it? pass_key = "`). **Natural**: bits per byte on held-out bytes that complete a
repeated 8-byte n-gram, by how far back its previous occurrence is (interval: cluster-robust
standard error over windows). Chance for a digit is 0.1, for a span character {chance_fraction(results.span_chance)}.

![retrieval](retrieval.png)

![copy by depth](retrieval_depth.png)

{retrieval_tables(results)}
"""


def _the_rest(results: Results) -> str:
    """What each scheme buys, training, cache budgets, then the optional sections a run measured."""
    return f"""## What each scheme buys

{what_each_scheme_buys(results)}
## Training: when each scheme starts to copy

{training_section(results.training)}
## Cache budgets: what each scheme keeps when its cache is bounded

{cache_budget_section(results)}
{reuse_section(results)}{speculative_section(results)}{routing_section(results)}{tenants_section(results)}{evaluation_section(results)}"""


def _appendix(results: Results) -> str:
    """Every headline column, the reruns, and the config the run used."""
    return f"""## Appendix

Every headline column, the sections measured again since the first run, and the config.

{headline_table(results)}
{runs_line(results).strip()}

```json
{json.dumps(results.config, indent=2)}
```
"""
