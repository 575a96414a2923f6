"""The prefill worker against ONNX Runtime: interleaving, batching, giving up, failures."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from contract.manifest import Manifest
from models.tokenizer import TOKENIZER
from service.engine.kv.prefix import CachedPast
from service.engine.kv.scratch import MAX_REUSED_BYTES, ScratchArray
from service.engine.prompts.prefill import PrefillJob, PrefillResult, PrefillWorker, TailWorker
from service.engine.prompts.prompt import PrefilledPrompt, PromptRun
from service.engine.request import Request, SamplingParams
from service.engine.worker.prompt_sessions import Lane
from service.engine.worker.runner import ModelRunner, StoreConfig
from tests.service.engine.prompt_calls import batch, chunked


def tail(runner: ModelRunner, request_id: str, ids: list[int], past: CachedPast) -> PrefilledPrompt:
    """A prefix-cache hit's rest in one call on the tail worker's lane."""
    *_, [prompt] = runner.prefill([PromptRun(request_id, ids, past)], len(ids), Lane.TAIL)
    return prompt


def job(name: str, text: str) -> PrefillJob:
    ids = TOKENIZER.encode(text)
    return PrefillJob(Request(name, "alibi", ids, SamplingParams(max_new_tokens=1), eos_token_id=257), 0, ids)


class Collector:
    def __init__(self) -> None:
        self.results: list[PrefillResult] = []
        self.calls: list[int] = []
        self.priority = 0  # the nice value of the thread that delivered last
        self.changed = threading.Condition()

    def deliver(self, results: list[PrefillResult]) -> None:
        self.priority = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # the delivering thread's
        with self.changed:
            self.results.extend(results)
            self.changed.notify_all()

    def observe(self, seconds: float, batch: int, tokens: int) -> None:
        self.calls.append(batch)

    def wait_for(self, count: int) -> list[str]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.results) >= count, timeout=60)
        return [r.job.request.request_id for r in self.results]


@pytest.fixture
def runner(repository: Path) -> ModelRunner:
    return ModelRunner(Manifest.load(repository / "alibi"), StoreConfig(64 << 20, 16, 1024), "cpu", threads=1)


def start(runner: ModelRunner, collector: Collector, chunk_tokens: int) -> PrefillWorker:
    worker = PrefillWorker(runner, chunk_tokens, collector.deliver, collector.observe, "alibi", nice=5)
    worker.start()
    return worker


def test_short_prompts_do_not_wait_behind_a_long_one(runner: ModelRunner) -> None:
    collector = Collector()
    worker = start(runner, collector, chunk_tokens=32)
    try:
        worker.submit([job("long", "x = [i * 2 for i in range(10)]\n" * 40)])  # 1241 tokens: 39 chunks
        worker.submit([job("short-1", "import os\n"), job("short-2", "def f(x):\n")])
        order = collector.wait_for(3)
    finally:
        worker.stop()
    assert order.index("long") == 2  # both short prompts came back while the long one was in chunks
    assert all(r.error is None and r.prompt is not None for r in collector.results)
    assert 2 in collector.calls  # the two short prompts ran as one batched call
    long = next(r for r in collector.results if r.job.request.request_id == "long")
    assert long.prompt is not None and long.prompt.cache.shape[2] == long.prompt.length == len(long.job.token_ids)
    whole = batch(runner, {"long": long.job.token_ids})[0]
    np.testing.assert_allclose(long.prompt.logits, whole.logits, atol=1e-3)


def test_a_cancelled_long_prompt_is_given_up_between_chunks(runner: ModelRunner) -> None:
    collector = Collector()
    worker = start(runner, collector, chunk_tokens=16)
    long = job("long", "x = [i * 2 for i in range(10)]\n" * 40)
    try:
        worker.submit([long])
        long.request.cancelled.set()
        collector.wait_for(1)
    finally:
        worker.stop()
    assert collector.results[0].prompt is None and collector.results[0].error is None
    assert len(collector.calls) < 78  # it stopped early


def test_a_failing_prompt_fails_alone(runner: ModelRunner) -> None:
    runner._fault_marker = b"BOOM"
    collector = Collector()
    worker = start(runner, collector, chunk_tokens=64)
    try:
        worker.submit([job("good", "import os\n"), job("bad", "BOOM = 1\n"), job("fine", "def f(x):\n")])
        collector.wait_for(3)
    finally:
        worker.stop()
    errors = {r.job.request.request_id: r.error for r in collector.results}
    assert errors["good"] is None and errors["fine"] is None
    assert "injected fault" in str(errors["bad"])


def test_the_prompt_arena_is_handed_back_once_the_worker_idles(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused prompt session keeps an arena (calls would otherwise page-fault their
    intermediates in, each time); after RELEASE_AFTER_IDLE_SECONDS without work the worker releases
    it, and a prompt after the release is computed as before."""
    from service.engine.prompts import prefill as prefill_module

    if runner.prompt_variant is None:
        pytest.skip("an export without the fused prompt graph")
    monkeypatch.setattr(prefill_module, "RELEASE_AFTER_IDLE_SECONDS", 0.5)
    released = threading.Event()
    release = runner.prompt_sessions.release

    def observed_release() -> None:
        release()
        released.set()

    monkeypatch.setattr(runner.prompt_sessions, "release", observed_release)
    collector = Collector()
    worker = start(runner, collector, chunk_tokens=256)
    try:
        worker.submit([job("long", "x = [i * 2 for i in range(10)]\n" * 32)])  # 993 tokens: 4 chunks
        collector.wait_for(1)
        assert runner.prompt_sessions.held
        assert released.wait(timeout=10)
        assert not runner.prompt_sessions.held
        worker.submit([job("again", "def f(x):\n    return x\n" * 30)])
        assert collector.wait_for(2) == ["long", "again"]
        assert all(r.prompt is not None for r in collector.results)
    finally:
        worker.stop()


