"""The Findings' paragraph on latent attention (`mla`): what caching one latent and one shared rotated
key a token costs and buys against rope, the hybrid that cuts the cache another way (rnope-swa),
relative and alibi, question by question, from whatever the run measured.

Its quality verdict is the one the comparison asked for: bits per byte at the training length, the
mean over its training seeds within 3% of rope's mean, and whether each seed on its own is.
"""

from __future__ import annotations

from loadtest.report.hybrids import (
    QUALITY_CLOSE,
    latency_summary,
    not_measured_summary,
    quality_summary,
    retrieval_summary,
    reuse_summary,
    speculation_summary,
)
from loadtest.report.seeds import across, agreement, label
from loadtest.study.results import Results
from models.positional import SCHEME_REGISTRY, LatentRotary

RIVALS = ("rope", "rnope-swa", "relative", "alibi")


def latent_schemes(results: Results) -> list[str]:
    """The run's schemes that cache a latent instead of K and V (models.positional.LatentRotary)."""
    return [s for s in results.schemes if issubclass(SCHEME_REGISTRY.get(s, object), LatentRotary)]


def seed_quality(results: Results, scheme: str) -> str:
    """The mean over seeds of bits per byte at the training length against rope's mean, and whether
    each seed is within QUALITY_CLOSE of rope's mean on its own."""

    def at_training_length(model: str) -> float | None:
        return results.quality.get(model, {}).get("1")

    own, rope = across(results, scheme, results.quality, at_training_length), across(
        results, "rope", results.quality, at_training_length
    )
    if own is None or rope is None:
        return ""
    change = own.mean / rope.mean - 1
    verdict = "within" if abs(change) <= QUALITY_CLOSE else "**not** within"
    said = {seed: "within 3%" if abs(v / rope.mean - 1) <= QUALITY_CLOSE else "not within 3%"
            for seed, v in own.values.items()}  # fmt: skip
    held = agreement(said)
    return (f" Over its seeds, {own.text()} bits/byte at the training length against rope's {rope.text()}: "
            f"{change:+.1%}, {verdict} 3% of rope's mean" + (f" ({held})" if held else "") + ".")  # fmt: skip


def _memory(results: Results, scheme: str) -> str:
    """Bytes a token at each length against every rival's, and requests one budget holds."""
    own = results.kv_footprint.get(scheme)
    if not own:
        return "memory footprint not measured"
    lengths = sorted((k.split("@")[1] for k in own if k.startswith("kv_bytes")), key=int)
    parts = []
    for rival in RIVALS:
        theirs = results.kv_footprint.get(rival) or {}
        ratios = [f"{own[f'kv_bytes_per_token@{n}'] / theirs[f'kv_bytes_per_token@{n}']:.2f}x"
                  for n in lengths if theirs.get(f"kv_bytes_per_token@{n}")]  # fmt: skip
        if ratios:
            parts.append(f"{'/'.join(ratios)} {rival}'s")
    text = f"K/V bytes a token at {'/'.join(lengths)} tokens " + ", ".join(parts)
    rope = results.kv_footprint.get("rope") or {}
    held, rope_held = own.get("requests_4kb@budget"), rope.get("requests_4kb@budget")
    if held and rope_held:
        text += f"; one budget holds {held:.0f} 4 KB requests at once against rope's {rope_held:.0f}"
        text += f" ({held / rope_held:.1f}x)"
    return text


def _prefill_and_budget(results: Results, scheme: str) -> str:
    """What the cut cache buys under one budget, beside what its prompts cost: on a CPU a 4 KB
    request is mostly its prompt, so tokens a second follow prefill, not the rows the budget holds."""
    text = ""
    own_ttft, rope_ttft = results.ttft.get(scheme, {}), results.ttft.get("rope", {})
    longest = max((k for k, v in own_ttft.items() if v is not None and rope_ttft.get(k)), key=int, default=None)
    if longest is not None:
        text += (f" Its prompts cost {own_ttft[longest] / rope_ttft[longest]:.2f}x rope's time to first token at "
                 f"{longest} bytes (keys and values up-projected from the latents).")  # fmt: skip
    own, rope = results.load_budget.get(scheme), results.load_budget.get("rope")
    if own and rope and rope["tokens_per_s"]:
        text += (f" Under one KV budget with 4 KB prompts and {own.get('users', 32)} users it ran "
                 f"{own.get('running_peak', 0):.0f} requests at once against rope's {rope.get('running_peak', 0):.0f}, "
                 f"for {own['tokens_per_s']:.0f} tokens/s against {rope['tokens_per_s']:.0f} "
                 f"({own['tokens_per_s'] / rope['tokens_per_s']:.2f}x).")  # fmt: skip
    return text


def latent_section(results: Results) -> str:
    """One paragraph per latent-attention scheme, or nothing when the run has none."""
    blocks = []
    for scheme in latent_schemes(results):
        blocks.append(
            f"- **{label(results, scheme)}**: quality {quality_summary(results, scheme, RIVALS)}."
            f"{seed_quality(results, scheme)} Retrieval: {retrieval_summary(results, scheme, RIVALS)}. "
            f"Memory: {_memory(results, scheme)}.{_prefill_and_budget(results, scheme)}"
            f"{latency_summary(results, scheme, RIVALS)}{speculation_summary(results, scheme, RIVALS)}"
            f"{reuse_summary(results, scheme, RIVALS)}{not_measured_summary(results, scheme)}"
        )
    if not blocks:
        return ""
    return (
        "**What latent attention costs and buys** (the served seed-1234 model's figures unless a figure says "
        "it is over seeds. One latent and one rotated key shared by every head cached a token, keys and "
        "values up-projected from the latent; against " + ", ".join(RIVALS) + ")\n\n" + "\n".join(blocks) + "\n"
    )
