"""Train the model family: `python -m models.train --scheme NAME|all`.

Every scheme gets the same budget (parameter count within 1%, steps, batch, tokens, seed)
and writes `model.safetensors`, `config.json`, `train_log.jsonl` and `training.json`.

The same code scales past one CPU: `--device cuda` trains in mixed precision (bf16 autocast
where the GPU has it, else fp16 with a gradient scaler), `--preset` picks a larger model
(the training context stays 256), and `torchrun --nproc-per-node N -m models.train ...` runs
N processes under DistributedDataParallel (gloo on CPU, NCCL on CUDA). Each process draws
`--batch-size` windows per micro-step from its own seed (`--seed` + rank) and gradients are
averaged over the N processes and `--grad-accum` micro-steps, so one optimizer step sees
batch-size x grad-accum x N windows. `--steps`, the warm-up and the cosine decay count
optimizer steps whatever N is, and the learning rate is not rescaled: to keep a one-process
recipe on N processes, divide `--batch-size` or `--grad-accum` by N. Rank 0 alone evaluates,
logs and saves.

Continuing from trained weights (`--init-from models/weights`) with planted repeats in part of
the windows (`--copy-share`) is the recipe that teaches the shipped models to copy; the new
`training.json` lists every run behind the weights in `runs` and the log keeps the earlier
runs' lines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import string
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import get_args, get_type_hints

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from contract.cli import HelpFormatter
from models.corpus import Corpus, load_corpus
from models.positional import SCHEMES, matched_config
from models.tokenizer import TOKENIZER
from models.transformer import Transformer

# The shipped weights; POSENC_WEIGHTS_DIR points elsewhere (e.g. a fresh training run).
WEIGHTS_DIR = Path(os.environ.get("POSENC_WEIGHTS_DIR", Path(__file__).resolve().parent / "weights"))

# Model sizes by name; all keep the 256-byte training context. `tiny` is the shipped family.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 128, "n_layers": 4, "n_heads": 4},  # 0.83 M parameters
    "small": {"d_model": 256, "n_layers": 6, "n_heads": 8},  # 4.8 M
    "base": {"d_model": 384, "n_layers": 8, "n_heads": 6},  # 14.3 M
    "large": {"d_model": 512, "n_layers": 12, "n_heads": 8},  # 38 M
}

# Test-only: a folder where every rank writes the sha256 of its final weights, so a test can
# check that DistributedDataParallel kept the ranks identical.
RANK_STATE_ENV = "POSENC_RANK_STATE_DIR"

# Planted repeats: random alphanumeric spans of 6-16 bytes, each written twice in a window,
# at least 4 bytes apart.
ALPHANUMERIC = np.frombuffer((string.ascii_letters + string.digits).encode(), dtype=np.uint8)
SPAN_MIN = 6
SPAN_GAP = 4


# Fields that say how a run is carried out, not what it trains: they may differ between the pieces
# of one resumed run.
RUN_CONTROL_FIELDS = (
    "scheme",
    "resume",
    "stop_at",
    "threads",
    "checkpoint_interval",
    "eval_interval",
    "probe_trials",
    "out",
)
# Copy-probe distances logged at every evaluation: the emergence curves.
PROBE_DISTANCES = (32, 128)
CHECKPOINT = "checkpoint.pt"


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
    preset: str = "tiny"
    d_model: int | None = None  # None = the preset's
    n_layers: int | None = None
    n_heads: int | None = None
    grad_accum: int = 1
    device: str = "auto"
    init_from: str | None = None
    copy_share: float = 0.0
    copy_share_start: float | None = None  # None = copy_share throughout
    copy_spans: int = 3
    copy_span_max: int = 16  # longest planted span, bytes (the shortest is SPAN_MIN)
    corpus: str | None = None
    out: str = str(WEIGHTS_DIR)
    probe_trials: int = 48  # copy-probe trials per distance at every evaluation (0: no probe)
    checkpoint_interval: int = 250  # steps between resumable checkpoints (0: none)
    stop_at: int | None = None  # end this piece after this step (the schedule still spans `steps`)
    resume: bool = False

    def recipe(self) -> dict[str, object]:
        """The fields that define what is trained: a resumed piece must match its checkpoint's."""
        return {k: v for k, v in asdict(self).items() if k not in RUN_CONTROL_FIELDS}

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be at least 1, got {self.grad_accum}")
        if self.stop_at is not None and not 0 < self.stop_at <= self.steps:
            raise ValueError(f"stop_at must lie in 1..steps ({self.steps}), got {self.stop_at}")
        for share in (self.copy_share, self.copy_share_start):
            if share is not None and not 0.0 <= share <= 1.0:
                raise ValueError(f"copy shares are fractions of the batch, got {share}")

    def with_preset(self) -> TrainConfig:
        """The config with every model dimension left unset taken from the preset."""
        shape = {name: value for name, value in PRESETS[self.preset].items() if getattr(self, name) is None}
        return replace(self, **shape)

    def copy_share_at(self, step: int) -> float:
        """Share of windows with planted repeats: linear from `copy_share_start` to `copy_share`."""
        if self.copy_share_start is None:
            return self.copy_share
        return self.copy_share_start + (self.copy_share - self.copy_share_start) * step / max(1, self.steps - 1)


