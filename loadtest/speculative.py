"""What speculative decoding buys each scheme: tokens/s with and without it and how many guesses are
kept, on code that repeats itself and on plain held-out code, at one stream and at many. Shared by
`python -m bench --sections speculative` and the comparison's `speculative` section.

The two workloads, from the corpus's test split:
- "repeats": a held-out piece of code followed by its first third again, so the text that follows
  is a copy of what came after that third (as code repeats a block, a signature, an import list);
  how much a scheme gains here follows how well it copies (the report's copy probe).
- "held-out": a held-out piece of code alone; its continuation repeats only what code repeats.

Each figure times the same prompts through one server with the request field `speculative_tokens`
at 0 and at K, alternated prompt by prompt, so the machine's drift falls on both alike; greedy,
`ignore_eos`, a fixed number of new tokens; decode tokens/s by the server's own timings (the
prompt's time is the same either way and would only dilute the ratio). Acceptance is read from the server's own counters
(`posenc_speculative_accepted_tokens_total` over `..._proposed_...`).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from loadtest.probes import ratio_interval
from loadtest.study.budget import Budget
from loadtest.study.results import Results, SpeculativeCell
from service.api import generation_pb2 as pb
from service.process import ServerProcess

WORKLOADS = ("repeats", "held-out")
# Guesses a step, in every figure of the bench and the comparison: the engine's most (16). Against 8,
# learned went 1.87x -> 2.00-2.13x at one stream on code with repeats, alibi 2.37x -> 2.42-2.58x
# (16 prompts, alternated; docs/measurements.md): a longer block costs little more per token.
GUESSES = 16


@dataclass(frozen=True)
class SpeculativeFigure:
    """One scheme, workload and concurrency: tokens/s without and with speculation, and the share of
    guesses kept (with the mean number kept per verification)."""

    model: str
    workload: str
    streams: int
    plain_tokens_per_second: float
    speculative_tokens_per_second: float
    acceptance: float  # guesses kept / guesses verified
    proposed: float  # guesses verified
    # acceptance with its 95% interval over batches (cluster-robust ratio; None: nothing was guessed)
    acceptance_interval: dict[str, float] | None = None

    @property
    def speedup(self) -> float:
        return self.speculative_tokens_per_second / self.plain_tokens_per_second


def sizes(limit: int) -> tuple[int, int]:
    """(prompt bytes, new tokens) that fit a model's sequence limit (learned: 256 positions)."""
    prompt = min(480, limit // 2)
    return prompt, min(192, limit - prompt - 16)


def prompts(data: bytes, workload: str, size: int, count: int, seed: int = 0) -> list[str]:
    """`count` prompts of about `size` bytes of held-out code (see the module docstring)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if workload == "repeats":
            body = size * 3 // 4
            start = rng.randrange(0, len(data) - body - 1)
            chunk = data[start : start + body].decode("utf-8", errors="ignore")
            out.append(chunk + chunk[: len(chunk) // 3])
        else:
            start = rng.randrange(0, len(data) - size - 1)
            out.append(data[start : start + size].decode("utf-8", errors="ignore"))
    return out


def decode_seconds(responses: list[pb.GenerateResponse]) -> float:
    """The decode phase of requests sent together, by the server's own clock: from the first first
    token to the last finish (prompts are the same size with and without guesses, and no guess helps
    a prompt, so tokens/s counts the tokens after the first over this window)."""
    return max(r.timings.total_seconds for r in responses) - min(
        r.timings.time_to_first_token_seconds for r in responses
    )


def measure(
    server: ServerProcess, model: str, workload_prompts: list[str], new_tokens: int, streams: int, guesses: int
) -> SpeculativeFigure:
    """The prompts run `streams` at a time, once without and once with `guesses` guesses a step,
    alternated batch by batch; tokens/s is the tokens after each first one over the batches' decode
    phases (`decode_seconds`). Acceptance comes with a 95% interval over the batches (prompts, at one
    stream): each draws its own held-out code, so batches are independent, a batch's guesses are not."""
    seconds = {0: 0.0, guesses: 0.0}
    tokens = {0: 0, guesses: 0}
    kept: list[tuple[float, int]] = []  # (guesses kept, guesses verified) a batch
    batches = [workload_prompts[i : i + streams] for i in range(0, len(workload_prompts), streams)]
    with ThreadPoolExecutor(streams) as pool:
        for index, batch in enumerate(batches):
            order = (0, guesses) if index % 2 == 0 else (guesses, 0)
            for k in order:
                requests = [
                    pb.GenerateRequest(model=model, prompt=p, max_new_tokens=new_tokens, ignore_eos=True,
                                       speculative_tokens=k)
                    for p in batch
                ]  # fmt: skip
                before = counters(server, model)
                responses = list(pool.map(lambda r: server.stub.Generate(r, timeout=600), requests))
                if k:
                    accepted, proposed = (after - first for after, first in zip(counters(server, model), before,
                                                                                strict=True))  # fmt: skip
                    kept.append((accepted, round(proposed)))
                seconds[k] += decode_seconds(responses)
                tokens[k] += sum(r.usage.completion_tokens - 1 for r in responses)
    accepted, proposed = sum(a for a, _ in kept), sum(p for _, p in kept)
    interval = ratio_interval(kept)
    cell = None if interval is None else {**interval.as_dict(), "high": min(1.0, interval.high), "n": len(kept)}
    return SpeculativeFigure(
        model, "", streams, tokens[0] / seconds[0], tokens[guesses] / seconds[guesses],
        accepted / proposed if proposed else 0.0, proposed, cell,
    )  # fmt: skip


def counters(server: ServerProcess, model: str) -> tuple[float, float]:
    """The server's guesses kept and verified for `model` so far."""
    values = server.sample(["posenc_speculative_accepted_tokens_total", "posenc_speculative_proposed_tokens_total"],
                           model=model)  # fmt: skip
    return values["posenc_speculative_accepted_tokens_total"], values["posenc_speculative_proposed_tokens_total"]


SECTIONS = ("speculative",)
STREAMS = (1, 16)


def measure_speculative(
    repository: Path, threads: int, models: list[str], data: bytes, budget: Budget, results: Results, progress: tqdm
) -> None:
    """The comparison's `speculative` section: every model (each scheme's, and each further training
    seed of it), both workloads, 1 and 16 streams, on one server that guesses at any batch size
    (`--speculative-max-batch` 64), so each cell says what guessing does there; the server's own rule
    keeps it off above 8 streams."""
    server = ServerProcess(
        repository, "--models", *models, "--max-new-tokens-limit", "4096", "--speculative-max-batch", "64",
        threads=threads,
    )  # fmt: skip
    try:
        server.wait_serving()
        served = server.stub.ListModels(pb.ListModelsRequest(), timeout=30).models
        limits = {info.name: info.max_positions or info.max_sequence_tokens for info in served}
        for model in models:
            prompt_bytes, new = sizes(limits[model])
            new = min(new, budget.speculative_new_tokens)
            cells: dict[str, SpeculativeCell] = {}
            for workload in WORKLOADS:
                texts = prompts(data, workload, prompt_bytes, max(STREAMS) * max(1, budget.speculative_prompts // 4))
                for streams in STREAMS:
                    used = texts[: budget.speculative_prompts] if streams == 1 else texts
                    figure = measure(server, model, used, new, streams, GUESSES)
                    cells[f"{workload}@{streams}"] = {
                        "plain_tokens_per_second": figure.plain_tokens_per_second,
                        "speculative_tokens_per_second": figure.speculative_tokens_per_second,
                        "speedup": figure.speedup,
                        "acceptance": figure.acceptance,
                        "proposed": figure.proposed,
                        "guesses": GUESSES,
                        "acceptance_interval": figure.acceptance_interval,
                    }
            results.speculative[model] = cells
            progress.update(1)
    finally:
        server.stop()
