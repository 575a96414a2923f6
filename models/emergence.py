"""Copy-emergence curves: when does each scheme start to copy, in training tokens?

`python -m models.train` logs copy accuracy at D = 32 and 128 bytes (`models.copy_probe` on
validation text) and validation bits per byte at every evaluation. This module reads those logs
back: one curve per scheme, the first evaluation at which it copies (accuracy >= `COPIES` at both
distances), and the recipe's cap (its last step) for any scheme that never does. The comparison
report draws them; `python -m models.emergence --weights DIR` prints the table while a run goes on.

Standard library only: the report reads the curves without torch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from contract.cli import HelpFormatter

SCHEMES = ("sinusoidal", "learned", "relative", "rope", "alibi", "none")  # models.positional.SCHEMES' order
DISTANCES = (32, 128)  # models.train_config.PROBE_DISTANCES
COPIES = 0.8  # copy accuracy at every probed distance that counts as copying (issue 23's bar)
DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights"


def _tokens_per_step(config: dict[str, object], processes: int = 1) -> int:
    return int(config["batch_size"]) * int(config.get("grad_accum") or 1) * processes * int(config["context"])  # type: ignore[call-overload]


def _config(folder: Path) -> tuple[dict[str, object], int, int, str | None]:
    """(train config, processes, tokens before this run, command) of the run behind the log's last
    lines, from training.json; empty while the run goes on (its log's points carry their tokens)."""
    summary_path = folder / "training.json"
    if not summary_path.exists():
        return {}, 1, 0, None
    summary = json.loads(summary_path.read_text())
    runs = summary.get("runs") or [summary]
    last = runs[-1]
    earlier = sum(int(run.get("tokens_seen") or 0) for run in runs[:-1])
    return last.get("train_config") or {}, int(last.get("processes") or 1), earlier, last.get("command")


def curve(folder: Path, fallback_tokens_per_step: int | None = None) -> dict[str, object] | None:
    """One scheme's emergence curve from `folder`/train_log.jsonl: every evaluation of its last run with
    step, tokens (counting earlier runs'), validation bpb and copy accuracy per distance; the first
    point that copies; the steps done and the cap. None when the log has no copy-probe points."""
    log_path = folder / "train_log.jsonl"
    if not log_path.exists():
        return None
    entries = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    if not entries:
        return None
    run = max(entry.get("run", 0) for entry in entries)
    entries = [entry for entry in entries if entry.get("run", 0) == run]
    config, processes, tokens_before, command = _config(folder)
    finished = bool(config) and int(config.get("steps", -1)) == entries[-1]["step"]  # type: ignore[call-overload]
    per_step = _tokens_per_step(config, processes) if config else fallback_tokens_per_step
    if per_step is None:  # a run still going: its points that carry tokens give the rate
        counted = next((entry for entry in entries if "tokens" in entry), None)
        per_step = None if counted is None else (counted["tokens"] - tokens_before) // counted["step"]
    keys = [f"copy_{d}" for d in DISTANCES]
    points = [
        {
            "step": entry["step"],
            "tokens": entry.get("tokens", None if per_step is None else tokens_before + entry["step"] * per_step),
            "val_bpb": entry.get("val_bpb"),
            **{str(d): entry[key] for d, key in zip(DISTANCES, keys, strict=True)},
        }
        for entry in entries
        if all(key in entry for key in keys)
    ]
    if not points:
        return None
    copying = next((p for p in points if all(p[str(d)] >= COPIES for d in DISTANCES)), None)
    return {
        "points": points,
        "copies_at": None if copying is None else {"step": copying["step"], "tokens": copying["tokens"]},
        "steps_done": entries[-1]["step"],
        "cap_steps": config.get("steps") if finished else None,
        "finished": finished,
        "command": command,
    }


def curves(weights: Path = DEFAULT_WEIGHTS, tokens_per_step: int | None = None) -> dict[str, dict[str, object]]:
    """Every scheme's curve under `weights`/<scheme>/ that has one, in scheme order."""
    found = {scheme: curve(weights / scheme, tokens_per_step) for scheme in SCHEMES}
    return {scheme: data for scheme, data in found.items() if data is not None}


def table(data: dict[str, dict[str, object]]) -> str:
    """Markdown: per scheme, tokens until it copies (or the cap / the steps so far), and its last point."""
    lines = [
        f"| scheme | copies (>= {COPIES} at D = {' and '.join(map(str, DISTANCES))}) after | at step | "
        + " | ".join(f"last copy @ {d}" for d in DISTANCES)
        + " | last val bpb | steps done |",
        "|---|---|---|" + "---|" * len(DISTANCES) + "---|---|",
    ]
    for scheme, entry in data.items():
        points: list[dict[str, object]] = entry["points"]  # type: ignore[assignment]
        last = points[-1]
        copies: dict[str, object] | None = entry["copies_at"]  # type: ignore[assignment]
        if copies is not None:
            when, step = _tokens(copies["tokens"]), str(copies["step"])
        elif entry["finished"]:
            when, step = f"never, up to the cap ({_tokens(last['tokens'])})", "-"
        else:
            when, step = f"not yet ({_tokens(last['tokens'])} so far)", "-"
        cells = " | ".join(f"{last[str(d)]:.2f}" for d in DISTANCES)
        bpb = "-" if last["val_bpb"] is None else f"{last['val_bpb']:.3f}"
        done = f"{entry['steps_done']}" + (f" of {entry['cap_steps']}" if entry["cap_steps"] else "")
        lines.append(f"| {scheme} | {when} | {step} | {cells} | {bpb} | {done} |")
    return "\n".join(lines)


def _tokens(value: object) -> str:
    return "-" if value is None else f"{int(value) / 1e6:.1f} M tokens"  # type: ignore[call-overload]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m models.emergence", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--weights", type=Path, default=DEFAULT_WEIGHTS, help="a folder of <scheme>/ folders")
    parser.add_argument(
        "--tokens-per-step", type=int, default=None,
        help="tokens per optimizer step of a run still going (no training.json yet), e.g. 16 x 256",
    )  # fmt: skip
    args = parser.parse_args(argv)
    data = curves(args.weights, args.tokens_per_step)
    if not data:
        parser.error(f"--weights {args.weights}: no training log with copy-probe points")
    print(table(data))


if __name__ == "__main__":
    main()
