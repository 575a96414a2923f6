"""Copy probe: does a model repeat a random span it saw D bytes earlier?

A random 16-character span of the span alphabet (`models.spans`) is planted in held-out text and
written again after D bytes of that text; the score is the share of the repeat's last 8 characters
the model predicts (greedy, teacher-forced). Nothing but copying predicts them: a model that cannot
copy scores near 0 (at best chance, which is 1/len(alphabet), by guessing), one that copies
perfectly 1.0. Test bits per byte at the training context comes with it, since teaching a model to
copy must not cost it the text.

    python -m models.copy_probe --weights models/weights
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from contract.cli import HelpFormatter
from models.checkpoints import WEIGHTS_DIR
from models.corpus import load_corpus
from models.data import SPAN_BYTES
from models.evaluation import evaluation_windows, windows_bits_per_byte
from models.positional import SCHEMES
from models.tokenizer import TOKENIZER
from models.transformer import Transformer

DISTANCES = (32, 64, 128, 256)
SPAN = 16  # planted characters
SCORED = 8  # of which the last ones are scored: by then the model has seen enough to find the span
PREFIX = 40  # bytes of text before the first copy, so it does not sit at the start

# A model maps input ids (B, T) to (logits (B, T, vocab), anything).
Model = Callable[[Tensor], tuple[Tensor, object]]


def copy_trials(text: bytes, distance: int, trials: int, seed: int = 0) -> Tensor:
    """(trials, 1 + PREFIX + SPAN + distance + SPAN) ids: BOS, text, span, `distance` bytes of text, span."""
    generator = np.random.default_rng([seed, distance])
    natural = PREFIX + distance
    rows = []
    for _ in range(trials):
        start = int(generator.integers(0, len(text) - natural))
        filler = np.frombuffer(text[start : start + natural], dtype=np.uint8).astype(np.int64)
        span = generator.choice(SPAN_BYTES, size=SPAN).astype(np.int64)
        rows.append(np.concatenate([[TOKENIZER.bos_token_id], filler[:PREFIX], span, filler[PREFIX:], span]))
    return torch.from_numpy(np.stack(rows))


@torch.no_grad()
def copy_accuracy(model: Model, text: bytes, distance: int, trials: int = 48, seed: int = 0, batch: int = 16) -> float:
    """Share of the repeat's last SCORED characters that are the model's greedy next-byte guess."""
    ids = copy_trials(text, distance, trials, seed)
    correct = 0
    for i in range(0, trials, batch):
        chunk = ids[i : i + batch]
        logits, _ = model(chunk[:, :-1])
        guesses = logits[:, -SCORED:].argmax(dim=-1)  # predictions of the last SCORED ids
        correct += int((guesses == chunk[:, -SCORED:]).sum())
    return correct / (trials * SCORED)


def probe_length(distance: int) -> int:
    """Positions one trial at `distance` needs."""
    return 1 + PREFIX + SPAN + distance + SPAN


def probe(
    model: Transformer,
    text: bytes,
    test_stream: np.ndarray,
    distances: tuple[int, ...] = DISTANCES,
    trials: int = 48,
    bpb_windows: int = 128,
    seed: int = 0,
) -> dict[str, object]:
    """Copy accuracy per distance (None where a bounded scheme has no positions for it) and
    test bits per byte over `bpb_windows` evenly spaced windows at the training context."""
    model.eval()
    limit = model.config.max_positions
    copy = {
        str(d): None if limit is not None and probe_length(d) > limit else copy_accuracy(model, text, d, trials, seed)
        for d in distances
    }
    context = model.config.train_context
    inputs, targets = evaluation_windows(test_stream, bpb_windows, context)
    return {
        "copy": copy,
        "trials": trials,
        "test_bpb": windows_bits_per_byte(model, inputs, targets),
        "bpb_windows": bpb_windows,
    }


def scheme_folders(weights: Path) -> list[Path]:
    """A folder of weights, or a folder of <scheme>/ folders (in scheme order)."""
    if (weights / "config.json").exists():
        return [weights]
    return [weights / scheme for scheme in SCHEMES if (weights / scheme / "config.json").exists()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m models.copy_probe", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--weights", type=Path, default=WEIGHTS_DIR, help="a scheme's folder, or a folder of them")
    parser.add_argument("--distances", type=int, nargs="+", default=list(DISTANCES), help="bytes between the copies")
    parser.add_argument("--trials", type=int, default=48, help="planted spans per distance")
    parser.add_argument("--bpb-windows", type=int, default=128, help="test windows for bits per byte")
    parser.add_argument("--seed", type=int, default=0, help="seed of the spans and their places")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here, by scheme")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folders = scheme_folders(args.weights)
    if not folders:
        parser.error(f"--weights {args.weights}: no config.json there or in a <scheme>/ folder")
    corpus = load_corpus()
    text = corpus.text_bytes("test")
    distances = tuple(args.distances)
    print(f"{'scheme':<12}" + "".join(f"{'D=' + str(d):>8}" for d in distances) + f"{'test bpb':>10}")
    results: dict[str, object] = {}
    for folder in folders:
        model = Transformer.load(folder)
        result = probe(model, text, corpus.splits["test"], distances, args.trials, args.bpb_windows, args.seed)
        results[model.config.scheme] = result
        copy: dict[str, float | None] = result["copy"]  # type: ignore[assignment]
        cells = "".join(f"{'-' if copy[str(d)] is None else format(copy[str(d)], '.2f'):>8}" for d in distances)
        print(f"{model.config.scheme:<12}{cells}{result['test_bpb']:>10.3f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
