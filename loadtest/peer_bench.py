"""Our latency figures held against an established benchmark tool's: `python -m loadtest.peer_bench`.

Runs GuideLLM (https://github.com/vllm-project/guidellm), an OpenAI-API benchmark from PyPI, against
the service's /v1/completions on a fixed workload (synthetic prompts of --prompt-tokens, exactly
--output-tokens generated: GuideLLM sends ignore_eos, streaming with usage, at each --concurrency),
then replays the very prompts GuideLLM sent, at the same concurrency, with our own client (aiohttp,
timed by `loadtest.sse` as `loadtest.streaming` times gRPC streams). Prints both tables (TTFT p50,
ITL p50, output tokens/s) and their ratios (goal: within 10%).

GuideLLM pins versions of packages this project also uses (click, multidict), so it lives in a
virtual environment of its own, found by --guidellm:

    python -m venv /tmp/peer && /tmp/peer/bin/pip install guidellm==0.8.1
    python -m loadtest.peer_bench --guidellm /tmp/peer/bin/guidellm

Without --target it starts a server (the HTTP API on a free port) on --model-repository. The
tokenizer GuideLLM counts prompt tokens with is the shipped one (models/weights/<model>/, read by
transformers offline: HF_HUB_OFFLINE=1). Definitions, the same on both sides: TTFT from sending the
request to the first text; ITL the decode time per token after the first (GuideLLM: (latency - TTFT)
/ (tokens - 1), ours: first to last text chunk over the bytes after the first chunk); output
tokens/s the level's output tokens over its wall time, first request sent to last answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from contract.cli import HelpFormatter
from contract.paths import REPOSITORY_ROOT
from loadtest.sse import SseTimer, completion_body
from service.process import ServerProcess

MEASURES = ("TTFT p50 ms", "ITL p50 ms", "output tok/s")


@dataclass(frozen=True)
class Level:
    """One concurrency level's figures, as one tool measured them."""

    concurrency: int
    requests: int
    ttft_ms: float
    itl_ms: float
    output_tokens_per_second: float

    def values(self) -> tuple[float, float, float]:
        return self.ttft_ms, self.itl_ms, self.output_tokens_per_second


def guidellm_command(args: argparse.Namespace, target: str, output: Path) -> list[str]:
    streams = ",".join(str(c) for c in args.concurrency)
    return [
        args.guidellm, "run",
        "--backend", f"kind=openai_http,target={target},model={args.model},request_format=/v1/completions",
        "--profile", "kind=concurrent", "--override", "profile.streams", streams,
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={args.tokenizer or REPOSITORY_ROOT / 'models' / 'weights' / args.model}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--output", f"kind=json,path={output}", "--disable-console-interactive",
    ]  # fmt: skip


def run_guidellm(args: argparse.Namespace, target: str, folder: Path) -> tuple[str, list[Level], dict[int, list[str]]]:
    """GuideLLM's version, its figures per level, and the prompts it sent per level."""
    output = folder / "guidellm.json"
    command = guidellm_command(args, target, output)
    print("$", " ".join(command), flush=True)
    # One worker process: on a small machine more of them take the CPU the server measures with.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    subprocess.run(command, check=True, env=env, cwd=folder, stdout=subprocess.DEVNULL)
    report = json.loads(output.read_text())
    levels, prompts = [], {}
    for benchmark in report["benchmarks"]:
        metrics, done = benchmark["metrics"], benchmark["requests"]["successful"]
        streams = int(benchmark["config"]["strategy"]["streams"])
        prompts[streams] = [json.loads(r["request_args"])["body"]["prompt"] for r in done]
        tokens = sum(int(r["output_tokens"]) for r in done)
        levels.append(Level(
            streams, len(done), metrics["time_to_first_token_ms"]["successful"]["median"],
            metrics["inter_token_latency_ms"]["successful"]["median"], tokens / benchmark["duration"],
        ))  # fmt: skip
    return report["metadata"]["guidellm_version"], levels, prompts


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> tuple[SseTimer, float]:
    timer = SseTimer(time.perf_counter())
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            timer.line(line, time.perf_counter())
    if timer.error is not None or not timer.done:
        raise RuntimeError(f"stream failed: {timer.error or 'no [DONE]'}")
    return timer, time.perf_counter()


async def run_ours(target: str, model: str, prompts: list[str], concurrency: int, output_tokens: int) -> Level:
    """The prompts at this concurrency (each of `concurrency` clients sends its next when its last ends)."""
    url, queue = target.rstrip("/") + "/v1/completions", list(reversed(prompts))
    results: list[tuple[SseTimer, float]] = []

    async def client(session: aiohttp.ClientSession) -> None:
        while queue:
            body = completion_body(model, queue.pop(), output_tokens, ignore_eos=True)
            results.append(await _one(session, url, body))

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        wall = max(end for _, end in results) - started
    timings = [timer.timing for timer, _ in results]
    ttft = [t.time_to_first_token for t in timings if t.time_to_first_token is not None]
    itl = [t.mean_inter_token for t in timings if t.mean_inter_token is not None]
    tokens = sum(t.completion_tokens for t in timings)
    return Level(concurrency, len(timings), statistics.median(ttft) * 1e3, statistics.median(itl) * 1e3, tokens / wall)


