"""The prefill worker: computes admitted prompts in its own thread and ONNX Runtime session.

A long prompt then never stalls the decode steps of running sequences (their inter-token
latency stays near its unloaded value; only the new prompt's first token waits for it), the
goal chunked prefill serves in vLLM and Sarathi-Serve. Short prompts that arrive together are
computed in one left-padded call; a long prompt is computed in chunks, and short prompts that
arrive meanwhile run between its chunks instead of queueing behind all of it.

The worker thread, and the intra-op threads of the session it opens, run at a lower OS
priority (`nice`): the decode steps and the gRPC threads that stream their tokens get the CPU
first, and prompts use every core that is left.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from service.engine.kv.prefix import CachedPast
from service.engine.prompts.prompt import PrefilledPrompt, PromptRun
from service.engine.request import Request
from service.engine.worker.prompt_sessions import Lane
from service.engine.worker.runner import ModelRunner

logger = logging.getLogger(__name__)

# The worker gives its prompt session's arena back after this long without work: under load the
# arena saves each call its page faults; at rest the server holds no prompt's intermediates.
RELEASE_AFTER_IDLE_SECONDS = 1.0


@dataclass
class PrefillJob:
    request: Request
    attempt: int  # the request's preemption count when submitted: a later result is stale
    token_ids: list[int]
    past: CachedPast | None = None  # the prefix cache's K/V of the leading tokens
    compute: Callable[[], PrefilledPrompt] | None = None  # its own prefill (reused segments), instead

    @property
    def run(self) -> PromptRun:
        """What the runner computes (ModelRunner.prefill)."""
        return PromptRun(self.request.request_id, self.token_ids, self.past, self.request.cache_policy)

    @property
    def computed_tokens(self) -> int:
        """Tokens this job's prefill computes (those after its past)."""
        return len(self.token_ids) - (0 if self.past is None else self.past.tokens)

    @property
    def aborted(self) -> bool:
        request = self.request
        if request.status.finished or request.attempt != self.attempt or request.cancelled.is_set():
            return True
        return request.deadline is not None and time.monotonic() >= request.deadline


@dataclass
class PrefillResult:
    job: PrefillJob
    prompt: PrefilledPrompt | None = None  # None: aborted, or failed
    error: Exception | None = None


