"""Training command on a tiny config: files written, budget recorded, loss goes down; presets,
continued and resumed runs."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from models.train import initial_model, main, parse_args
from models.train_config import TrainConfig
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


def test_presets_and_copy_share_schedule() -> None:
    assert asdict(parse_args([])) == asdict(parse_args(["--preset", "tiny"]))
    base = parse_args(["--preset", "base"])
    assert (base.d_model, base.n_layers, base.n_heads) == (384, 8, 6)
    assert parse_args(["--preset", "base", "--n-layers", "2"]).n_layers == 2
    assert parse_args([]).d_model == 128
    latent = parse_args(["--scheme", "mla", "--latent-dim", "56", "--latent-rope-dim", "32"])
    assert (latent.latent_dim, latent.latent_rope_dim) == (56, 32)
    model, _, _ = initial_model("mla", latent)
    assert (model.config.latent_width, model.config.latent_rope_width) == (56, 32)
    assert parse_args([]).latent_dim is None  # ModelConfig's default widths
    constant = TrainConfig(steps=11, copy_share=0.5)
    assert constant.copy_share_at(0) == constant.copy_share_at(10) == 0.5
    curriculum = TrainConfig(steps=11, copy_share=0.25, copy_share_start=1.0)
    assert [curriculum.copy_share_at(s) for s in (0, 10)] == [1.0, 0.25]


def test_continuing_records_every_run_and_keeps_the_log(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\n" * 400)
    common = ["--scheme", "relative", "--batch-size", "4", "--context", "48", "--d-model", "32",
              "--n-layers", "1", "--eval-interval", "10", "--eval-windows", "4", "--warmup-steps", "2",
              "--corpus", str(corpus)]  # fmt: skip
    main([*common, "--steps", "20", "--out", str(tmp_path / "first")])
    main([*common, "--steps", "10", "--grad-accum", "2", "--copy-share", "0.5", "--init-from", str(tmp_path / "first"),
          "--out", str(tmp_path / "second")])  # fmt: skip
    summary = json.loads((tmp_path / "second" / "relative" / "training.json").read_text())
    assert [run["train_config"]["steps"] for run in summary["runs"]] == [20, 10]
    assert summary["runs"][1]["init_from"] == str(tmp_path / "first" / "relative")
    assert summary["runs"][1]["effective_batch"] == 8
    assert summary["tokens_seen"] == 20 * 4 * 48 + 10 * 8 * 48
    assert "--init-from" in summary["command"]
    log = [json.loads(line) for line in (tmp_path / "second" / "relative" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 30 and "run" not in log[0]
    assert all(entry["run"] == 1 and "copy_bpb" in entry for entry in log[20:])
    first = Transformer.load(tmp_path / "first" / "relative").state_dict()
    second = Transformer.load(tmp_path / "second" / "relative").state_dict()
    assert not torch.equal(first["positional.bias.weight"], second["positional.bias.weight"])


def test_a_run_resumed_from_its_checkpoint_equals_one_uninterrupted_run(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\n" * 400)
    common = ["--scheme", "rope", "--steps", "16", "--batch-size", "4", "--context", "32", "--d-model", "32",
              "--n-layers", "1", "--eval-interval", "6", "--eval-windows", "4", "--warmup-steps", "3",
              "--copy-share", "0.5", "--probe-trials", "4", "--threads", "1", "--corpus", str(corpus)]  # fmt: skip
    main([*common, "--out", str(tmp_path / "whole")])
    pieces = ["--checkpoint-interval", "5", "--out", str(tmp_path / "pieces")]
    main([*common, *pieces, "--stop-at", "8"])
    folder = tmp_path / "pieces" / "rope"
    assert (folder / "checkpoint.pt").exists() and not (folder / "training.json").exists()
    # A killed piece: its log ran past the last checkpoint (step 8); resuming redoes those steps.
    with (folder / "train_log.jsonl").open("a") as log:
        log.write(json.dumps({"step": 9, "train_bpb": 0.0}) + "\n")
    main([*common, *pieces, "--resume"])
    assert not (folder / "checkpoint.pt").exists()
    whole = Transformer.load(tmp_path / "whole" / "rope").state_dict()
    resumed = Transformer.load(folder).state_dict()
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)

    def lines(path: Path) -> list[dict[str, object]]:
        entries = [json.loads(line) for line in path.read_text().splitlines()]
        return [{k: v for k, v in entry.items() if k != "elapsed_s"} for entry in entries]

    log = lines(folder / "train_log.jsonl")
    assert log == lines(tmp_path / "whole" / "rope" / "train_log.jsonl")
    assert [entry["step"] for entry in log] == list(range(1, 17))
    assert {"copy_32", "copy_128", "val_bpb"} <= set(log[5]) and "copy_32" not in log[6]
    summary = json.loads((folder / "training.json").read_text())
    assert summary["tokens_seen"] == 16 * 4 * 32 and summary["runs"][-1]["recipe"]["steps"] == 16
    # The recorded command trains these weights in one go; the pieces that did are listed.
    whole_command = json.loads((tmp_path / "whole" / "rope" / "training.json").read_text())["command"]
    assert summary["command"].replace("pieces", "whole") == whole_command
    assert "--resume" not in summary["command"] and "--stop-at" not in summary["command"]
    assert [piece["steps"] for piece in summary["runs"][-1]["pieces"]] == [[0, 8], [8, 16]]
    assert "--resume" in summary["runs"][-1]["pieces"][1]["command"]
    # Resuming a finished recipe trains nothing; resuming under another recipe is refused.
    before = (folder / "model.safetensors").read_bytes()
    main([*common, *pieces, "--resume"])
    assert (folder / "model.safetensors").read_bytes() == before
    main([*common, *pieces, "--stop-at", "4", "--lr", "0.01"])
    with pytest.raises(SystemExit, match=r"another recipe.*lr"):
        main([*common, *pieces, "--resume"])
