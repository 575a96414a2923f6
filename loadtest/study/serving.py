"""The servers a comparison measures: the model repository they serve, how they are started, and
what they say about their models."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from contract.manifest import MANIFEST
from export.repository import ExportOptions, rope_scaled_name
from export.repository import run as export_run
from loadtest.study.results import Results
from models.config import RopeScaling
from service.api import generation_pb2 as pb
from service.process import ServerProcess

ROPE_SCALINGS = ("linear", "ntk", "yarn")
SERVER_LIMITS = (
    "--max-new-tokens-limit", "4096", "--max-sequence-tokens", "4096", "--max-batch-size", "64", "--max-queue", "512",
)  # fmt: skip


# Every prompt computed in full, and no cached prompt blocks in the KV bytes: the servers of the sections
# that price computing prompts (latency, load) or what a policy's rows hold (cache) keep no prefix cache.
COMPUTED = ("--no-prefix-cache",)


def ensure_repository(repository: Path, schemes: list[str], scaling_multiples: tuple[float, ...]) -> list[str]:
    """Export any missing model, including rope scaling variants; return the rope variant names.

    The variants are derived from the repository's rope graphs by rewriting their rotary constants
    (export/rope_variants.py) rather than traced again, so adding them is cheap.
    """
    scalings = [f"{kind}:{m:g}" for kind in ROPE_SCALINGS for m in scaling_multiples] if "rope" in schemes else []
    names = [rope_scaled_name(RopeScaling.parse(s)) for s in scalings]
    missing_schemes = [s for s in schemes if not (repository / s / MANIFEST).is_file()]
    missing_scalings = [s for s, n in zip(scalings, names, strict=True) if not (repository / n / MANIFEST).is_file()]
    if missing_schemes or missing_scalings:
        export_run(
            ExportOptions(
                out=repository,
                schemes=tuple(missing_schemes),
                rope_scaling=tuple(missing_scalings),
                verify=False,
                fp16=False,
            )
        )
    return names


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
        "kv_capacity_bytes": info.kv_cache_capacity_bytes, "train_context": info.train_context,
    }  # fmt: skip
    return info


def served_limits(servers: dict[str, ServerProcess], results: Results) -> dict[str, int]:
    """Each served scheme's position limit (0: none); its description goes into the results."""
    return {scheme: model_info(server, scheme, results).max_positions for scheme, server in servers.items()}
