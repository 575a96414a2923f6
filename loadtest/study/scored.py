"""The scored sections, through the `Score` RPC one server per scheme (rope with its scaling
variants beside it): quality (bits per byte by context), graded retrieval probes, cache budgets."""

from __future__ import annotations

import random
from pathlib import Path

from tqdm import tqdm

from loadtest.probes import Scorer, copy_text, depth_text, passkey_text
from loadtest.study.budget import Budget
from loadtest.study.cache_budget import measure_cache_budgets, score_bpb
from loadtest.study.held_out import HeldOut
from loadtest.study.results import Results, Retrieval
from loadtest.study.serving import COMPUTED, model_info, start
from models.spans import SPAN_ALPHABET
from service.process import ServerProcess

SECTIONS = ("quality", "retrieval", "cache")


def measure_retrieval(
    server: ServerProcess, model: str, limit: int, train_context: int, held_out: HeldOut, budget: Budget
) -> Retrieval:
    """Every graded probe at every length the budget names (None where the model cannot take it)."""
    rng = random.Random(7)
    scorer = Scorer(server.stub, model, limit)
    trials, lead = budget.retrieval_trials, 64

    def length(multiple: float) -> int:
        return int(multiple * train_context)

    copy = {
        str(length(m)): scorer.accuracy([copy_text(held_out.text, rng, lead, length(m)) for _ in range(trials)])
        for m in budget.copy_distances
    }
    depth = {
        str(length(c)): {
            f"{d:g}": scorer.accuracy([depth_text(held_out.text, rng, length(c), d) for _ in range(trials)])
            for d in budget.retrieval_depths
        }
        for c in budget.depth_contexts
    }
    passkey = {
        str(length(c)): scorer.accuracy([passkey_text(held_out.text, rng, length(c)) for _ in range(trials)])
        for c in budget.passkey_contexts
    }
    window = length(budget.natural_context)
    natural = scorer.natural(held_out.windows(window, max(4, trials // 4)), window)
    return {"copy": copy, "copy_depth": depth, "passkey": passkey, "natural": natural}


def measure_quality(
    server: ServerProcess, scheme: str, train_context: int, rope_variants: list[str], held_out: HeldOut,
    budget: Budget, results: Results, progress: tqdm,
) -> None:  # fmt: skip
    """Bits per byte at each context multiple; for rope, each scaling variant at its own factor."""
    contexts = [int(m * train_context) for m in budget.context_multiples]
    results.quality[scheme] = {
        f"{m:g}": score_bpb(server, scheme, held_out.windows(c, budget.score_windows))
        for m, c in zip(budget.context_multiples, contexts, strict=True)
    }
    if scheme == "rope":
        for name in rope_variants:
            factor = float(name.rsplit("-x", 1)[1])
            length = int(factor * train_context)
            texts = held_out.windows(length, budget.score_windows)
            results.quality[name] = {f"{factor:g}": score_bpb(server, name, texts)}
            progress.update()


def measure_scored_sections(
    repository: Path, threads: int, schemes: list[str], sections: set[str], rope_variants: list[str],
    held_out: HeldOut, budget: Budget, results: Results, progress: tqdm,
) -> None:  # fmt: skip
    """The scored sections asked for, scheme after scheme, each on a server of its own."""
    for scheme in schemes:
        # No prefix cache: the cache section's cost is what each policy's row holds, not cached prompts.
        server = start(repository, threads, [scheme, *(rope_variants if scheme == "rope" else [])], *COMPUTED)
        try:
            server.wait_serving()
            info = model_info(server, scheme, results)
            if "quality" in sections:
                progress.set_postfix(scheme=scheme, part="quality")
                measure_quality(server, scheme, info.train_context, rope_variants, held_out, budget, results, progress)
                progress.update()
            if "retrieval" in sections:
                progress.set_postfix(scheme=scheme, part="retrieval")
                results.span_alphabet = SPAN_ALPHABET
                results.retrieval[scheme] = measure_retrieval(
                    server, scheme, info.max_positions, info.train_context, held_out, budget
                )
                progress.update()
            if "cache" in sections:
                progress.set_postfix(scheme=scheme, part="cache budgets")
                results.cache_budget[scheme] = measure_cache_budgets(
                    server, scheme, info, held_out.text, held_out.windows, budget.cache_plan()
                )
                progress.update()
        finally:
            server.stop()
