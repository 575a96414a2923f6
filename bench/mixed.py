"""The mixed section (workload W1): one long and many short streams through the service, the KV
cache seen from outside through /metrics."""

from __future__ import annotations

import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from service.api import generation_pb2 as pb
from service.process import ServerProcess

DECODE_SUM = 'posenc_step_duration_seconds_sum{phase="decode"}'
DECODE_COUNT = 'posenc_step_duration_seconds_count{phase="decode"}'
W1_GAUGES = [
    "posenc_kv_cache_used_bytes",
    "posenc_kv_cache_physical_bytes",
    "posenc_kv_cache_physical_peak_bytes",
    "posenc_kv_cache_capacity_bytes",
    "posenc_running_sequences",
    DECODE_SUM,
    DECODE_COUNT,
]


def print_mixed_lengths(
    repository: Path, model: str, server_threads: int, device_flags: list[str], quick: bool
) -> None:
    """Print the mixed section: W1 against a server started with the default cache flags."""
    new_tokens = 200 if quick else 1000
    print(
        f"\nMixed lengths (W1), model {model}, default cache flags: one stream with a 3000-byte prompt, 1.5 s later "
        f"15 streams with 50-byte prompts, {new_tokens} new tokens each (temperature 0.8), /metrics every 50 ms:"
    )
    server = ServerProcess(repository, "--models", model, *device_flags, threads=server_threads)
    try:
        figures = mixed_lengths_workload(server.wait_serving(), model, new_tokens=new_tokens)
    finally:
        server.stop()
    print(
        f"  used/physical (median, >= 8 running) {figures.used_over_physical:5.2f}   (goal >= 0.8)\n"
        f"  peak physical {figures.peak_physical / 2**20:7.1f} MiB   budget {figures.capacity / 2**20:7.1f} MiB   "
        f"({'within' if figures.peak_physical <= figures.capacity else 'ABOVE'} the budget)\n"
        f"  decode step of the mixed batch (mean, >= 8 running) {figures.decode_step_seconds * 1000:6.2f} ms"
    )


@dataclass
class MixedLengthsFigures:
    """What an outside process saw of the KV cache while one long and many short sequences ran."""

    samples: list[dict[str, float]]
    peak_physical: float  # max of the sampled physical bytes and the store's own high-water mark
    capacity: float
    texts: list[str]

    def busy(self, running: int = 8) -> list[dict[str, float]]:
        return [s for s in self.samples if s["posenc_running_sequences"] >= running]

    @property
    def used_over_physical(self) -> float:
        """Median over scrapes with 8 or more sequences running."""
        ratios = [
            s["posenc_kv_cache_used_bytes"] / s["posenc_kv_cache_physical_bytes"]
            for s in self.busy()
            if s["posenc_kv_cache_physical_bytes"] > 0  # (before the store: prompts not yet in the batch)
        ]
        return statistics.median(ratios) if ratios else math.nan

    @property
    def decode_step_seconds(self) -> float:
        """Mean decode step time between scrapes while 8 or more sequences ran."""
        busy = self.busy()
        if len(busy) < 2:
            return math.nan
        steps = busy[-1][DECODE_COUNT] - busy[0][DECODE_COUNT]
        return (busy[-1][DECODE_SUM] - busy[0][DECODE_SUM]) / steps if steps else math.nan


def mixed_lengths_workload(
    server: ServerProcess,
    model: str,
    long_prompt_bytes: int = 3000,
    short_streams: int = 15,
    short_prompt_bytes: int = 50,
    new_tokens: int = 1000,
    delay: float = 1.5,
    interval: float = 0.05,
) -> MixedLengthsFigures:
    """W1: one stream with a long prompt, `delay` s later `short_streams` streams with short prompts,
    each generating `new_tokens` tokens (temperature 0.8); /metrics scraped every `interval` s
    (works against any build of the server that exports these gauges)."""
    text = "".join(f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(400))

    def stream(prompt: str, seed: int) -> str:
        request = pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=new_tokens, temperature=0.8, seed=seed)
        return "".join(chunk.text for chunk in server.stub.GenerateStream(request, timeout=900))

    samples: list[dict[str, float]] = []
    done = threading.Event()
    gauges = [g for g in W1_GAUGES if g != "posenc_kv_cache_physical_peak_bytes"]

    def scrape() -> None:
        while not done.is_set():
            samples.append(server.sample(gauges, model=model))
            time.sleep(interval)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    with ThreadPoolExecutor(short_streams + 1) as pool:
        futures = [pool.submit(stream, text[:long_prompt_bytes], 0)]
        time.sleep(delay)
        futures += [pool.submit(stream, text[i * 7 : i * 7 + short_prompt_bytes], i + 1) for i in range(short_streams)]
        texts = [f.result() for f in futures]
    done.set()
    scraper.join()
    final = server.sample(gauges, model=model)
    peaks = [s["posenc_kv_cache_physical_bytes"] for s in samples]
    try:  # the store's own high-water mark (counts re-allocations between scrapes)
        peaks.append(server.metric("posenc_kv_cache_physical_peak_bytes", model=model))
    except KeyError:
        pass  # a build without the store
    return MixedLengthsFigures(samples, max(peaks), final["posenc_kv_cache_capacity_bytes"], texts)
