"""Training command on a tiny config: files written, budget recorded, loss goes down."""

from __future__ import annotations

import json
from pathlib import Path

from models.train import main
from models.transformer import Transformer


def test_tiny_training_run_writes_weights_config_and_log(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\n" * 400)
    out = tmp_path / "weights"
    args = ["--scheme", "alibi", "--steps", "40", "--batch-size", "4", "--context", "32", "--d-model", "32",
            "--n-layers", "1", "--eval-interval", "20", "--eval-windows", "4", "--warmup-steps", "5",
            "--corpus", str(corpus), "--out", str(out)]  # fmt: skip
    main(args)
    folder = out / "alibi"
    assert {p.name for p in folder.iterdir()} >= {
        "model.safetensors",
        "config.json",
        "train_log.jsonl",
        "training.json",
    }
    log = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 40
    evaluations = [entry["val_bpb"] for entry in log if "val_bpb" in entry]
    assert len(evaluations) == 2
    assert log[-1]["train_bpb"] < log[0]["train_bpb"] - 1.0
    summary = json.loads((folder / "training.json").read_text())
    assert summary["command"].startswith("python -m models.train --scheme alibi")
    assert summary["tokens_seen"] == 40 * 4 * 32
    assert len(summary["corpus"]["sha256"]["train"]) == 64
    model = Transformer.load(folder)
    assert model.config.train_context == 32 and model.config.scheme == "alibi"