@pytest.mark.parametrize("scheme", ["alibi", "mla"])
def test_releasing_the_prompt_arena_returns_its_memory_to_the_system(repository: Path, scheme: str) -> None:
    """The physical truth, in a process set up as the engine core is (glibc's mmap threshold pinned,
    service/malloc.py; this test process is not, and a heap that grew here keeps what is freed):
    resident memory falls by more than 2 MB when the arena a long prompt left is released. Both
    kinds of worker session keep one: the fused prompt graph's (alibi) and latent attention's
    up-projected prompt graph (mla), whose calls without it took twice as long."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from contract.manifest import Manifest
        from service.engine.prompts.prompt import PromptRun
        from service.engine.worker.runner import ModelRunner, StoreConfig
        from service.malloc import return_freed_memory_to_the_os
        return_freed_memory_to_the_os()
        def resident():
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * 4096
        manifest = Manifest.load(Path({str(repository / scheme)!r}))
        runner = ModelRunner(manifest, StoreConfig(64 << 20, 16, 1024), "cpu", 1)
        if not runner.prompt_sessions.worker_arena:
            print("skip")
            raise SystemExit
        list(runner.prefill([PromptRun("long", [100 + i % 50 for i in range(1000)])], 256))
        assert runner.prompt_sessions.held
        held = resident()
        runner.prompt_sessions.release()
        print(held, resident())
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    if done.stdout.split()[-1] == "skip":
        pytest.skip(f"{scheme}'s export has no prompt graph of its own")
    held, released = (int(v) for v in done.stdout.split()[-2:])
    assert held - released > 2 << 20, f"the release freed {(held - released) >> 10} KiB"


def test_a_tail_worker_computes_a_hit_as_the_whole_prompt_at_the_callers_priority(runner: ModelRunner) -> None:
    """A prefix-cache hit's tail on the tail worker: the whole prompt's logits and K/V, from its
    one-thread session on its own thread, at normal priority where the prefill worker's is lowered."""
    text = "def read_config(path):\n    with open(path) as handle:\n        return handle.read()\n"
    whole = chunked(runner, "whole", TOKENIZER.encode(text), 512)
    assert whole is not None
    blocks = [whole.cache[:, :, start : start + 16] for start in range(0, 64, 16)]  # 4 blocks cached
    hit = job("hit", text)
    hit.past = CachedPast(blocks, runner.backend, runner.dtype)
    assert hit.computed_tokens == len(hit.token_ids) - 64
    assert runner.prompt_sessions.open_tail()
    runner.prompt_sessions.release()  # the whole prompt's call above held the prefill session's arena
    tails = Collector()
    worker = TailWorker(runner, tails.deliver, tails.observe, "alibi")
    worker.start()
    try:
        worker.submit([hit])
        tails.wait_for(1)
    finally:
        worker.stop()
    prompt = tails.results[0].prompt
    assert prompt is not None and tails.calls == [1]
    np.testing.assert_allclose(prompt.logits, whole.logits, atol=1e-4)
    np.testing.assert_allclose(prompt.cache, whole.cache, atol=1e-5)
    assert not runner.prompt_sessions.held  # a tail leaves the idle prefill worker nothing to release
    lowered = Collector()
    prefill = start(runner, lowered, chunk_tokens=32)
    try:
        prefill.submit([job("short", "import os\n")])
        lowered.wait_for(1)
    finally:
        prefill.stop()
    normal = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert tails.priority == normal and lowered.priority == normal + 5


