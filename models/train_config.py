"""What `python -m models.train` trains: the presets, the config (one field per command-line option)
and what each field means, as `--help` says it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from models.checkpoints import CHECKPOINT, WEIGHTS_DIR
from models.data import SPAN_MIN
from models.sizes import SIZES

# Model sizes by name (models.sizes, shared with the served sizes); all keep the 256-byte training
# context. `tiny` is the shipped family.
PRESETS: dict[str, dict[str, int]] = SIZES

# Copy-probe distances logged at every evaluation: the emergence curves.
PROBE_DISTANCES = (32, 128)

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
    latent_dim: int | None = None  # None = ModelConfig's (mla only)
    latent_rope_dim: int | None = None
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
    "latent_dim": "mla: width of the cached latent, d_c (default: d_model / 2)",
    "latent_rope_dim": "mla: width of the decoupled rotated key and query parts, d_R (default: head_dim / 2)",
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
