"""The one recipe for all six on a lent GPU, as one prepared command for the `device` tool:

    python3 -m models.device_recipe --out "$OUT" --device cuda --budget-seconds 720

The recipe is read from the shipped weights' own `training.json` (its `command`), so a GPU run
cannot drift from what the CPU run trained; only `--out` and `--device` change (on CUDA
models.train trains in bf16 autocast, and `training.json` records the device and precision). The
six schemes train side by side, one process each on the one device. A scheme that has not
finished when the budget runs out is stopped at its last checkpoint (written every
`--checkpoint-interval` steps), so a later run continues it with `--resume`. Each scheme's
folder comes back as `<out>/<scheme>.tar.gz`: the tool returns at most 8 files.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from contract.cli import HelpFormatter
from models.checkpoints import WEIGHTS_DIR, trained_schemes, without_options


def recipe_arguments(scheme: str, weights: Path = WEIGHTS_DIR) -> list[str]:
    """The recorded recipe's options for `scheme`, without --scheme, --out and --device."""
    command = json.loads((weights / scheme / "training.json").read_text())["command"]
    words = shlex.split(command)[3:]  # after `python -m models.train`
    return without_options(words, {"--scheme", "--out", "--device"})


def train_all(out: Path, work: Path, device: str, budget_seconds: float, extra: list[str]) -> dict[str, int | None]:
    """Start every scheme, wait up to the budget, stop the rest, pack each folder. Exit codes by
    scheme (None: stopped at the budget)."""
    processes = {}
    schemes = trained_schemes()  # the ones with a recorded recipe (a scheme still in training has none yet)
    for scheme in schemes:
        command = [sys.executable, "-m", "models.train", "--scheme", scheme, *recipe_arguments(scheme), *extra]
        command += ["--out", str(work), "--device", device, "--resume", "--threads", "1"]
        log = (work / f"{scheme}.stdout").open("w")
        processes[scheme] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + budget_seconds
    codes: dict[str, int | None] = {}
    for scheme, process in processes.items():
        try:
            codes[scheme] = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)  # its last checkpoint stays; --resume continues from it
            process.wait()
            codes[scheme] = None
    out.mkdir(parents=True, exist_ok=True)
    for scheme in schemes:
        with tarfile.open(out / f"{scheme}.tar.gz", "w:gz") as archive:
            for path in [work / scheme, work / f"{scheme}.stdout"]:
                if path.exists():
                    archive.add(path, arcname=path.relative_to(work))
    return codes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.device_recipe", description=__doc__,
                                     formatter_class=HelpFormatter)  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="where the <scheme>.tar.gz files go ($OUT)")
    parser.add_argument(
        "--work", type=Path, default=Path("device-training"), help="training folder (--out of each run)"
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="what models.train runs on")
    parser.add_argument("--budget-seconds", type=float, default=720, help="stop what has not finished by then")
    args, extra = parser.parse_known_args(argv)  # anything else goes to models.train (e.g. --steps for a trial)
    args.work.mkdir(parents=True, exist_ok=True)
    codes = train_all(args.out, args.work, args.device, args.budget_seconds, extra)
    for scheme, code in codes.items():
        print(f"{scheme:<12}{'stopped at the budget (checkpoint kept)' if code is None else f'exit {code}'}")
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