class _JobThread:
    """A thread that takes jobs from a queue: submit, stop; and which tenants' jobs it holds (submitted,
    not yet handed back), for the light lane (PromptDispatch)."""

    def __init__(self, thread_name: str, deliver: Callable[[list[PrefillResult]], None]) -> None:
        self._jobs: deque[PrefillJob] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._deliver_to = deliver
        self._held: Counter[str] = Counter()

    def _loop(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def submit(self, jobs: list[PrefillJob]) -> None:
        with self._wake:
            self._jobs.extend(jobs)
            self._held.update(job.request.tenant for job in jobs)
            self._wake.notify()

    def holds(self, tenant: str | None = None) -> bool:
        """Whether it holds a job of `tenant` (None: of anyone)."""
        with self._wake:
            return self._held[tenant] > 0 if tenant is not None else self._held.total() > 0

    def _deliver(self, results: list[PrefillResult]) -> None:
        with self._wake:
            self._held.subtract(result.job.request.tenant for result in results)
            self._held = +self._held  # drop tenants at zero
        self._deliver_to(results)


class PrefillWorker(_JobThread):
    def __init__(
        self,
        runner: ModelRunner,
        chunk_tokens: int,
        deliver: Callable[[list[PrefillResult]], None],
        observe: Callable[[float, int, int], None],
        name: str,
        nice: int = 0,
        fair: bool = False,
    ) -> None:
        """`deliver` gets finished results (on this thread); `observe(seconds, batch, tokens)` each call;
        `fair`: waiting short prompts are taken round robin across tenants, not in arrival order."""
        self.runner = runner
        self.fair = fair
        self.chunk_tokens = chunk_tokens
        self._observe = observe
        super().__init__(f"prefill-{name}", deliver)
        self._long: deque[tuple[PrefillJob, Iterator[list[PrefilledPrompt] | None]]] = deque()
        self._long_done = 0  # prompt tokens of the oldest long prompt computed so far
        self._ready = threading.Event()
        self._open_error: Exception | None = None
        self.nice = nice

    def start(self) -> None:
        """Start the thread; it opens the prompt session itself (so ONNX Runtime's pool threads
        inherit its lower priority), and this returns once that is done."""
        self._thread.start()
        self._ready.wait()
        if self._open_error is not None:
            raise self._open_error

    def _lower_priority(self) -> None:
        """Raise this thread's nice value (Linux schedules threads apart; lowering is always allowed)."""
        if self.nice <= 0 or not hasattr(os, "setpriority"):
            return
        try:
            thread = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + self.nice)
        except OSError as error:
            logger.warning("prefill worker: could not lower its priority: %s", error)

    def _loop(self) -> None:
        self._lower_priority()
        try:
            self.runner.prompt_sessions.open()
        except Exception as error:
            self._open_error = error
            return
        finally:
            self._ready.set()
        idle_wait: float | None = RELEASE_AFTER_IDLE_SECONDS
        while True:
            with self._wake:
                if not self._jobs and not self._long and not self._stopped:
                    self._wake.wait(timeout=idle_wait)
                if self._stopped:
                    return
                release = not self._jobs and not self._long  # idle a while: hand the prompt arena back
                if release and idle_wait is None:  # already handed back: wait for work
                    continue
                idle_wait = None if release else RELEASE_AFTER_IDLE_SECONDS
                short, hits, tokens = [], [], 0
                jobs, later = self._ordered(list(self._jobs)), []
                self._jobs.clear()
                for job in jobs:  # when each runs (the runner decides how)
                    if job.past is not None or job.compute is not None:  # a prefix-cache hit, reused segments
                        hits.append(job)
                    elif job.run.streams or len(job.token_ids) > self.chunk_tokens:  # one chunk a turn
                        self._long.append((job, self.runner.prefill([job.run], self.chunk_tokens)))
                    else:
                        if short and tokens + len(job.token_ids) > self.chunk_tokens:
                            later.append(job)  # one batch a turn: its first tokens go out before the next is computed
                            continue
                        short.append(job)
                        tokens += len(job.token_ids)
                self._jobs.extendleft(reversed(later))
            if release:
                try:
                    self.runner.prompt_sessions.release()
                except Exception:
                    logger.exception("prefill worker: releasing the prompt arena failed")
                continue
            results: list[PrefillResult] = []
            try:
                self._run_hits(hits, results)
                self._run_short(short, results)
                self._advance_long(results)
            except Exception:  # a bug must not kill the worker (and strand its requests)
                logger.exception("prefill worker failed")
            if results:
                self._deliver(results)

    def _ordered(self, jobs: list[PrefillJob]) -> list[PrefillJob]:
        """The waiting jobs in the order they are taken: arrival order, or under fair scheduling round
        robin across tenants (each tenant's own in arrival order), so that a quiet tenant's prompt
        joins the next batch rather than waiting behind a noisy tenant's backlog."""
        if not self.fair:
            return jobs
        by_tenant: dict[str, list[PrefillJob]] = {}
        for job in jobs:
            by_tenant.setdefault(job.request.tenant, []).append(job)
        rounds = itertools.zip_longest(*by_tenant.values())
        return [job for row in rounds for job in row if job is not None]

    def _run_hits(self, jobs: list[PrefillJob], results: list[PrefillResult]) -> None:
        """Prompts that start with cached blocks: each its own call with its past (its rest chunked
        among the long prompts when longer than `chunk_tokens`). Each computed one is delivered at
        once: a burst of hits would otherwise wait for the last of them to get a first token."""
        for job in jobs:
            chunks = self.runner.prefill([job.run], self.chunk_tokens)
            if job.compute is None and job.computed_tokens > self.chunk_tokens:
                self._long.append((job, chunks))
            elif job.aborted:
                results.append(PrefillResult(job))
            else:
                started = time.monotonic()
                try:
                    prompt = job.compute() if job.compute is not None else _only(next(chunks))
                except Exception as error:
                    results.append(PrefillResult(job, error=error))
                    continue
                self._observe(time.monotonic() - started, 1, job.computed_tokens)
                self._deliver([PrefillResult(job, prompt)])

    def _run_short(self, jobs: list[PrefillJob], results: list[PrefillResult]) -> None:
        """Prompts of up to `chunk_tokens` in left-padded batches of up to `chunk_tokens` tokens."""
        batch: list[PrefillJob] = []
        tokens = 0
        for job in jobs:
            if job.aborted:
                results.append(PrefillResult(job))
                continue
            if batch and tokens + len(job.token_ids) > self.chunk_tokens:
                self._run_batch(batch, results)
                batch, tokens = [], 0
            batch.append(job)
            tokens += len(job.token_ids)
        if batch:
            self._run_batch(batch, results)

    def _run_batch(self, batch: list[PrefillJob], results: list[PrefillResult]) -> None:
        """One call for the batch; if it fails, each prompt alone, so the failure stays with its cause."""
        started = time.monotonic()
        try:
            *_, prompts = self.runner.prefill([j.run for j in batch], self.chunk_tokens)
            assert prompts is not None
        except Exception as error:
            if len(batch) == 1:
                results.append(PrefillResult(batch[0], error=error))
                return
            for job in batch:
                self._run_batch([job], results)
            return
        self._observe(time.monotonic() - started, len(batch), sum(len(j.token_ids) for j in batch))
        results.extend(PrefillResult(job, prompt) for job, prompt in zip(batch, prompts, strict=True))

    def _advance_long(self, results: list[PrefillResult]) -> None:
        """One chunk of the oldest long prompt."""
        if not self._long:
            return
        job, chunks = self._long[0]
        if job.aborted:
            self._long.popleft()
            self._long_done = 0
            results.append(PrefillResult(job))
            return
        started = time.monotonic()
        try:
            computed = next(chunks)
        except Exception as error:
            self._long.popleft()
            self._long_done = 0
            results.append(PrefillResult(job, error=error))
            return
        tokens = min(self.chunk_tokens, job.computed_tokens - self._long_done)
        self._observe(time.monotonic() - started, 1, tokens)
        self._long_done += tokens
        if computed is not None:
            self._long.popleft()
            self._long_done = 0
            results.append(PrefillResult(job, _only(computed)))


