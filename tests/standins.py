"""Stand-ins for further training seeds (issue 55) until real ones are trained: a scheme's shipped
weights, perturbed a little so that two seeds' figures differ, in the layout training leaves them in
(`<weights>/seed<N>/<scheme>/`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.checkpoints import WEIGHTS_DIR


def seed_weights(weights: Path, scheme: str, seed: int, noise: float = 0.02) -> Path:
    """`weights/seed<seed>/<scheme>`: the shipped weights of `scheme`, each tensor moved by `noise`
    times its own spread (a seeded draw), and training.json recording `seed`."""
    folder = weights / f"seed{seed}" / scheme
    folder.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "train_log.jsonl"):
        shutil.copy(WEIGHTS_DIR / scheme / name, folder / name)
    training = json.loads((WEIGHTS_DIR / scheme / "training.json").read_text())
    training["train_config"]["seed"] = seed
    (folder / "training.json").write_text(json.dumps(training))
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(WEIGHTS_DIR / scheme / "model.safetensors")
    moved = {
        name: (t + noise * t.float().std().nan_to_num() * torch.randn(t.shape, generator=generator)).to(t.dtype)
        if t.is_floating_point() and t.numel() > 1 else t
        for name, t in tensors.items()
    }  # fmt: skip
    save_file(moved, folder / "model.safetensors")
    return folder


def linked_weights(tmp_path: Path, schemes: tuple[str, ...]) -> Path:
    """A weights folder whose schemes link to the shipped ones (seed folders are added beside them)."""
    weights = tmp_path / "weights"
    weights.mkdir()
    for scheme in schemes:
        (weights / scheme).symlink_to(WEIGHTS_DIR / scheme)
    return weights
