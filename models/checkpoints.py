"""What training keeps on disk: where the weights live, the resumable checkpoint of a run in
progress, and the records beside the weights (`training.json`, `train_log.jsonl`).

A scheme's folder holds `model.safetensors` and `config.json` (written by `Transformer.save`), the
log (one JSON line per optimizer step), `training.json` (every run behind the weights in `runs`)
and, while a run is unfinished, `checkpoint.pt`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from models.positional import SCHEMES

# The shipped weights; POSENC_WEIGHTS_DIR points elsewhere (e.g. a fresh training run).
WEIGHTS_DIR = Path(os.environ.get("POSENC_WEIGHTS_DIR", Path(__file__).resolve().parent / "weights"))


def trained_schemes(weights: Path = WEIGHTS_DIR) -> tuple[str, ...]:
    """The schemes, in SCHEMES order, whose weights lie in `weights`: what export and the comparison
    take by default, so a scheme still in training is left out rather than failing them."""
    return tuple(scheme for scheme in SCHEMES if (weights / scheme / "model.safetensors").is_file())
CHECKPOINT = "checkpoint.pt"
SUMMARY = "training.json"
LOG = "train_log.jsonl"

Record = dict[str, object]


@dataclass
class RunProgress:
    """How far a scheme's run has come: what a checkpoint keeps beside the tensors."""

    runs: list[Record]  # the runs behind the weights it started from (their training.json's `runs`)
    pieces: list[Record] = field(default_factory=list)  # earlier pieces of this run: command, steps, seconds
    step: int = 0  # optimizer steps done
    train_seconds: float = 0.0  # training time of the earlier pieces
    val_bpb: float = math.nan  # the last evaluation's


def save_checkpoint(
    path: Path,
    recipe: Record,
    progress: RunProgress,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
) -> None:
    """Written beside the old one and renamed over it: a run killed mid-write keeps the last good one."""
    state = {
        "step": progress.step,
        "recipe": recipe,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "runs": progress.runs,
        "pieces": progress.pieces,
        "train_seconds": progress.train_seconds,
        "val_bpb": progress.val_bpb,
    }
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def load_checkpoint(out: Path, recipe: Record) -> dict[str, object] | None:
    """The checkpoint in `out` to resume from, or None; refuses one written under another recipe."""
    path = out / CHECKPOINT
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved = state["recipe"]
    differing = sorted(key for key in recipe if saved.get(key) != recipe[key])
    if differing:
        shown = ", ".join(f"{key}={saved.get(key)!r} there, {recipe[key]!r} now" for key in differing)
        raise SystemExit(f"--resume: {path} belongs to another recipe ({shown}); use another --out or remove it")
    return state


def restore_checkpoint(
    state: dict[str, object], model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> RunProgress:
    """Put the checkpoint's tensors and torch's random state back; returns its progress."""
    model.load_state_dict(state["model"])  # type: ignore[arg-type]
    optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
    scaler.load_state_dict(state["scaler"])  # type: ignore[arg-type]
    torch.set_rng_state(state["torch_rng"])  # type: ignore[arg-type]
    return RunProgress(
        runs=state["runs"],  # type: ignore[arg-type]
        pieces=state["pieces"],  # type: ignore[arg-type]
        step=int(state["step"]),  # type: ignore[call-overload]
        train_seconds=float(state["train_seconds"]),  # type: ignore[arg-type]
        val_bpb=float(state["val_bpb"]),  # type: ignore[arg-type]
    )


def finished_run(out: Path, recipe: Record) -> Record | None:
    """The summary in `out` if its last run is this recipe carried to the end (nothing to resume)."""
    summary_path = out / SUMMARY
    if (out / CHECKPOINT).exists() or not summary_path.exists():
        return None
    summary = json.loads(summary_path.read_text())
    last = (summary.get("runs") or [{}])[-1]
    return summary if last.get("recipe") == recipe else None


def earlier_runs(folder: Path) -> tuple[list[Record], str]:
    """The runs behind the weights in `folder` (from its training.json) and its log's lines.

    Weights trained before `runs` existed count as one run made of their top-level fields.
    """
    summary_path, log_path = folder / SUMMARY, folder / LOG
    log = log_path.read_text() if log_path.exists() else ""
    if not summary_path.exists():
        return [{"init": str(folder)}], log
    summary = json.loads(summary_path.read_text())
    fields = ("command", "val_bpb", "tokens_seen", "train_seconds", "train_config")
    return summary.get("runs") or [{key: summary.get(key) for key in fields}], log


def kept_log(log_text: str, run_index: int, last_step: int) -> str:
    """The log's lines up to `last_step` of run `run_index` (a resumed piece redoes the rest)."""
    entries = [(line, json.loads(line)) for line in log_text.splitlines() if line.strip()]
    kept = [line for line, entry in entries if entry.get("run", 0) != run_index or entry["step"] <= last_step]
    return "".join(line + "\n" for line in kept)


def tokens_seen(runs: list[Record]) -> int:
    """Training tokens behind the weights, over every run."""
    return sum(int(run.get("tokens_seen") or 0) for run in runs)  # type: ignore[call-overload]


def training_summary(scheme: str, parameters: int, corpus: Record, runs: list[Record], run: Record) -> Record:
    """training.json for weights that `run` trained from the weights behind `runs`: the last run's
    figures at the top, every run in `runs`."""
    return {
        "scheme": scheme,
        "command": run["command"],
        "parameters": parameters,
        "val_bpb": run["val_bpb"],
        "tokens_seen": tokens_seen(runs) + int(run["tokens_seen"]),  # type: ignore[call-overload]
        "train_seconds": run["train_seconds"],
        "train_config": run["train_config"],
        "corpus": corpus,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
        "runs": [*runs, run],
    }


def without_options(words: list[str], options: set[str], flags: frozenset[str] = frozenset()) -> list[str]:
    """`words` (a command line, split) without `options` and their values (`--option value` or
    `--option=value`); `flags` among them take no value."""
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word.split("=", 1)[0] in options:
            skip = word not in flags and "=" not in word  # the option's value follows it
        else:
            kept.append(word)
    return kept


def recipe_command(command: str) -> str:
    """`command` without the options that only say how it was carried out (--resume, --stop-at,
    --threads, ...): the one command that trains the same weights in one go."""
    control = {"--resume", "--stop-at", "--threads", "--checkpoint-interval"}
    return shlex.join(without_options(shlex.split(command), control, frozenset({"--resume"})))