class TailWorker(_JobThread):
    """Prefix-cache hits with a short tail left to compute, and light tenants' short prompts under fair
    scheduling (PromptDispatch), on a thread of their own at the decode thread's priority, one call
    each (the runner's one-thread tail session: this thread does the work; with nothing decoding,
    the session of every prefill thread). Behind the prefill worker's
    lower priority such a tail waits for CPU the decode steps and the streams hold, far longer than
    it takes; on the engine thread itself it would stall every running sequence's step for it."""

    def __init__(
        self,
        runner: ModelRunner,
        deliver: Callable[[list[PrefillResult]], None],
        observe: Callable[[float, int, int], None],
        name: str,
        idle: Callable[[], bool] = lambda: False,
    ) -> None:
        """`idle()`: no sequence decodes now (a tail may then take every prefill thread)."""
        self.runner = runner
        self._observe = observe
        self._idle = idle
        super().__init__(f"tails-{name}", deliver)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._jobs and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                job = self._jobs.popleft()
            self._deliver([self._run(job)])

    def _run(self, job: PrefillJob) -> PrefillResult:
        if job.aborted:
            return PrefillResult(job)
        started = time.monotonic()
        try:
            lane = Lane.IDLE_TAIL if self._idle() else Lane.TAIL
            *_, computed = self.runner.prefill([job.run], len(job.token_ids), lane)
            prompt = _only(computed)
        except Exception as error:
            return PrefillResult(job, error=error)
        self._observe(time.monotonic() - started, 1, job.computed_tokens)
        return PrefillResult(job, prompt)


def _only(computed: list[PrefilledPrompt] | None) -> PrefilledPrompt:
    """The one prompt of a one-prompt call."""
    assert computed is not None and len(computed) == 1
    return computed[0]
