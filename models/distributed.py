"""Where a training process runs: its device and precision, and, under torchrun, its rank among
the processes of DistributedDataParallel (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

# Test-only: a folder where every rank writes the sha256 of its final weights, so a test can
# check that DistributedDataParallel kept the ranks identical.
RANK_STATE_ENV = "POSENC_RANK_STATE_DIR"


@dataclass
class Runtime:
    """Where this process trains: its device, its rank among `world` processes, its precision."""

    device: torch.device
    rank: int = 0
    world: int = 1
    autocast_dtype: torch.dtype | None = None  # mixed precision on CUDA, None = float32

    @property
    def main(self) -> bool:
        """Rank 0, the one process that evaluates, logs and saves."""
        return self.rank == 0

    @property
    def precision(self) -> str:
        if self.autocast_dtype is None:
            return "float32"
        return str(self.autocast_dtype).removeprefix("torch.") + " autocast"

    def autocast(self) -> torch.autocast:
        """The forward pass's mixed-precision context (a no-op in float32)."""
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Loss scaling, which only fp16 needs (bf16 keeps float32's exponent range)."""
        return torch.amp.GradScaler(self.device.type, enabled=self.autocast_dtype == torch.float16)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module to train: `model` itself, or under DistributedDataParallel across processes."""
        if self.world == 1:
            return model
        cuda = self.device.type == "cuda"
        return DistributedDataParallel(model, device_ids=[self.device.index] if cuda else None)

    def sum_over_ranks(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over every process, in place."""
        if self.world > 1:
            dist.all_reduce(tensor)

    def barrier(self) -> None:
        """Wait for every process (rank 0 may still be saving)."""
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group."""
        if self.world > 1:
            dist.destroy_process_group()


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


def state_sha256(model: torch.nn.Module) -> str:
    """One digest of every tensor in the state dict, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def record_rank_state(name: str, model: torch.nn.Module, runtime: Runtime) -> None:
    """Under RANK_STATE_ENV, write this rank's digest of `model` as `<name>.rank<r>.sha256` there."""
    if not os.environ.get(RANK_STATE_ENV):
        return
    state_dir = Path(os.environ[RANK_STATE_ENV])
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / f"{name}.rank{runtime.rank}.sha256").write_text(state_sha256(model) + "\n")
