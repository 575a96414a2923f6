"""The servers a comparison measures: the model repository they serve, how they are started, and
what they say about their models."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from contract.manifest import MANIFEST, Manifest
from contract.names import SeedModel, seed_model_name
from export.repository import ExportOptions, model_variants
from export.repository import run as export_run
from export.sources import rope_scaled_name, training_seed
from loadtest.study.results import Results
from models.checkpoints import WEIGHTS_DIR
from models.config import RopeScaling
from models.train_config import TrainConfig
from service.api import generation_pb2 as pb
from service.process import ServerProcess

ROPE_SCALINGS = ("linear", "ntk", "yarn")
SERVER_LIMITS = (
    "--max-new-tokens-limit", "4096", "--max-sequence-tokens", "4096", "--max-batch-size", "64", "--max-queue", "512",
)  # fmt: skip


# Every prompt computed in full, and no cached prompt blocks in the KV bytes: the servers of the sections
# that price computing prompts (latency, load) or what a policy's rows hold (cache) keep no prefix cache.
COMPUTED = ("--no-prefix-cache",)


@dataclass(frozen=True)
class Repository:
    """What a comparison serves from its model repository: rope's scaling variants, and each
    scheme's models, one a training seed (the served one first; `<scheme>@seed<N>`, contract.names)."""

    rope_variants: list[str]
    models: dict[str, list[str]]
    seeds: dict[str, list[int]]

    def extra(self, scheme: str) -> list[str]:
        """The scheme's further training seeds' model names (not the served one)."""
        return self.models.get(scheme, [scheme])[1:]


def ensure_repository(
    repository: Path,
    schemes: list[str],
    scaling_multiples: tuple[float, ...],
    extra_seeds: bool = True,
    weights: Path = WEIGHTS_DIR,
) -> Repository:
    """Export any missing model from `weights`: the schemes, rope's scaling variants and (with
    `extra_seeds`) every further training seed of the schemes there; say which models each scheme has
    (with `extra_seeds`, every `<scheme>@seed<N>` in the repository too).

    The variants are derived from the repository's rope graphs by rewriting their rotary constants
    (export/rope_variants.py) rather than traced again, so adding them is cheap.
    """
    scalings = [f"{kind}:{m:g}" for kind in ROPE_SCALINGS for m in scaling_multiples] if "rope" in schemes else []
    names = [rope_scaled_name(RopeScaling.parse(s)) for s in scalings]
    options = ExportOptions(weights=weights, out=repository, schemes=tuple(schemes), rope_scaling=tuple(scalings),
                            verify=False, fp16=False, extra_seeds=extra_seeds)  # fmt: skip
    missing = tuple(spec.name for spec in model_variants(options) if not (repository / spec.name / MANIFEST).is_file())
    if missing:
        export_run(replace(options, names=missing))
    found = [SeedModel.parse(p.name) for p in repository.iterdir() if (p / MANIFEST).is_file()] if extra_seeds else []
    extra = {scheme: sorted(m.seed for m in found if m.scheme == scheme and m.seed is not None) for scheme in schemes}
    models = {scheme: [scheme, *(seed_model_name(scheme, seed) for seed in extra[scheme])] for scheme in schemes}
    seeds = {scheme: [served_seed(repository / scheme), *extra[scheme]] for scheme in schemes}
    return Repository(names, models, seeds)


def served_seed(folder: Path) -> int:
    """The training seed of a scheme's served model: its manifest's, else its weights' training.json's
    (an export from before manifests recorded it), else the recipe's default."""
    seed = Manifest.load(folder).training_seed
    if seed is None:
        training = WEIGHTS_DIR / folder.name / "training.json"
        seed = training_seed(json.loads(training.read_text())) if training.is_file() else None
    return TrainConfig().seed if seed is None else seed


def generate(
    server: ServerProcess, model: str, prompt: str, new_tokens: int, timeout: float = 300
) -> pb.GenerateResponse:
    return server.stub.Generate(
        pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=new_tokens), timeout=timeout
    )


def servable(limit: int, prompt: str, new_tokens: int) -> bool:
    return not limit or len(prompt.encode()) + 1 + new_tokens <= limit


def start(repository: Path, threads: int, models: list[str], *flags: str) -> ServerProcess:
    """A server of `models` (the first names it) with the comparison's limits, not yet serving."""
    return ServerProcess(repository, "--models", *models, *SERVER_LIMITS, *flags, threads=threads)


@contextmanager
def serving(repository: Path, threads: int, schemes: list[str], *flags: str) -> Iterator[dict[str, ServerProcess]]:
    """One server per scheme (its peak memory is that scheme's alone), all started together and
    stopped together."""
    servers: dict[str, ServerProcess] = {}
    try:
        for scheme in schemes:
            servers[scheme] = start(repository, threads, [scheme], *flags)
        for scheme, server in servers.items():
            server.wait_serving()
            generate(server, scheme, "def main():\n", 2)  # warm: a first call is not a measurement
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def model_info(server: ServerProcess, scheme: str, results: Results) -> pb.ModelInfo:
    """The served model's description, recorded in the results."""
    info = {m.name: m for m in server.stub.ListModels(pb.ListModelsRequest(), timeout=30).models}[scheme]
    results.models[scheme] = {
        "max_positions": info.max_positions or None, "kv_bytes_per_token": info.kv_cache_bytes_per_token,
        "kv_bytes_per_sequence": info.kv_cache_bytes_per_sequence,
        "kv_capacity_bytes": info.kv_cache_capacity_bytes, "train_context": info.train_context,
    }  # fmt: skip
    return info


def served_limits(servers: dict[str, ServerProcess], results: Results) -> dict[str, int]:
    """Each served scheme's position limit (0: none); its description goes into the results."""
    return {scheme: model_info(server, scheme, results).max_positions for scheme, server in servers.items()}
