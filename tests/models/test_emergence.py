"""Copy-emergence curves: read back from a real (tiny) training run's log, found where the log says,
and drawn and tabled by the report from exactly those points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.palette import style
from loadtest.report.figures import figure_emergence
from loadtest.report.tables import training_section
from models import emergence
from models.train import main


def write_log(folder: Path, copies: list[tuple[float, float]], steps: int | None = None) -> None:
    folder.mkdir(parents=True)
    lines = []
    for index, (near, far) in enumerate(copies, start=1):
        lines.append({"step": 10 * index, "train_bpb": 3.0, "val_bpb": 3.0 - index / 10, "copy_32": near,
                      "copy_128": far, "tokens": 40960 * index})  # fmt: skip
        lines.append({"step": 10 * index + 1, "train_bpb": 3.0})  # a step without evaluation
    (folder / "train_log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if steps is not None:
        config = {"steps": steps, "batch_size": 16, "context": 256, "grad_accum": 1}
        summary = {"runs": [{"command": "python -m models.train --scheme x", "train_config": config, "processes": 1}]}
        (folder / "training.json").write_text(json.dumps(summary))


def test_the_first_point_that_copies_at_both_distances_and_the_cap(tmp_path: Path) -> None:
    write_log(tmp_path / "alibi", [(0.1, 0.0), (0.9, 0.5), (0.85, 0.81), (0.95, 0.9)], steps=41)
    write_log(tmp_path / "rope", [(0.0, 0.0), (0.02, 0.01)], steps=21)
    write_log(tmp_path / "none", [(0.0, 0.0)])  # still training: no training.json
    data = emergence.curves(tmp_path)
    assert list(data) == ["rope", "alibi", "none"]  # scheme order
    assert data["alibi"]["copies_at"] == {"step": 30, "tokens": 3 * 40960}
    assert [p["step"] for p in data["alibi"]["points"]] == [10, 20, 30, 40]
    assert data["rope"]["copies_at"] is None and data["rope"]["finished"] and data["rope"]["cap_steps"] == 21
    assert data["none"]["copies_at"] is None and not data["none"]["finished"]
    rows = {line.split(" | ")[0].strip("| "): line for line in emergence.table(data).splitlines()[2:]}
    assert "0.1 M tokens" in rows["alibi"] and "| 30 |" in rows["alibi"]
    assert "never, up to the cap" in rows["rope"] and "not yet" in rows["none"]


def test_a_training_run_logs_the_curve_the_report_draws_and_tables(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\n" * 400)
    main(["--scheme", "relative", "--steps", "12", "--batch-size", "4", "--context", "32", "--d-model", "32",
          "--n-layers", "1", "--eval-interval", "4", "--eval-windows", "4", "--warmup-steps", "2",
          "--copy-share", "0.5", "--probe-trials", "4", "--threads", "1", "--corpus", str(corpus),
          "--out", str(tmp_path / "weights")])  # fmt: skip
    log = [
        json.loads(line) for line in (tmp_path / "weights" / "relative" / "train_log.jsonl").read_text().splitlines()
    ]
    evaluated = [entry for entry in log if "copy_32" in entry]
    data = emergence.curves(tmp_path / "weights")
    curve = data["relative"]
    assert [p["step"] for p in curve["points"]] == [entry["step"] for entry in evaluated] == [4, 8, 12]
    assert [p["tokens"] for p in curve["points"]] == [step * 4 * 32 for step in (4, 8, 12)]
    assert curve["finished"] and curve["command"].startswith("python -m models.train --scheme relative")
    figure = figure_emergence(data)
    near, far, bpb = figure.axes
    (line,) = [line for line in near.get_lines() if line.get_label() == "relative"]
    assert list(line.get_ydata()) == [entry["copy_32"] for entry in evaluated]
    assert list(line.get_xdata()) == pytest.approx([step * 4 * 32 / 1e6 for step in (4, 8, 12)])
    assert line.get_color() == style("relative").color
    (far_line,) = [line for line in far.get_lines() if line.get_label() == "relative"]
    assert list(far_line.get_ydata()) == [entry["copy_128"] for entry in evaluated]
    (bpb_line,) = [line for line in bpb.get_lines() if line.get_label() == "relative"]
    assert list(bpb_line.get_ydata()) == [entry["val_bpb"] for entry in evaluated]
    section = training_section(data)
    assert curve["command"] in section
    row = next(line for line in section.splitlines() if line.startswith("| relative |"))
    assert (
        f"| {evaluated[-1]['copy_32']:.2f} | {evaluated[-1]['copy_128']:.2f} | {evaluated[-1]['val_bpb']:.3f} |" in row
    )
