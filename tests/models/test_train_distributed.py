"""Training under torchrun: two CPU processes (gloo) end with identical weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.paths import REPOSITORY_ROOT
from models.distributed import RANK_STATE_ENV
from models.train import main

ARGS = ["--scheme", "rope", "--steps", "6", "--batch-size", "4", "--context", "32", "--d-model", "32",
        "--n-layers", "1", "--eval-interval", "3", "--eval-windows", "4", "--warmup-steps", "2",
        "--grad-accum", "2", "--copy-share", "0.5", "--device", "cpu"]  # fmt: skip


@pytest.mark.server  # runs a subprocess
def test_two_gloo_ranks_end_with_identical_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 200)
    paths = ["--corpus", str(corpus), "--out", str(tmp_path / "ddp")]
    env = os.environ | {RANK_STATE_ENV: str(tmp_path / "ddp-state"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*command, "-m", "models.train", *ARGS, *paths],
        cwd=REPOSITORY_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = ((tmp_path / "ddp-state" / f"rope.rank{r}.sha256").read_text() for r in (0, 1))
    assert rank0 == rank1
    assert (tmp_path / "ddp" / "rope" / "model.safetensors").exists()
    assert "torchrun --nproc-per-node 2" in (tmp_path / "ddp" / "rope" / "training.json").read_text()

    # One process with the same arguments sees only rank 0's batches: had rank 1 drawn the
    # same ones, the averaged gradients, and so the weights, would be the same as these.
    monkeypatch.setenv(RANK_STATE_ENV, str(tmp_path / "single-state"))
    main([*ARGS, "--corpus", str(corpus), "--out", str(tmp_path / "single")])
    assert (tmp_path / "single-state" / "rope.rank0.sha256").read_text() != rank0
