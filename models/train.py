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
import json
import math
import shlex
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import get_args, get_type_hints

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F
from tqdm import tqdm

from contract.cli import HelpFormatter
from models.checkpoints import (
    CHECKPOINT,
    LOG,
    SUMMARY,
    Record,
    RunProgress,
    earlier_runs,
    finished_run,
    kept_log,
    load_checkpoint,
    recipe_command,
    restore_checkpoint,
    save_checkpoint,
    tokens_seen,
    training_summary,
)
from models.copy_probe import PREFIX, copy_accuracy
from models.corpus import Corpus, load_corpus
from models.data import batch_generator, sample_batch
from models.distributed import Runtime, record_rank_state, start_runtime
from models.evaluation import evaluation_windows, windows_bits_per_byte
from models.positional import SCHEMES, matched_config
from models.train_config import FIELD_CHOICES, FIELD_HELP, PROBE_DISTANCES, TrainConfig
from models.transformer import Transformer


@dataclass
class Training:
    """What an optimizer step works on."""

    model: Transformer
    trained: torch.nn.Module  # the model, or its DistributedDataParallel wrapper
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast: torch.autocast


def initial_model(scheme: str, cfg: TrainConfig) -> tuple[Transformer, list[Record], str]:
    """A fresh model of the configured size, or the weights in `--init-from`; with the runs behind
    it and their log's lines."""
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    if not cfg.init_from:
        assert cfg.d_model is not None and cfg.n_layers is not None and cfg.n_heads is not None
        config = matched_config(
            scheme,
            d_model=cfg.d_model,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            train_context=cfg.context,
            latent_dim=cfg.latent_dim,
            latent_rope_dim=cfg.latent_rope_dim,
        )
        return Transformer(config), [], ""
    source = Path(cfg.init_from) / scheme
    runs, log_text = earlier_runs(source)
    model = Transformer.load(source)
    if model.config.train_context != cfg.context:
        raise ValueError(f"{source} was trained at context {model.config.train_context}, not {cfg.context}")
    return model, runs, log_text


def prepare(model: Transformer, cfg: TrainConfig, runtime: Runtime) -> Training:
    """The model on its device in training mode, wrapped for the processes, and its optimizer."""
    model.to(runtime.device).train().attend_with_fused_kernel()
    trained = runtime.wrap(model)
    # fused: one kernel over all parameters (PyTorch >= 2.4 on CPU), faster per step than one per tensor
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay, fused=True
    )
    return Training(model, trained, optimizer, runtime.grad_scaler(), runtime.autocast())


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def planted_windows(step: int, cfg: TrainConfig) -> int:
    """Windows per micro-batch that get planted repeats at `step`."""
    return round(cfg.copy_share_at(step) * cfg.batch_size)


def optimizer_step(training: Training, step: int, stream: np.ndarray, cfg: TrainConfig, runtime: Runtime) -> Tensor:
    """One optimizer step over `grad_accum` micro-batches. Returns, summed over the processes, the
    nats and count of all targets, then of the targets only copying predicts (float64, 4)."""
    for group in training.optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)
    planted = planted_windows(step, cfg)
    generator = batch_generator(cfg.seed, runtime.rank, step)
    totals = torch.zeros(4, dtype=torch.float64, device=runtime.device)
    for micro in range(cfg.grad_accum):
        batch = sample_batch(stream, cfg.batch_size, cfg.context, generator, planted, cfg.copy_spans, cfg.copy_span_max)
        inputs, targets, copied = (tensor.to(runtime.device) for tensor in batch)  # each (B, context)
        last = micro == cfg.grad_accum - 1
        # Gradients are averaged across ranks only on the last micro-step.
        with nullcontext() if last or runtime.world == 1 else training.trained.no_sync():  # type: ignore[operator]
            with training.autocast:
                logits, _ = training.trained(inputs)
            # (B * context,)
            losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
            training.scaler.scale(losses.mean() / cfg.grad_accum).backward()
        losses = losses.detach().double()
        counts = losses.new_tensor([losses.numel(), int(copied.sum())])
        totals += torch.stack([losses.sum(), counts[0], losses[copied.flatten()].sum(), counts[1]])
    training.scaler.unscale_(training.optimizer)
    torch.nn.utils.clip_grad_norm_(training.model.parameters(), cfg.grad_clip)
    training.scaler.step(training.optimizer)
    training.scaler.update()
    training.optimizer.zero_grad(set_to_none=True)
    runtime.sum_over_ranks(totals)
    return totals


def step_record(step: int, totals: Tensor, cfg: TrainConfig, run_index: int) -> Record:
    """The log line of optimizer step `step` (0-based), before any evaluation."""
    record: Record = {"step": step + 1, "train_bpb": float(totals[0] / totals[1]) / math.log(2)}
    record["lr"] = learning_rate(step, cfg)
    if cfg.copy_share or cfg.copy_share_start:
        record["copy_share"] = planted_windows(step, cfg) / cfg.batch_size
        if totals[3] > 0:
            record["copy_bpb"] = float(totals[2] / totals[3]) / math.log(2)
    if run_index:
        record["run"] = run_index
    return record


def copy_curve_point(model: Transformer, text: bytes, trials: int) -> dict[str, float]:
    """Copy accuracy at PROBE_DISTANCES on held-out (validation) text: one point of the emergence curves."""
    if not trials or len(text) <= PREFIX + max(PROBE_DISTANCES):  # too short to plant a trial in
        return {}
    model.eval()
    point = {f"copy_{d}": copy_accuracy(model, text, d, trials) for d in PROBE_DISTANCES}
    model.train()
    return point


