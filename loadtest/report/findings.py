"""The report's opening: one short verdict per scheme for each question the study asks, each with
the figure (and interval) behind it and a link to its section, and a headline table narrow enough
for a laptop screen. Everything else in the report is the evidence, after it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from loadtest.report.analysis import (
    GOODPUT_RATIO_GOAL,
    bpb_multiples,
    cheapest_within,
    goodput_ratio,
    int8_ratio,
    largest,
    latency_spreads,
    load_spreads,
    pooled,
)
from loadtest.report.formatting import cell, fmt, kv_bytes
from loadtest.report.hybrids import hybrids_section
from loadtest.report.latent import latent_section
from loadtest.report.reuse_tables import judge, mode_changes, scheme_verdict
from loadtest.report.seeds import AcrossSeeds, across, agreement, label, seed_models, seeds_note
from loadtest.report.speculative_tables import SPEEDUP_GAIN
from loadtest.report.tenants_tables import tenants_finding
from loadtest.study.results import Cell, Probe, Results
from loadtest.study.rounds import Spread, compared, goodput_ratio_rounds
from loadtest.workloads import load_prompt_bytes

EXTRAPOLATES = 1.15  # bits per byte at the longest servable multiple within 15% of 1x (the report's rule)
# Links into the sections that hold each verdict's table and figure (their headings' anchors).
QUESTIONS = {
    "quality at and beyond the training length": "#headline",
    "retrieval over distance": "#retrieval-over-distance",
    "cache memory": "#memory",
    "latency and goodput under load": "#goodput-without-and-with-admission-control",
    "reuse across requests": "#kv-reuse-a-shared-prefix-and-documents-in-varying-order",
}


Judgement = tuple[str, str]  # (what a verdict says, in a few words; its sentence with the figures behind it)


def judged(results: Results, scheme: str, section: Mapping[str, Any],
           judge: Callable[[str], Judgement | None]) -> dict[str, Judgement]:  # fmt: skip
    """Seed -> `judge(model)` for each of the scheme's seeds that `section` has figures for."""
    return {seed: found for seed, model in seed_models(results, scheme, section).items()
            if (found := judge(model)) is not None}  # fmt: skip


def over_seeds(said: dict[str, Judgement], figures: str) -> str:
    """A verdict over several seeds: what they all say and the figures over them, or the figures and
    which seed says what."""
    kinds = {seed: kind for seed, (kind, _) in said.items()}
    if len(set(kinds.values())) == 1:
        kind = next(iter(kinds.values()))
        return f"{kind}: {figures}; {agreement(kinds)}" if figures else f"{kind}; {agreement(kinds)}"
    return f"{figures}; {agreement(kinds)}" if figures else agreement(kinds)


def quality_judgement(results: Results, model: str) -> Judgement | None:
    quality = {m: v for m, v in results.quality.get(model, {}).items() if v is not None}
    if "1" not in quality:
        return None
    longest = max(quality, key=float)
    at_one, at_longest = quality["1"], quality[longest]
    if longest == "1":
        return "no positions past 1x", f"{at_one:.3f} bits/byte at 1x; no positions past it"
    change = at_longest / at_one
    word = "extrapolates" if change <= EXTRAPOLATES else "does not extrapolate"
    return word, f"{word}: {at_one:.3f} bits/byte at 1x, {at_longest:.3f} at {longest}x ({change - 1:+.0%})"


def quality_verdict(results: Results, scheme: str) -> str:
    said = judged(results, scheme, results.quality, lambda model: quality_judgement(results, model))
    if len(said) < 2:
        return next(iter(said.values()))[1] if said else "not measured"
    longest = max((m for m, v in results.quality[scheme].items() if v is not None), key=float)
    at = {m: across(results, scheme, results.quality, lambda model, m=m: results.quality[model].get(m))
          for m in ("1", longest)}  # fmt: skip
    one, far = at["1"], at[longest]
    assert one is not None
    figures = f"{one.text()} bits/byte at 1x"
    if far is not None and longest != "1":
        figures += f", {far.text()} at {longest}x ({far.mean / one.mean - 1:+.0%} on the means)"
    return over_seeds(said, figures)