def test_a_tail_with_nothing_decoding_beside_it_takes_every_prefill_thread(repository: Path) -> None:
    """The tail worker asks whether anything decodes: if not, the hit's tail runs through the session
    of all the prefill threads (not the one-thread session), with the same logits and K/V."""
    runner = ModelRunner(Manifest.load(repository / "alibi"), StoreConfig(64 << 20, 16, 1024), "cpu", threads=2)
    text = "def read_config(path):\n    with open(path) as handle:\n        return handle.read()\n"
    whole = chunked(runner, "whole", TOKENIZER.encode(text), 512)
    assert whole is not None
    blocks = [whole.cache[:, :, start : start + 16] for start in range(0, 64, 16)]
    assert runner.prompt_sessions.open_tail() and runner.prompt_sessions.idle_tail is not None
    used: list[str] = []
    for name in ("tail", "idle_tail"):
        session = getattr(runner.prompt_sessions, name)

        def recorded(binding: object, release_arena: bool = False, run=session.run, name: str = name) -> None:
            used.append(name)
            run(binding, release_arena)

        session.run = recorded
    decoding = [True, False]
    tails = Collector()
    worker = TailWorker(runner, tails.deliver, tails.observe, "alibi", idle=lambda: not decoding[0])
    worker.start()
    try:
        for index in range(2):
            hit = job(f"hit{index}", text)
            hit.past = CachedPast(blocks, runner.backend, runner.dtype)
            worker.submit([hit])
            tails.wait_for(index + 1)
            decoding.pop(0)
    finally:
        worker.stop()
    assert used == ["tail", "idle_tail"]
    for result in tails.results:
        assert result.prompt is not None
        np.testing.assert_allclose(result.prompt.logits, whole.logits, atol=1e-4)
        np.testing.assert_allclose(result.prompt.cache, whole.cache, atol=1e-5)


def test_scratch_memory_is_handed_out_again_only_once_nothing_views_it() -> None:
    scratch = ScratchArray()
    first = scratch.empty((2, 3, 4), "float32")
    view = first[:, 0]
    del first
    second = scratch.empty((2, 3, 4), "float32")  # `view` still reads the first: new memory
    assert not np.shares_memory(second, view) and scratch.in_use
    address = second.__array_interface__["data"][0]
    del view, second
    assert not scratch.in_use
    third = scratch.empty((4, 3), "float32")  # free and large enough: the same memory, another shape
    assert third.__array_interface__["data"][0] == address and third.flags.c_contiguous
    assert scratch.empty((2, 3, 5), "float32").shape == (2, 3, 5)  # larger: new memory
    big = (MAX_REUSED_BYTES // 4 + 1,)
    assert not np.shares_memory(scratch.empty(big, "float32"), scratch.empty(big, "float32"))


def test_hits_reuse_the_tail_workers_memory_only_after_their_prompts_are_dropped(runner: ModelRunner) -> None:
    """A hit's past is assembled into the tail thread's kept memory (no fresh mapping to fault in),
    never while an earlier hit's prompt, which the engine thread copies from, still views it."""
    text = "def read_config(path):\n    with open(path) as handle:\n        return handle.read()\n"
    ids = TOKENIZER.encode(text)
    whole = chunked(runner, "whole", ids, 512)
    assert whole is not None
    blocks = [whole.cache[:, :, start : start + 16] for start in range(0, 64, 16)]
    assert runner.prompt_sessions.open_tail()
    held = tail(runner, "a", ids, CachedPast(blocks, runner.backend, runner.dtype))
    expected = held.cache.copy()
    other = tail(runner, "b", ids, CachedPast(blocks, runner.backend, runner.dtype))
    assert not np.shares_memory(held.cache, other.cache)  # `held` is still read: not written over
    np.testing.assert_array_equal(held.cache, expected)
    address = other.cache.__array_interface__["data"][0]
    del other
    again = tail(runner, "c", ids, CachedPast(blocks, runner.backend, runner.dtype))
    assert again.cache.__array_interface__["data"][0] == address  # b's memory, free again
    np.testing.assert_allclose(again.cache, whole.cache, atol=1e-5)
    np.testing.assert_allclose(again.logits, whole.logits, atol=1e-4)