@dataclass
class Runtime:
    """Where this process trains: its device, its rank among `world` processes, its precision."""

    device: torch.device
    rank: int = 0
    world: int = 1
    autocast_dtype: torch.dtype | None = None  # mixed precision on CUDA, None = float32

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def precision(self) -> str:
        if self.autocast_dtype is None:
            return "float32"
        return str(self.autocast_dtype).removeprefix("torch.") + " autocast"


def start_runtime(requested: str) -> Runtime:
    """Pick the device and, under torchrun (WORLD_SIZE > 1), join the process group."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {requested!r}")
    use_cuda = torch.cuda.is_available() if requested == "auto" else requested == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        dtype: torch.dtype | None = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        device, dtype = torch.device("cpu"), None
    if world > 1:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Runtime(device, rank, world, dtype)


def plant_repeats(window: np.ndarray, spans: int, generator: np.random.Generator, longest: int = 16) -> np.ndarray:
    """Write up to `spans` random alphanumeric spans into `window` (in place), each twice.

    Returns a mask over the window of the bytes that only copying predicts: every repeat
    but its first byte. A span whose places overlap an earlier one is left out.
    """
    size = len(window)
    taken = np.zeros(size, dtype=bool)
    copied = np.zeros(size, dtype=bool)
    for _ in range(spans):
        length = int(generator.integers(SPAN_MIN, longest + 1))
        if 2 * length + SPAN_GAP > size:
            continue
        first = int(generator.integers(0, size - 2 * length - SPAN_GAP + 1))
        second = int(generator.integers(first + length + SPAN_GAP, size - length + 1))
        if taken[first : first + length].any() or taken[second : second + length].any():
            continue
        span = generator.choice(ALPHANUMERIC, size=length)
        window[first : first + length] = span
        window[second : second + length] = span
        taken[first : first + length] = taken[second : second + length] = True
        copied[second + 1 : second + length] = True
    return copied


def sample_batch(
    stream: np.ndarray,
    batch: int,
    context: int,
    generator: np.random.Generator,
    planted: int = 0,
    spans: int = 3,
    longest: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random windows, each starting with BOS: inputs (B, context), next-token targets (B, context)
    and the mask of targets only copying predicts (B, context); the first `planted` windows get
    planted repeats. With none planted the draws are exactly those of a plain text batch."""
    starts = generator.integers(0, len(stream) - context, size=batch)
    windows = np.stack([stream[s : s + context] for s in starts]).astype(np.int64)  # (B, context)
    copied = np.zeros(windows.shape, dtype=bool)
    for row in range(planted):
        copied[row] = plant_repeats(windows[row], spans, generator, longest)
    bos = np.full((batch, 1), TOKENIZER.bos_token_id, dtype=np.int64)
    tokens = torch.from_numpy(np.concatenate([bos, windows], axis=1))  # (B, context + 1)
    return tokens[:, :-1], tokens[:, 1:], torch.from_numpy(copied)


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
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(inputs), batch):
        logits, _ = model(inputs[i : i + batch].to(device))
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), targets[i : i + batch].flatten().to(device), reduction="sum"
        )
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