def copy_judgement(results: Results, model: str) -> Judgement | None:
    copy = results.probe(model, "copy")
    near, far = pooled(copy, 128), largest(copy)
    if near is None:
        return None
    far_bytes = max((int(d) for d, c in copy.items() if c is not None), default=0)
    chance = results.span_chance
    if near["low"] <= chance:
        kind = "does not copy"
    elif far is None or far_bytes <= 128:
        return "copies; no positions farther", f"copies {cell(near)} within 128 bytes; no positions farther"
    else:
        kind = "retrieves far" if far["value"] >= 0.5 * near["value"] and far["low"] > chance else "copies, not far"
    return kind, f"{kind}: copies {cell(near)} within 128 bytes, {cell(far)} at {far_bytes} bytes"


def retrieval_verdict(results: Results, scheme: str) -> str:
    said = judged(results, scheme, results.retrieval, lambda model: copy_judgement(results, model))
    if len(said) < 2:
        return next(iter(said.values()))[1] if said else "not measured"
    near = across(results, scheme, results.retrieval, lambda m: value_of(pooled(results.probe(m, "copy"), 128)))
    far = across(results, scheme, results.retrieval, lambda m: value_of(largest(results.probe(m, "copy"))))
    far_bytes = max((int(d) for d, c in results.probe(scheme, "copy").items() if c is not None), default=0)
    assert near is not None
    figures = f"copies {near.text(2)} within 128 bytes" + (f", {far.text(2)} at {far_bytes} bytes" if far else "")
    return over_seeds(said, figures)


def value_of(found: Cell | None) -> float | None:
    return None if found is None else found["value"]


def window_bpb(results: Results, model: str) -> tuple[str, float] | None:
    """Bits per byte under window:256 at the longest multiple measured (None: not measured or servable)."""
    window = (results.cache_budget.get(model) or {"bpb": {}})["bpb"].get("window:256", {})
    longest = max(window, key=float, default=None)
    return None if longest is None or window[longest] is None else (longest, window[longest])


def cheapest_judgement(results: Results, model: str) -> Judgement | None:
    """The cheapest cache policy within 5% of the full cache at the longest multiple measured."""
    figures = results.cache_budget.get(model)
    multiples = bpb_multiples(results.cache_budget)
    if figures is None or not multiples:
        return None
    chosen = cheapest_within(figures, multiples[-1], results.train_context, int8_ratio(results.cache_budget))
    kind = f"cheapest within 5% at {multiples[-1]}x: {'not servable' if chosen is None else chosen[0]}"
    found = window_bpb(results, model)
    return kind, "" if found is None else f"window:256 keeps {fmt(found[1])} bits/byte at {found[0]}x"


def memory_verdict(results: Results, scheme: str) -> str:
    info = results.models.get(scheme)
    if info is None:
        return "not measured"
    text = kv_bytes(info, " B/token")
    said = judged(results, scheme, results.cache_budget, lambda model: cheapest_judgement(results, model))
    if len(said) == 1:
        sentence = next(iter(said.values()))[1]
        return text + (f"; {sentence}" if sentence else "")
    if said:
        window = across(results, scheme, results.cache_budget, lambda m: (window_bpb(results, m) or (0, None))[1])
        longest = (window_bpb(results, scheme) or ("?", 0.0))[0]
        text += f"; window:256 keeps {window.text()} bits/byte at {longest}x" if window else ""
        text += "; " + over_seeds(said, "")
    return text


