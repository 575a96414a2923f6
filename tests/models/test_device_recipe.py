"""The prepared GPU command (models/device_recipe.py), run on the CPU with a tiny budget: it trains
what the shipped weights' training.json says, and packs each scheme for the device tool's $OUT."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from models.checkpoints import WEIGHTS_DIR, trained_schemes
from models.device_recipe import main, recipe_arguments


def test_the_recipe_is_the_shipped_weights_own() -> None:
    for scheme in trained_schemes():
        arguments = recipe_arguments(scheme)
        recorded = json.loads((WEIGHTS_DIR / scheme / "training.json").read_text())["command"]
        assert " ".join(arguments) in recorded
        assert "--scheme" not in arguments and "--out" not in arguments
        assert arguments[arguments.index("--steps") + 1] == "8000" and "--copy-share" in arguments


@pytest.mark.server  # runs a subprocess
def test_every_scheme_trains_and_comes_back_as_one_archive(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    tiny = ["--steps", "2", "--warmup-steps", "1", "--eval-interval", "2", "--eval-windows", "2", "--probe-trials", "2"]
    code = main(["--out", str(out), "--work", str(work), "--device", "cpu", "--budget-seconds", "600", *tiny])
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{scheme}.tar.gz" for scheme in trained_schemes())
    for scheme in trained_schemes():
        with tarfile.open(out / f"{scheme}.tar.gz") as archive:
            names = set(archive.getnames())
            assert {f"{scheme}/model.safetensors", f"{scheme}/training.json"} <= names, names
            summary = json.load(archive.extractfile(f"{scheme}/training.json"))  # type: ignore[arg-type]
        assert summary["train_config"]["steps"] == 2 and summary["train_config"]["copy_share"] == 0.5
        assert summary["runs"][-1]["device"] == "cpu"


@pytest.mark.server  # runs a subprocess
def test_a_spent_budget_stops_every_scheme_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["--out", str(out), "--work", str(tmp_path / "work"), "--device", "cpu", "--budget-seconds", "0"]) == 1
    assert len(list(out.glob("*.tar.gz"))) == len(trained_schemes())