def checkpoint_due(done: int, last_step: int, cfg: TrainConfig) -> bool:
    """After `done` steps: at the end of a piece that stops early, and every `checkpoint_interval`
    steps before the end."""
    if done == last_step < cfg.steps:
        return True
    return bool(cfg.checkpoint_interval) and done % cfg.checkpoint_interval == 0 and done < cfg.steps


def progress_after(start: RunProgress, done: int, val_bpb: float, command: str, started: float) -> RunProgress:
    """The run after `done` steps, with this piece (`command`, begun at time `started`) among its pieces."""
    piece = {"command": command, "steps": [start.step, done], "train_seconds": round(time.time() - started, 1)}
    seconds = start.train_seconds + time.time() - started
    return RunProgress(start.runs, [*start.pieces, piece], done, seconds, val_bpb)


def run_record(
    scheme: str, cfg: TrainConfig, runtime: Runtime, model: Transformer, command: str, progress: RunProgress
) -> Record:
    """This run's entry in training.json's `runs`; `progress` is the run at its last step."""
    shape = {key: getattr(model.config, key) for key in ("d_model", "n_layers", "n_heads")}
    return {
        "command": recipe_command(command),
        "pieces": progress.pieces if len(progress.pieces) > 1 else None,  # a run in one piece lists none
        "init_from": str(Path(cfg.init_from) / scheme) if cfg.init_from else None,
        "val_bpb": progress.val_bpb,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.grad_accum * runtime.world * cfg.context,
        "train_seconds": round(progress.train_seconds, 1),
        "train_config": asdict(cfg) | {"scheme": scheme} | shape,
        "recipe": cfg.recipe(),
        "processes": runtime.world,
        "effective_batch": cfg.batch_size * cfg.grad_accum * runtime.world,
        "device": runtime.device.type,
        "precision": runtime.precision,
    }


def train_scheme(scheme: str, cfg: TrainConfig, corpus: Corpus, command: str, runtime: Runtime) -> Record:
    """Train one scheme to `--steps` (this piece: to `--stop-at`) in <out>/<scheme>/; returns its
    training.json, or where the piece stopped."""
    out = Path(cfg.out) / scheme
    if cfg.resume and (summary := finished_run(out, cfg.recipe())) is not None:
        tqdm.write(f"{scheme}: {out} already holds this recipe's {cfg.steps} steps")
        return summary
    model, runs, log_text = initial_model(scheme, cfg)
    training = prepare(model, cfg, runtime)
    start = RunProgress(runs)
    log_path = out / LOG
    checkpoint = load_checkpoint(out, cfg.recipe()) if cfg.resume else None
    if checkpoint is not None:
        start = restore_checkpoint(checkpoint, model, training.optimizer, training.scaler)
        log_text = kept_log(log_path.read_text() if log_path.exists() else "", len(start.runs), start.step)
    validation = evaluation_windows(corpus.splits["validation"], cfg.eval_windows, cfg.context)
    probe_text = corpus.text_bytes("validation")
    if runtime.main:
        out.mkdir(parents=True, exist_ok=True)
        log_path.write_text(log_text)
        if checkpoint is None:
            (out / CHECKPOINT).unlink(missing_ok=True)  # another run's: it must not be resumed into this log
    last_step = cfg.stop_at or cfg.steps
    tokens_per_step = cfg.batch_size * cfg.grad_accum * runtime.world * cfg.context
    tokens_before = tokens_seen(start.runs)
    val_bpb = start.val_bpb
    started = time.time()
    bar = tqdm(range(start.step, last_step), initial=start.step, total=cfg.steps, desc=f"train {scheme}",
               unit="step", dynamic_ncols=True, disable=not runtime.main)  # fmt: skip
    for step in bar:
        totals = optimizer_step(training, step, corpus.splits["train"], cfg, runtime)
        if not runtime.main:
            continue
        record = step_record(step, totals, cfg, len(start.runs))
        if (step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps:
            val_bpb = windows_bits_per_byte(model, *validation)
            record["val_bpb"] = val_bpb
            record |= copy_curve_point(model, probe_text, cfg.probe_trials)
            record["tokens"] = tokens_before + (step + 1) * tokens_per_step
            record["elapsed_s"] = round(start.train_seconds + time.time() - started, 1)
            bar.set_postfix(val_bpb=f"{val_bpb:.3f}")
        with log_path.open("a") as log:
            log.write(json.dumps(record) + "\n")
        if checkpoint_due(step + 1, last_step, cfg):
            state = progress_after(start, step + 1, val_bpb, command, started)
            save_checkpoint(out / CHECKPOINT, cfg.recipe(), state, model, training.optimizer, training.scaler)
    end = progress_after(start, last_step, val_bpb, command, started)
    if last_step < cfg.steps:
        runtime.barrier()
        seconds = round(end.train_seconds, 1)
        return {"scheme": scheme, "stopped_at": last_step, "val_bpb": val_bpb, "train_seconds": seconds}
    record_rank_state(scheme, model, runtime)
    run = run_record(scheme, cfg, runtime, model, command, end)
    summary = training_summary(scheme, model.num_parameters(), corpus.describe(), start.runs, run)
    if runtime.main:
        model.cpu().save(out)
        (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
        (out / CHECKPOINT).unlink(missing_ok=True)
    runtime.barrier()
    return summary


def _option_type(name: str) -> type:
    """What an option parses to: its field's type, without `| None`."""
    hint = get_type_hints(TrainConfig)[name]
    return next((kind for kind in get_args(hint) if kind is not type(None)), hint)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The command line as a TrainConfig: one option per field, model dimensions from the preset."""
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
        runtime.close()
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
