"""The sessions prompts run through, apart from the decode sessions (runner.py): which exist, which
thread opens them, and when their memory goes back. The runner's prompt calls pick one by lane.

The prefill worker's own session (the fused prompt graph's, or latent attention's up-projected
prompt graph) keeps a memory arena: with glibc's mmap threshold pinned (service/malloc.py) an
arena-less call maps every intermediate fresh and page-faults it in (21,000 faults and about a
quarter of a 2,048-token rope prompt's time, half of an mla prompt's: docs/measurements.md).
`release` gives the arena back to the system, which the prefill worker does once it has been idle a
while.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from service.engine.kv.scratch import ScratchArray
from service.engine.worker.model_session import CacheGraph, ModelSession

# (intra-op threads, memory arena, graph variant) -> a session of the model.
OpenSession = Callable[[int, bool, str], ModelSession]


class Lane(Enum):
    """Which session a prompt call runs in: the prefill worker's (its own thread, lower priority), or
    a prefix-cache hit's short tail on the tail worker's thread (TailWorker): `TAIL` through one
    intra-op thread beside running decode steps, `IDLE_TAIL` through every prefill thread when
    nothing decodes."""

    WORKER = "worker"
    TAIL = "tail"
    IDLE_TAIL = "idle-tail"


@dataclass(frozen=True)
class PromptLane:
    """A prompt call's session (None: the prefill worker's) and the calling thread's kept host memory
    to assemble a cached past into (the tail worker's)."""

    session: ModelSession | None = None
    scratch: ScratchArray | None = None


class PromptSessions:
    """The prefill worker's session (the fused prompt graph's where there is one), one session per
    storage kind for prompts streaming through a bounded row, and the tail worker's sessions."""

    def __init__(
        self,
        open_session: OpenSession,
        graphs: dict[str, CacheGraph],
        dtype: str,
        prompt_variant: str | None,
        serving_prompt_variant: str,
        prefill_threads: int,
        tail_scratch: ScratchArray | None,
        release_call: Callable[[], None],
    ) -> None:
        """`prompt_variant`: the fused prompt graph, or None; `serving_prompt_variant`: the graph of the
        serving contract the worker runs prompts through without one (model_session.serving_prompt_graph).
        `release_call`: a one-token call through the worker session whose run options shrink its arena."""
        self._open, self._graphs, self._dtype, self._release_call = open_session, graphs, dtype, release_call
        self._prompt_variant, self._threads, self._tail_scratch = prompt_variant, prefill_threads, tail_scratch
        self._serving_prompt_variant = serving_prompt_variant
        self.worker: ModelSession | None = None  # open()
        self.by_kind: dict[str, ModelSession] = {}  # open(): by storage kind, for prompts streaming through a row
        self.tail: ModelSession | None = None  # open_tail()
        self.idle_tail: ModelSession | None = None  # open_tail(): all the prefill threads
        self.held = False  # the worker session's arena holds intermediates of past calls
        self.worker_arena = False  # open(): whether the worker session keeps an arena (else it is shared)

    def open(self) -> None:
        """(Re)create the prompt sessions from the calling thread: ONNX Runtime's pool threads inherit
        that thread's OS priority."""
        self.by_kind = {kind: self._open(self._threads, False, graph.variant) for kind, graph in self._graphs.items()}
        own = self._prompt_variant or self._serving_prompt_variant
        self.worker_arena = self._prompt_variant is not None or own != self._graphs[self._dtype].variant
        # Where the worker's graph is the serving graph itself it shares the row-streaming session, which
        # keeps no arena (see ModelSession); else it has a session of its own, with an arena.
        self.worker = self._open(self._threads, True, own) if self.worker_arena else self.by_kind[self._dtype]

    def open_tail(self) -> bool:
        """Fused prompt sessions for prefix-cache hits' short tails (service.engine.prompts.prefill.TailWorker):
        one of one intra-op thread, so the calling thread does the work, at its own priority, beside
        running decode steps; and one of the prefill threads for a tail nothing decodes beside (a
        tail is arithmetic-bound: 64 tokens over 1,600 cached take 3.5 ms on one core, 2.4 on two).
        False where there is no fused prompt graph (such tails go to the prefill worker)."""
        if self._prompt_variant is not None and self.tail is None:
            self.tail = self._open(1, True, self._prompt_variant)
            if self._threads > 1:
                self.idle_tail = self._open(self._threads, True, self._prompt_variant)
        return self.tail is not None

    def release(self) -> None:
        """Give the prefill worker session's arena back to the system (ONNX Runtime frees every arena
        region no live tensor uses). The arena keeps a busy worker's calls from page-faulting their
        intermediates in; released, an idle server's resident memory returns to what its caches hold."""
        if not self.held:  # set by calls through the worker session when it keeps an arena
            return
        self.held = False
        self._release_call()

    def lane(self, lane: Lane) -> PromptLane:
        if lane is Lane.WORKER:
            return PromptLane()
        assert self.tail is not None, "open_tail() first"
        session = self.idle_tail if lane is Lane.IDLE_TAIL and self.idle_tail is not None else self.tail
        return PromptLane(session, self._tail_scratch)