def state_sha256(model: torch.nn.Module) -> str:
    """One digest of every tensor in the state dict, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def earlier_runs(folder: Path) -> tuple[list[dict[str, object]], str]:
    """The runs behind the weights in `folder` (from its training.json) and its log's lines.

    Weights trained before `runs` existed count as one run made of their top-level fields.
    """
    summary_path, log_path = folder / "training.json", folder / "train_log.jsonl"
    log = log_path.read_text() if log_path.exists() else ""
    if not summary_path.exists():
        return [{"init": str(folder)}], log
    summary = json.loads(summary_path.read_text())
    fields = ("command", "val_bpb", "tokens_seen", "train_seconds", "train_config")
    return summary.get("runs") or [{key: summary.get(key) for key in fields}], log


def batch_generator(cfg: TrainConfig, rank: int, step: int) -> np.random.Generator:
    """The batches of one optimizer step on one rank, seeded by (seed, rank, step): a resumed run
    draws exactly the batches an uninterrupted one would, with no generator state to carry."""
    return np.random.default_rng([cfg.seed, rank, step])


def save_checkpoint(path: Path, state: dict[str, object]) -> None:
    """Written beside the old one and renamed over it: a run killed mid-write keeps the last good one."""
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def load_checkpoint(out: Path, cfg: TrainConfig) -> dict[str, object] | None:
    """The checkpoint to resume from, or None; refuses one written under another recipe."""
    path = out / CHECKPOINT
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    recipe, saved = cfg.recipe(), state["recipe"]
    differing = sorted(key for key in recipe if saved.get(key) != recipe[key])
    if differing:
        shown = ", ".join(f"{key}={saved.get(key)!r} there, {recipe[key]!r} now" for key in differing)
        raise SystemExit(f"--resume: {path} belongs to another recipe ({shown}); use another --out or remove it")
    return state


def finished_run(out: Path, cfg: TrainConfig) -> dict[str, object] | None:
    """The summary in `out` if its last run is this recipe carried to the end (nothing to resume)."""
    summary_path = out / "training.json"
    if (out / CHECKPOINT).exists() or not summary_path.exists():
        return None
    summary = json.loads(summary_path.read_text())
    last = (summary.get("runs") or [{}])[-1]
    return summary if last.get("recipe") == cfg.recipe() else None


def kept_log(log_text: str, run_index: int, last_step: int) -> str:
    """The log's lines up to `last_step` of run `run_index` (a resumed piece redoes the rest)."""
    entries = [(line, json.loads(line)) for line in log_text.splitlines() if line.strip()]
    kept = [line for line, entry in entries if entry.get("run", 0) != run_index or entry["step"] <= last_step]
    return "".join(line + "\n" for line in kept)


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


