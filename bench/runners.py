"""Runners whose store is filled with random K/V, and the median time of a decode step on them:
the fixture of every step-time section (steps, share, policies, fused, the throughput ceiling)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from contract.cache_policy import FULL_POLICY, CachePolicy
from contract.manifest import NP_DTYPES, Manifest
from service.engine.kv import SplitKV
from service.engine.prompts.prompt import PrefilledPrompt
from service.engine.worker.runner import ModelRunner, StoreConfig

CONTEXTS = (128, 256, 512, 1024, 2048)  # context lengths the step-time tables sweep


def batch_runner(
    folder: Path,
    batch: int,
    context: int,
    threads: int,
    device: str = "cpu",
    backend: str = "auto",
    attention: str = "auto",
    prompts: bool = True,
) -> ModelRunner:
    """A runner whose store holds `batch` sequences of `context` tokens of random K/V; `prompts` False
    opens no prompt session (a runner that only steps: at GPT-2-small width each holds the weights)."""
    return policy_runner(folder, batch, context, FULL_POLICY, threads, device, backend, attention, prompts)


def policy_runner(
    folder: Path,
    batch: int,
    history: int,
    policy: CachePolicy,
    threads: int,
    device: str = "cpu",
    backend: str = "auto",
    attention: str = "auto",
    prompts: bool = True,
) -> ModelRunner:
    """A runner whose store holds `batch` sequences that have seen `history` tokens under `policy`
    (random K/V): a bounded row holds its budget and has evicted the rest."""
    store = StoreConfig(1 << 34, 16, max(4096, history + 64))
    runner = ModelRunner(Manifest.load(folder), store, device, threads, backend, prompts, attention)
    layout = runner.layout
    rng = np.random.default_rng(0)
    cached = policy.cached(history)
    shape = (layout.tensors, layout.n_heads, cached, layout.head_dim)
    logits = np.zeros(runner.manifest.vocab_size, dtype=np.float32)
    prompts = []
    window = layout.local  # a hybrid's split rows: the local layers' K/V of the window before the next token
    for i in range(batch):
        cache = runner.backend.upload((rng.standard_normal(shape) * 0.1).astype(NP_DTYPES[runner.dtype]))
        if window is not None:
            local_shape = (window.tensors, layout.n_heads, min(cached, window.keep_tokens), layout.head_dim)
            local = runner.backend.upload((rng.standard_normal(local_shape) * 0.1).astype(NP_DTYPES[runner.dtype]))
            cache = SplitKV(cache, local)
        runner.store.reserve(f"r{i}", policy.cached(history + 1), policy)
        row = layout.row_eviction(policy)
        row.evicted = history - cached
        prompts.append(PrefilledPrompt(f"r{i}", logits, cache, cached, row))
    runner.join(prompts)
    return runner


def planned_step(runner: ModelRunner) -> Callable[[], np.ndarray]:
    """One decode step of every member of the store, as the engine's steady batch takes it (one
    plan of bound calls, each row fed a token)."""
    members = runner.store.members()
    plan = runner.plan_decode(members)
    tokens = [65] * len(members)
    return lambda: runner.decode_planned(plan, tokens)


def bounded_step_seconds(runner: ModelRunner, steps: int) -> float:
    """Median decode step time of bounded rows: every step evicts one token and appends one, so
    the history grows while the cache stays the same size."""
    step = planned_step(runner)
    step()  # warm-up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def step_seconds(runner: ModelRunner, steps: int) -> float:
    """Median decode step time at the store's context: each step's new column is taken back,
    so every step reads the same context."""
    step = planned_step(runner)
    step()  # warm-up
    runner.store.rewind(1)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
        runner.store.rewind(1)
    return statistics.median(times)