def server_ttft(server: ServerProcess | None, model: str) -> tuple[float, float]:
    """The server's own time-to-first-token histogram (sum, count): what it saw, whoever measured."""
    if server is None:
        return 0.0, 0.0
    name = "posenc_time_to_first_token_seconds"
    found = server.sample([f"{name}_sum", f"{name}_count"], model=model)
    return found[f"{name}_sum"], found[f"{name}_count"]


def mean_between(before: tuple[float, float], after: tuple[float, float]) -> str:
    count = after[1] - before[1]
    return f"{(after[0] - before[0]) / count * 1e3:.1f} ms over {count:.0f} requests" if count else "n/a"


def table(title: str, levels: list[Level]) -> str:
    lines = [title, f"{'concurrency':>11} {'requests':>8} " + " ".join(f"{m:>13}" for m in MEASURES)]
    for level in levels:
        values = " ".join(f"{v:13.1f}" for v in level.values())
        lines.append(f"{level.concurrency:>11} {level.requests:>8} {values}")
    return "\n".join(lines)


def ratios(peer: list[Level], ours: list[Level], tolerance: float) -> tuple[str, bool]:
    """Peer / ours per measure and level, and whether every one lies within the tolerance."""
    lines = ["peer / ours", f"{'concurrency':>11} " + " ".join(f"{m:>13}" for m in MEASURES)]
    agree = True
    for theirs, mine in zip(peer, ours, strict=True):
        each = [a / b if b else float("nan") for a, b in zip(theirs.values(), mine.values(), strict=True)]
        agree = agree and all(abs(r - 1) <= tolerance for r in each)
        lines.append(f"{theirs.concurrency:>11} " + " ".join(f"{r:13.3f}" for r in each))
    return "\n".join(lines), agree


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.peer_bench", description=__doc__,
                                     formatter_class=HelpFormatter)  # fmt: skip
    parser.add_argument("--guidellm", default=shutil.which("guidellm"), help="the guidellm command (its own venv)")
    parser.add_argument(
        "--target",
        help="base URL of a running server's HTTP API, started with --no-prefix-cache: both tools send the same "
        "prompts (default: start one)",
    )
    parser.add_argument("--model-repository", type=Path, default=REPOSITORY_ROOT / "model_repository",
                        help="repository of the server started when there is no --target")  # fmt: skip
    parser.add_argument("--model", default="alibi", help="the model both tools call")
    parser.add_argument("--tokenizer", type=Path, help="folder of tokenizer.json (default: the model's weights folder)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="concurrency levels")
    parser.add_argument("--requests", type=int, default=32, help="requests per level")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt length in tokens (bytes)")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens generated per request (ignore_eos)")
    parser.add_argument("--threads", type=int, default=1, help="the started server's --threads")
    parser.add_argument("--tolerance", type=float, default=0.10, help="largest |peer / ours - 1| that agrees")
    args = parser.parse_args(argv)
    if not args.guidellm:
        parser.error("guidellm not found: install it in a venv of its own and pass --guidellm (see --help)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    if args.target is None:
        # No prefix cache: both tools send the same prompts, and the second would find them cached.
        server = ServerProcess(
            args.model_repository, "--models", args.model, "--no-prefix-cache", threads=args.threads
        ).wait_serving()
    target = args.target or server.http_url  # type: ignore[union-attr]
    try:
        warm = ["def warm_up():\n" * 16] * 4
        asyncio.run(run_ours(target, args.model, warm, 2, args.output_tokens))
        marks = [server_ttft(server, args.model)]
        with tempfile.TemporaryDirectory(prefix="peer-bench-") as folder:
            version, peer, prompts = run_guidellm(args, target, Path(folder))
        marks.append(server_ttft(server, args.model))
        ours = [asyncio.run(run_ours(target, args.model, prompts[c], c, args.output_tokens)) for c in args.concurrency]
        marks.append(server_ttft(server, args.model))
    finally:
        if server is not None:
            server.stop()
    print(table(f"GuideLLM {version} (peer)", peer), table("loadtest.peer_bench client (ours)", ours), sep="\n\n")
    if server is not None:  # where a gap comes from: the server's own TTFT while each tool ran
        print(f"\nserver-side mean TTFT (arrival to first token): during GuideLLM {mean_between(*marks[:2])}, "
              f"during ours {mean_between(*marks[1:])}")  # fmt: skip
    text, agree = ratios(peer, ours, args.tolerance)
    print("", text, f"agreement within {args.tolerance:.0%}: {'yes' if agree else 'NO'}", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
