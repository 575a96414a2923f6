"""Train the model family on CPU: `python -m models.train --scheme NAME|all`.

Every scheme gets the same budget (parameter count within 1%, steps, batch, tokens, seed)
and writes `model.safetensors`, `config.json`, `train_log.jsonl` and `training.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

from models.cli import HelpFormatter
from models.corpus import Corpus, load_corpus
from models.positional import SCHEMES, matched_config
from models.tokenizer import TOKENIZER
from models.transformer import Transformer

# The shipped weights; POSENC_WEIGHTS_DIR points elsewhere (e.g. a fresh training run).
WEIGHTS_DIR = Path(os.environ.get("POSENC_WEIGHTS_DIR", Path(__file__).resolve().parent / "weights"))


@dataclass
class TrainConfig:
    scheme: str = "all"
    steps: int = 1500
    batch_size: int = 32
    context: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_windows: int = 64
    seed: int = 1234
    threads: int = 0  # 0 = all cores
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    corpus: str | None = None
    out: str = str(WEIGHTS_DIR)


def sample_batch(
    stream: np.ndarray, batch: int, context: int, generator: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows, each starting with BOS: inputs (B, context), next-token targets (B, context)."""
    starts = generator.integers(0, len(stream) - context, size=batch)
    windows = np.stack([stream[s : s + context] for s in starts]).astype(np.int64)  # (B, context)
    bos = np.full((batch, 1), TOKENIZER.bos_token_id, dtype=np.int64)
    tokens = torch.from_numpy(np.concatenate([bos, windows], axis=1))  # (B, context + 1)
    return tokens[:, :-1], tokens[:, 1:]


def evaluation_windows(stream: np.ndarray, count: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Evenly spaced windows of a held-out stream: the same ones for every scheme and step."""
    starts = np.linspace(0, len(stream) - context - 1, count).astype(np.int64)
    windows = np.stack([stream[s : s + context] for s in starts]).astype(np.int64)
    bos = np.full((count, 1), TOKENIZER.bos_token_id, dtype=np.int64)
    tokens = torch.from_numpy(np.concatenate([bos, windows], axis=1))
    return tokens[:, :-1], tokens[:, 1:]


@torch.no_grad()
def bits_per_byte(model: Transformer, inputs: torch.Tensor, targets: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token cross entropy in bits (one token = one byte)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(inputs), batch):
        logits, _ = model(inputs[i : i + batch])
        loss = F.cross_entropy(logits.flatten(0, 1), targets[i : i + batch].flatten(), reduction="sum")
        total += float(loss)
        count += targets[i : i + batch].numel()
    model.train()
    return total / count / math.log(2)


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_scheme(scheme: str, cfg: TrainConfig, corpus: Corpus, command: str) -> dict[str, object]:
    torch.manual_seed(cfg.seed)
    generator = np.random.default_rng(cfg.seed)
    config = matched_config(
        scheme, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, train_context=cfg.context
    )
    model = Transformer(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    val_inputs, val_targets = evaluation_windows(corpus.splits["validation"], cfg.eval_windows, cfg.context)
    out = Path(cfg.out) / scheme
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "train_log.jsonl"
    log_path.write_text("")
    started = time.time()
    progress = tqdm(range(cfg.steps), desc=f"train {scheme}", unit="step", dynamic_ncols=True)
    val_bpb = float("nan")
    for step in progress:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        inputs, targets = sample_batch(corpus.splits["train"], cfg.batch_size, cfg.context, generator)
        logits, _ = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        record: dict[str, object] = {"step": step + 1, "train_bpb": loss.item() / math.log(2), "lr": group["lr"]}
        if (step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps:
            val_bpb = bits_per_byte(model, val_inputs, val_targets)
            record["val_bpb"] = val_bpb
            record["elapsed_s"] = round(time.time() - started, 1)
            progress.set_postfix(val_bpb=f"{val_bpb:.3f}")
        with log_path.open("a") as log:
            log.write(json.dumps(record) + "\n")
    model.save(out)
    summary = {
        "scheme": scheme,
        "command": command,
        "parameters": model.num_parameters(),
        "val_bpb": val_bpb,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.context,
        "train_seconds": round(time.time() - started, 1),
        "train_config": asdict(cfg) | {"scheme": scheme},
        "corpus": corpus.describe(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# What each TrainConfig field means, as --help says it.
FIELD_HELP = {
    "steps": "optimizer steps per scheme",
    "batch_size": "training windows per step",
    "context": "training window, bytes (the models' training context)",
    "lr": "peak learning rate (AdamW)",
    "min_lr_ratio": "final learning rate as a share of the peak, after cosine decay",
    "warmup_steps": "steps of linear warm-up",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "gradient norm clip",
    "eval_interval": "steps between validation runs",
    "eval_windows": "validation windows per run",
    "seed": "seed of initialisation and batches",
    "threads": "torch threads (0: all cores)",
    "d_model": "model width",
    "n_layers": "transformer layers",
    "n_heads": "attention heads",
    "corpus": "text file or folder to train on (default: the installed standard library's .py files)",
    "out": "folder that gets one <scheme>/ folder of weights each (env POSENC_WEIGHTS_DIR)",
}


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(prog="python -m models.train", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--scheme", default=defaults.scheme, choices=(*SCHEMES, "all"), help="scheme to train, or all of them in turn"
    )
    for name, value in asdict(defaults).items():
        if name == "scheme":
            continue
        kind = type(value) if value is not None else str
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value, help=FIELD_HELP[name])
    return TrainConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    corpus = load_corpus(Path(cfg.corpus) if cfg.corpus else None)
    command = "python -m models.train " + shlex.join(sys.argv[1:] if argv is None else argv)
    schemes = SCHEMES if cfg.scheme == "all" else (cfg.scheme,)
    results = [train_scheme(scheme, cfg, corpus, command) for scheme in schemes]
    print(f"{'scheme':<12}{'parameters':>12}{'val bpb':>10}{'seconds':>10}")
    for result in results:
        print(
            f"{result['scheme']:<12}{result['parameters']:>12,}{result['val_bpb']:>10.3f}{result['train_seconds']:>10.0f}"
        )


if __name__ == "__main__":
    main()
