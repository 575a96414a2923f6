"""The speculative section: per scheme, tokens/s with and without speculative decoding (the n-gram
proposer, K guesses a step) and the share of guesses kept, on code with repeats and on plain held-out
code, at 1 and 16 streams (loadtest/speculative.py says how). At 16 streams the server's own rule
(`--speculative-max-batch`) decides; a second server that always guesses shows what guessing
would cost there, and a sweep of stream counts where it stops paying."""

from __future__ import annotations

import argparse
from pathlib import Path

from contract.manifest import Manifest
from loadtest.speculative import GUESSES, SpeculativeFigure, measure, prompts, sizes
from models.corpus import load_corpus
from service.process import ServerProcess


def print_speculative(args: argparse.Namespace, repository: Path, server_threads: int, device_flags: list[str]) -> None:
    folders = sorted(p for p in repository.iterdir() if (p / "manifest.json").is_file())
    models = [p.name for p in folders if Manifest.load(p).served_by_default]
    data = load_corpus().text_bytes("test")
    count = 4 if args.quick else 8
    print(
        f"\nSpeculative decoding: tokens/s without / with {GUESSES} n-gram guesses a step (speedup), and the share of "
        f"guesses kept; greedy, ignore_eos, {count} prompts per cell alternated with and without, 1 stream and 16 "
        "(16: the server's --speculative-max-batch rule; 16 forced: a server that always guesses):"
    )
    limits = {m: Manifest.load(repository / m).max_positions or 4096 for m in models}
    common = ["--max-new-tokens-limit", "4096", *device_flags]
    server = ServerProcess(repository, *common, threads=server_threads)
    forced = ServerProcess(repository, *common, "--speculative-max-batch", "64", threads=server_threads)
    try:
        server.wait_serving()
        forced.wait_serving()
        header = f"  {'model':<11} {'workload':<9}" + "".join(
            f"{c:>34}" for c in ("1 stream", "16 streams", "16 forced")
        )
        print(header)
        for model in models:
            prompt_bytes, new = sizes(limits[model])
            for workload in ("repeats", "held-out"):
                texts = prompts(data, workload, prompt_bytes, 16, seed=1)
                cells = [
                    measure(server, model, texts[:count], new, 1, GUESSES),
                    measure(server, model, texts, new, 16, GUESSES),
                    measure(forced, model, texts, new, 16, GUESSES),
                ]
                print(f"  {model:<11} {workload:<9}" + "".join(_cell(c) for c in cells))
        _print_crossover(forced, data, limits, args.model, count)
    finally:
        server.stop()
        forced.stop()


def _cell(figure: SpeculativeFigure) -> str:
    kept = f"{figure.acceptance:4.0%}" if figure.proposed else "  - "
    return (
        f"  {figure.plain_tokens_per_second:6.0f} / {figure.speculative_tokens_per_second:6.0f}"
        f" ({figure.speedup:4.2f}x) {kept}"
    )


def _print_crossover(server: ServerProcess, data: bytes, limits: dict[str, int], model: str, count: int) -> None:
    """Where guessing stops paying, always guessing: the speedup by stream count on both workloads."""
    prompt_bytes, new = sizes(limits[model])
    line = []
    for workload in ("repeats", "held-out"):
        texts = prompts(data, workload, prompt_bytes, 16, seed=2)
        for streams in (1, 2, 4, 8, 16):
            figure = measure(server, model, texts[: max(streams, count)], new, streams, GUESSES)
            line.append(f"{workload} x{streams} {figure.speedup:.2f}")
    print(f"  {model}, always guessing, speedup by streams: " + ", ".join(line))