def train_scheme(scheme: str, cfg: TrainConfig, corpus: Corpus, command: str, runtime: Runtime) -> dict[str, object]:
    out = Path(cfg.out) / scheme
    if cfg.resume and (summary := finished_run(out, cfg)) is not None:
        tqdm.write(f"{scheme}: {out} already holds this recipe's {cfg.steps} steps")
        return summary
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    runs: list[dict[str, object]] = []
    log_text = ""
    if cfg.init_from:
        source = Path(cfg.init_from) / scheme
        runs, log_text = earlier_runs(source)
        model = Transformer.load(source)
        if model.config.train_context != cfg.context:
            raise ValueError(f"{source} was trained at context {model.config.train_context}, not {cfg.context}")
    else:
        assert cfg.d_model is not None and cfg.n_layers is not None and cfg.n_heads is not None
        config = matched_config(
            scheme, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, train_context=cfg.context
        )
        model = Transformer(config)
    model.to(runtime.device).train().attend_with_fused_kernel()
    trained: torch.nn.Module = model
    if runtime.world > 1:
        cuda = runtime.device.type == "cuda"
        trained = DistributedDataParallel(model, device_ids=[runtime.device.index] if cuda else None)
    # fused: one kernel over all parameters (PyTorch >= 2.4 on CPU); with fused attention, 1.13x (2 threads)
    # to 1.23x (1 thread) the tokens/s of the step before (README, Training speed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay, fused=True
    )
    scaler = torch.amp.GradScaler(runtime.device.type, enabled=runtime.autocast_dtype == torch.float16)
    autocast = torch.autocast(
        runtime.device.type, dtype=runtime.autocast_dtype, enabled=runtime.autocast_dtype is not None
    )
    log_path = out / "train_log.jsonl"
    first_step, seconds_before, val_bpb = 0, 0.0, float("nan")
    pieces: list[dict[str, object]] = []  # the commands that carried this run, with the steps of each
    checkpoint = load_checkpoint(out, cfg) if cfg.resume else None
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])  # type: ignore[arg-type]
        optimizer.load_state_dict(checkpoint["optimizer"])  # type: ignore[arg-type]
        scaler.load_state_dict(checkpoint["scaler"])  # type: ignore[arg-type]
        torch.set_rng_state(checkpoint["torch_rng"])  # type: ignore[arg-type]
        runs = checkpoint["runs"]  # type: ignore[assignment]
        pieces = checkpoint["pieces"]  # type: ignore[assignment]
        first_step, seconds_before = int(checkpoint["step"]), float(checkpoint["train_seconds"])  # type: ignore[arg-type]
        val_bpb = float(checkpoint["val_bpb"])  # type: ignore[arg-type]
        log_text = kept_log(log_path.read_text() if log_path.exists() else "", len(runs), first_step)
    val_inputs, val_targets = evaluation_windows(corpus.splits["validation"], cfg.eval_windows, cfg.context)
    probe_text = corpus.text_bytes("validation")
    if runtime.main:
        out.mkdir(parents=True, exist_ok=True)
        log_path.write_text(log_text)
        if checkpoint is None:
            (out / CHECKPOINT).unlink(missing_ok=True)  # another run's: it must not be resumed into this log
    run_index = len(runs)
    last_step = cfg.stop_at or cfg.steps
    tokens_per_step = cfg.batch_size * cfg.grad_accum * runtime.world * cfg.context
    tokens_before = sum(int(r.get("tokens_seen") or 0) for r in runs)  # type: ignore[call-overload]
    started = time.time()
    progress = tqdm(
        range(first_step, last_step),
        initial=first_step,
        total=cfg.steps,
        desc=f"train {scheme}",
        unit="step",
        dynamic_ncols=True,
        disable=not runtime.main,
    )
    for step in progress:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        planted = round(cfg.copy_share_at(step) * cfg.batch_size)
        generator = batch_generator(cfg, runtime.rank, step)
        # bits and bytes over all targets, then over the targets only copying predicts
        totals = torch.zeros(4, dtype=torch.float64, device=runtime.device)
        for micro in range(cfg.grad_accum):
            inputs, targets, copied = sample_batch(
                corpus.splits["train"],
                cfg.batch_size,
                cfg.context,
                generator,
                planted,
                cfg.copy_spans,
                cfg.copy_span_max,
            )
            inputs, targets = inputs.to(runtime.device), targets.to(runtime.device)
            copied = copied.to(runtime.device)
            last = micro == cfg.grad_accum - 1
            # Gradients are averaged across ranks only on the last micro-step.
            with nullcontext() if last or runtime.world == 1 else trained.no_sync():  # type: ignore[operator]
                with autocast:
                    logits, _ = trained(inputs)
                losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
                scaler.scale(losses.mean() / cfg.grad_accum).backward()
            losses = losses.detach().double()
            counts = losses.new_tensor([losses.numel(), int(copied.sum())])
            totals += torch.stack([losses.sum(), counts[0], losses[copied.flatten()].sum(), counts[1]])
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if runtime.world > 1:
            dist.all_reduce(totals)
        if not runtime.main:
            continue
        record: dict[str, object] = {"step": step + 1, "train_bpb": float(totals[0] / totals[1]) / math.log(2)}
        record["lr"] = group["lr"]
        if cfg.copy_share or cfg.copy_share_start:
            record["copy_share"] = planted / cfg.batch_size
            if totals[3] > 0:
                record["copy_bpb"] = float(totals[2] / totals[3]) / math.log(2)
        if run_index:
            record["run"] = run_index
        if (step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps:
            val_bpb = bits_per_byte(model, val_inputs, val_targets)
            record["val_bpb"] = val_bpb
            record |= copy_curve_point(model, probe_text, cfg.probe_trials)
            record["tokens"] = tokens_before + (step + 1) * tokens_per_step
            record["elapsed_s"] = round(seconds_before + time.time() - started, 1)
            progress.set_postfix(val_bpb=f"{val_bpb:.3f}")
        with log_path.open("a") as log:
            log.write(json.dumps(record) + "\n")
        piece = {"command": command, "steps": [first_step, step + 1], "train_seconds": round(time.time() - started, 1)}
        piece_ends = step + 1 == last_step < cfg.steps
        if piece_ends or (
            cfg.checkpoint_interval and (step + 1) % cfg.checkpoint_interval == 0 and step + 1 < cfg.steps
        ):
            checkpoint_state = {
                "step": step + 1,
                "recipe": cfg.recipe(),
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "runs": runs,
                "pieces": [*pieces, piece],
                "train_seconds": seconds_before + time.time() - started,
                "val_bpb": val_bpb,
            }
            save_checkpoint(out / CHECKPOINT, checkpoint_state)
    train_seconds = round(seconds_before + time.time() - started, 1)
    if last_step < cfg.steps:
        if runtime.world > 1:
            dist.barrier()
        return {"scheme": scheme, "stopped_at": last_step, "val_bpb": val_bpb, "train_seconds": train_seconds}
    if os.environ.get(RANK_STATE_ENV):
        state_dir = Path(os.environ[RANK_STATE_ENV])
        state_dir.mkdir(parents=True, exist_ok=True)
        (state_dir / f"{scheme}.rank{runtime.rank}.sha256").write_text(state_sha256(model) + "\n")
    tokens = cfg.steps * tokens_per_step
    shape = {key: getattr(model.config, key) for key in ("d_model", "n_layers", "n_heads")}
    final_piece = {
        "command": command,
        "steps": [first_step, cfg.steps],
        "train_seconds": round(time.time() - started, 1),
    }
    run = {
        "command": recipe_command(command),
        "pieces": [*pieces, final_piece] if pieces else None,
        "init_from": str(Path(cfg.init_from) / scheme) if cfg.init_from else None,
        "val_bpb": val_bpb,
        "tokens_seen": tokens,
        "train_seconds": train_seconds,
        "train_config": asdict(cfg) | {"scheme": scheme} | shape,
        "recipe": cfg.recipe(),
        "processes": runtime.world,
        "effective_batch": cfg.batch_size * cfg.grad_accum * runtime.world,
        "device": runtime.device.type,
        "precision": runtime.precision,
    }
    summary = {
        "scheme": scheme,
        "command": run["command"],
        "parameters": model.num_parameters(),
        "val_bpb": val_bpb,
        "tokens_seen": tokens_before + tokens,
        "train_seconds": train_seconds,
        "train_config": run["train_config"],
        "corpus": corpus.describe(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
        "runs": [*runs, run],
    }
    if runtime.main:
        model.cpu().save(out)
        (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / CHECKPOINT).unlink(missing_ok=True)
    if runtime.world > 1:
        dist.barrier()
    return summary


def copy_curve_point(model: Transformer, text: bytes, trials: int) -> dict[str, float]:
    """Copy accuracy at PROBE_DISTANCES on held-out (validation) text: one point of the emergence
    curves. The probe module imports this one, hence the import here."""
    from models.copy_probe import PREFIX, copy_accuracy

    if not trials or len(text) <= PREFIX + max(PROBE_DISTANCES):  # too short to plant a trial in
        return {}

    model.eval()
    point = {f"copy_{d}": copy_accuracy(model, text, d, trials) for d in PROBE_DISTANCES}
    model.train()
    return point


# What each TrainConfig field means, as --help says it.
FIELD_HELP = {
    "steps": "optimizer steps per scheme",
    "batch_size": "training windows per step (per process and micro-step: see --grad-accum)",
    "context": "training window, bytes (the models' training context)",
    "lr": "peak learning rate (AdamW)",
    "min_lr_ratio": "final learning rate as a share of the peak, after cosine decay",
    "warmup_steps": "steps of linear warm-up",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "gradient norm clip",
    "eval_interval": "steps between validation runs",
    "eval_windows": "validation windows per run",
    "seed": "seed of initialisation and batches (rank r of a torchrun draws its batches with seed + r)",
    "threads": "torch threads (0: all cores)",
    "preset": "model size: "
    + ", ".join(f"{name} ({v['n_layers']} x {v['d_model']}, {v['n_heads']} heads)" for name, v in PRESETS.items()),
    "d_model": "model width (default: the preset's)",
    "n_layers": "transformer layers (default: the preset's)",
    "n_heads": "attention heads (default: the preset's)",
    "grad_accum": "micro-steps whose gradients make one optimizer step",
    "device": "auto (CUDA when torch sees a GPU), cpu or cuda; CUDA trains in bf16 or fp16 mixed precision",
    "init_from": "continue from the weights in DIR/<scheme>/ instead of a fresh model (its size wins over --preset)",
    "copy_share": "share of each batch's windows that get planted repeats (random alphanumeric spans, each twice)",
    "copy_share_start": "copy share at the first step, moving linearly to --copy-share by the last (default: constant)",
    "copy_spans": "spans planted per window, each written twice",
    "copy_span_max": f"longest planted span, bytes (the shortest: {SPAN_MIN})",
    "corpus": "text file or folder to train on (default: the installed standard library's .py files)",
    "out": "folder that gets one <scheme>/ folder of weights each (env POSENC_WEIGHTS_DIR)",
    "probe_trials": f"copy-probe trials at D = {', '.join(map(str, PROBE_DISTANCES))} at every evaluation (0: none)",
    "checkpoint_interval": f"steps between resumable checkpoints, <out>/<scheme>/{CHECKPOINT} (0: none)",
    "stop_at": "end this piece after this step, with a checkpoint; the schedule still spans --steps",
    "resume": f"continue each scheme from its {CHECKPOINT} (same recipe), skip schemes already trained to --steps",
}
FIELD_CHOICES: dict[str, tuple[str, ...]] = {"preset": tuple(PRESETS), "device": ("auto", "cpu", "cuda")}


def _option_type(name: str) -> type:
    """What an option parses to: its field's type, without `| None`."""
    hint = get_type_hints(TrainConfig)[name]
    return next((kind for kind in get_args(hint) if kind is not type(None)), hint)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(prog="python -m models.train", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--scheme", default=defaults.scheme, choices=(*SCHEMES, "all"), help="scheme to train, or all of them in turn"
    )
    for name, value in asdict(defaults).items():
        if name == "scheme":
            continue
        if isinstance(value, bool):
            parser.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=FIELD_HELP[name])
            continue
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=_option_type(name),
            default=value,
            choices=FIELD_CHOICES.get(name),
            help=FIELD_HELP[name],
        )
    return TrainConfig(**vars(parser.parse_args(argv))).with_preset()


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    runtime = start_runtime(cfg.device)
    corpus = load_corpus(Path(cfg.corpus) if cfg.corpus else None)
    launcher = f"torchrun --nproc-per-node {runtime.world} -m models.train " if runtime.world > 1 else None
    command = (launcher or "python -m models.train ") + shlex.join(sys.argv[1:] if argv is None else argv)
    schemes = SCHEMES if cfg.scheme == "all" else (cfg.scheme,)
    try:
        results = [train_scheme(scheme, cfg, corpus, command, runtime) for scheme in schemes]
    finally:
        if runtime.world > 1:
            dist.destroy_process_group()
    if not runtime.main:
        return
    print(f"{'scheme':<12}{'parameters':>12}{'val bpb':>10}{'seconds':>10}")
    for result in results:
        if "stopped_at" in result:
            print(f"{result['scheme']:<12}{'stopped at step ' + str(result['stopped_at']):>22}"
                  f"{result['train_seconds']:>10.0f}  (--resume continues)")  # fmt: skip
            continue
        print(
            f"{result['scheme']:<12}{result['parameters']:>12,}{result['val_bpb']:>10.3f}{result['train_seconds']:>10.0f}"
        )


if __name__ == "__main__":
    main()