def load_verdict(results: Results, scheme: str) -> str:
    """Goodput with admission at the most users and its ratio to the best at fewer users (on the rounds'
    medians, with the rounds' range), and inter-token latency at the longest context, each against
    the best scheme's: "within noise" where the rounds' ranges overlap."""
    shed = results.load_admission.get(scheme, {})
    users = max(shed, key=int, default=None)
    if users is None:
        return "not measured"
    rounds = results.load_rounds.get("load_admission", {}).get(scheme)
    if not rounds:  # a run from before rounds: one sample per level
        ratio = goodput_ratio(shed)
        ratio_text = "" if ratio is None else f", {ratio:.2f} of its best at fewer users"
        top = shed[users]
        return (
            f"{top['goodput_per_s']:.2f} good req/s at {users} users with admission{ratio_text} "
            f"(p99 {top['p99_s']:.2f} s; one sample per level)"
        )
    goodput = same_workload(results, scheme, load_spreads(results, "load_admission", users, "goodput_per_s"))
    ratio, ratio_rounds = goodput_ratio_rounds(rounds)
    text = f"{goodput[scheme].text()} good req/s at {users} users with admission ({ranked(results, scheme, goodput)})"
    if ratio is not None:
        text += f", {ratio:.2f} of its best at fewer users"
        if ratio_rounds is not None and ratio_rounds.rounds > 1:
            text += f" (rounds {ratio_rounds.low:.2f}-{ratio_rounds.high:.2f})"
        if ratio < GOODPUT_RATIO_GOAL:
            text += f", short of the {GOODPUT_RATIO_GOAL:g} goal by {GOODPUT_RATIO_GOAL - ratio:.2f}"
    contexts = {c for s in results.schemes for c in results.latency_rounds.get("itl", {}).get(s, {})}
    longest = max(contexts, key=int, default=None)
    itl = latency_spreads(results, "itl", longest) if longest else {}
    if scheme in itl:
        text += f"; ITL {itl[scheme].text(2, 1000)} ms at {longest} bytes ({compared(itl, False)[scheme]})"
    rounds = goodput[scheme].rounds
    return f"{text}; " + ("one round" if rounds == 1 else f"medians of {rounds} rounds [min-max]")


def same_workload(results: Results, scheme: str, spreads: dict[str, Spread]) -> dict[str, Spread]:
    """The schemes of `spreads` whose load prompts were as long as `scheme`'s: learned's are cut to its
    256 positions (loadtest.workloads.load_prompt_bytes), so its goodput ranks with no one else's."""

    def prompt(name: str) -> int:
        return load_prompt_bytes(results.models.get(name, {}).get("max_positions"))

    return {name: spread for name, spread in spreads.items() if prompt(name) == prompt(scheme)}


def ranked(results: Results, scheme: str, spreads: dict[str, Spread]) -> str:
    """`scheme` against the best of its workload's schemes, or why it is not ranked."""
    if len(spreads) > 1:
        return compared(spreads, True)[scheme]
    positions = results.models.get(scheme, {}).get("max_positions")
    served = load_prompt_bytes(positions)
    others = sorted({load_prompt_bytes(info.get("max_positions")) for name, info in results.models.items()
                     if name in results.schemes and name != scheme} - {served})  # fmt: skip
    if not others:
        return "the only scheme measured on these prompts"
    limit = f" (its {positions} positions)" if positions else ""
    return f"not ranked: served {served}-byte prompts{limit}, the others {'/'.join(map(str, others))}"


def reuse_verdict(results: Results, scheme: str) -> str:
    reuse = results.reuse.get(scheme)
    models = seed_models(results, scheme, results.reuse)
    if reuse is None or len(models) < 2:
        return scheme_verdict(results, scheme) or "not measured"
    parts = []
    placement = reuse["segment_reuse"]
    for form in reuse["documents"]:
        said = {seed: judge(results.reuse[model], form) for seed, model in models.items()}
        change = across(results, scheme, results.reuse, lambda m, f=form: placed_change(results, m, f))
        how = "as is" if placement == "as_is" else "re-rotated"
        figures = "" if change is None else f"{how} {change.text(1, 100, '%', sign=True)} bpb"
        parts.append(f"{form} documents: {over_seeds(said, figures)}")
    return "; ".join(parts)


def placed_change(results: Results, model: str, form: str) -> float | None:
    """The change from the full recompute of the model's reuse as its scheme places documents."""
    reuse = results.reuse[model]
    return value_of((mode_changes(reuse, form) or {}).get(reuse["segment_reuse"]))


def speculative_judgement(results: Results, model: str) -> Judgement | None:
    found = results.speculative.get(model, {}).get("repeats@1")
    if found is None:
        return None
    kind = "gains from guessing" if found["speedup"] >= SPEEDUP_GAIN else f"gains little (< {SPEEDUP_GAIN:g}x)"
    interval = found.get("acceptance_interval")
    kept = f"{found['acceptance']:.0%}" + ("" if not interval else f" [{interval['low']:.0%}, {interval['high']:.0%}]")
    return kind, f"{found['speedup']:.2f}x tokens/s on code with repeats at one stream ({kept} of guesses kept)"


