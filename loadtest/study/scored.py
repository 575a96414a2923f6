"""The scored sections, through the `Score` RPC one server per scheme (with its further training
seeds beside it, and rope with its scaling variants): quality (bits per byte by context), graded
retrieval probes, cache budgets, on every seed."""

from __future__ import annotations

import random
from pathlib import Path

from tqdm import tqdm

from loadtest.probes import Scorer, copy_text, depth_text, passkey_text
from loadtest.study.budget import Budget
from loadtest.study.cache_budget import measure_cache_budgets, score_bpb
from loadtest.study.held_out import HeldOut
from loadtest.study.kv_footprint import kv_footprint
from loadtest.study.results import Results, Retrieval
from loadtest.study.serving import COMPUTED, Repository, model_info, start
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
    server: ServerProcess, model: str, train_context: int, rope_variants: list[str], held_out: HeldOut,
    budget: Budget, results: Results, progress: tqdm,
) -> None:  # fmt: skip
    """Bits per byte at each context multiple; for rope's served model, each scaling variant at its own factor."""
    contexts = [int(m * train_context) for m in budget.context_multiples]
    results.quality[model] = {
        f"{m:g}": score_bpb(server, model, held_out.windows(c, budget.score_windows))
        for m, c in zip(budget.context_multiples, contexts, strict=True)
    }
    if model == "rope":
        for name in rope_variants:
            factor = float(name.rsplit("-x", 1)[1])
            length = int(factor * train_context)
            texts = held_out.windows(length, budget.score_windows)
            results.quality[name] = {f"{factor:g}": score_bpb(server, name, texts)}
            progress.update()


def measure_model(
    server: ServerProcess, model: str, sections: set[str], rope_variants: list[str], held_out: HeldOut,
    budget: Budget, results: Results, progress: tqdm,
) -> None:  # fmt: skip
    """The scored sections asked for, on one served model (a scheme's, or a further seed of it), each
    section on the same held-out texts for every model (whichever sections run)."""
    info = model_info(server, model, results)
    if "quality" in sections:
        progress.set_postfix(model=model, part="quality")
        measure_quality(server, model, info.train_context, rope_variants, held_out, budget, results, progress)
        progress.update()
    if "retrieval" in sections:
        progress.set_postfix(model=model, part="retrieval")
        results.span_alphabet = SPAN_ALPHABET
        results.retrieval[model] = measure_retrieval(
            server, model, info.max_positions, info.train_context, held_out.again(), budget
        )
        progress.update()
    if "cache" in sections:
        progress.set_postfix(model=model, part="cache budgets")
        results.cache_budget[model] = measure_cache_budgets(
            server, model, info, held_out.again().text, held_out.windows, budget.cache_plan()
        )
        if model in results.schemes:  # the architecture's, not a seed's: the served model's only
            results.kv_footprint[model] = kv_footprint(Path(server.repository) / model)
        progress.update()


def measure_scored_sections(
    repository: Path, threads: int, schemes: list[str], sections: set[str], served: Repository,
    held_out: HeldOut, budget: Budget, results: Results, progress: tqdm,
) -> None:  # fmt: skip
    """The scored sections asked for, scheme after scheme, each on a server of its own with the
    scheme's further training seeds (and rope's scaling variants) beside it: every seed's figures
    are kept under its model name."""
    for scheme in schemes:
        models = served.extra(scheme) if budget.seeds_only else [scheme, *served.extra(scheme)]
        if not models:
            continue
        variants = served.rope_variants if scheme == "rope" and not budget.seeds_only else []
        # No prefix cache: the cache section's cost is what each policy's row holds, not cached prompts.
        server = start(repository, threads, [scheme, *served.extra(scheme), *variants], *COMPUTED)
        try:
            server.wait_serving()
            for model in models:
                measure_model(server, model, sections, variants, held_out, budget, results, progress)
        finally:
            server.stop()