def speculative_verdict(results: Results, scheme: str) -> str:
    said = judged(results, scheme, results.speculative, lambda model: speculative_judgement(results, model))
    if len(said) < 2:
        return next(iter(said.values()))[1] if said else "not measured"

    def figure(key: str) -> AcrossSeeds | None:
        return across(results, scheme, results.speculative,
                      lambda m: results.speculative[m].get("repeats@1", {}).get(key))  # fmt: skip

    speedup, acceptance = figure("speedup"), figure("acceptance")
    assert speedup is not None and acceptance is not None
    figures = (f"{speedup.text(2, unit='x')} tokens/s on code with repeats at one stream "
               f"({acceptance.text(0, 100, '%')} of guesses kept)")  # fmt: skip
    return over_seeds(said, figures)


VERDICTS = (quality_verdict, retrieval_verdict, memory_verdict, load_verdict, reuse_verdict)
# Measured on the served model only: latency is the architecture's, not the checkpoint's (its rounds say how
# much it moves); the other verdicts name each scheme with its seed count (seeds.label).
SERVED_ONLY = {load_verdict}


def findings_section(results: Results) -> str:
    """## Findings: per question, one line per scheme (its seed count beside it where schemes differ)."""
    blocks = []
    for (question, anchor), verdict in zip(QUESTIONS.items(), VERDICTS, strict=True):
        name = (lambda scheme: scheme) if verdict in SERVED_ONLY else (lambda scheme: label(results, scheme))
        lines = "\n".join(f"- **{name(s)}**: {verdict(results, s)}" for s in results.schemes)
        blocks.append(f"**[{question.capitalize()}]({anchor})**\n\n{lines}\n")
    if results.speculative:
        lines = "\n".join(
            f"- **{label(results, s)}**: {speculative_verdict(results, s)}"
            for s in results.schemes
            if "repeats@1" in results.speculative.get(s, {})
        )
        blocks.append(f"**[Speculative decoding](#speculative-decoding-what-guessing-buys-each-scheme)**\n\n{lines}\n")
    if hybrids := hybrids_section(results):
        blocks.append(hybrids)
    if latent := latent_section(results):
        blocks.append(latent)
    if tenants := tenants_finding(results):
        blocks.append(tenants)
    return "## Findings\n\n" + seeds_note(results) + "\n" + "\n".join(blocks)


def compact_headline(results: Results) -> str:
    """Eight columns: quality at 1x and at the longest multiple, far copy and passkey, goodput
    (without admission control, which its header says) and p99 at the most users, KV bytes per token
    (every column of the old headline is in the appendix). A scheme with several training seeds
    shows their mean and range in the seeds' columns."""
    multiples = sorted({m for s in results.schemes for m in results.quality.get(s, {})}, key=float)
    longest = multiples[-1] if multiples else "8"
    users = sorted({u for s in results.schemes for u in results.load.get(s, {})}, key=int)
    top = users[-1] if users else None
    header = ["scheme", "bpb@1x", f"bpb@{longest}x", f"copy @{longest}x", f"passkey @{longest}x",
              f"goodput req/s @{top}, no admission", f"p99 s @{top}", "KV B/token"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for scheme in results.schemes:
        load = results.load.get(scheme, {}).get(top, {}) if top else {}
        info = results.models.get(scheme)
        cells = [
            label(results, scheme), *(seeded_bpb(results, scheme, m) for m in ("1", longest)),
            *(seeded_probe(results, scheme, probe) for probe in ("copy", "passkey")),
            fmt(load.get("goodput_per_s"), 2), fmt(load.get("p99_s"), 2),
            "" if info is None else kv_bytes(info),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def seeded_bpb(results: Results, scheme: str, multiple: str) -> str:
    """Bits per byte at a multiple: the served model's, or the seeds' mean and range."""
    found = across(results, scheme, results.quality, lambda m: results.quality[m].get(multiple))
    return fmt(results.quality.get(scheme, {}).get(multiple)) if found is None or found.seeds < 2 else found.text()


def seeded_probe(results: Results, scheme: str, probe: Probe) -> str:
    """A probe at its longest length: the served model's cell with its interval, or the seeds' mean and range."""
    found = across(results, scheme, results.retrieval, lambda m: value_of(largest(results.probe(m, probe))))
    return cell(largest(results.probe(scheme, probe))) if found is None or found.seeds < 2 else found.text(2)
