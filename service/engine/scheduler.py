"""Iteration-level (continuous) batching: who runs this step, within cache and batch limits.

Each step every decoding sequence advances one token, and waiting requests are admitted in
arrival order while the batch and the block pool have room; their prompts go to the prefill
worker and join the batch when computed. Blocks are taken one at a time as sequences grow;
when the pool runs dry the newest sequence is preempted (its blocks freed, recomputed later),
as vLLM does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from service.engine.kv_cache import KVCacheManager
from service.engine.request import Request, RequestStatus


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full."""


@dataclass
class SchedulerOutput:
    decode: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # prompts to compute
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_batch_size: int = 32, max_queue: int = 128) -> None:
        self.kv_cache = kv_cache
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"queue is full ({self.max_queue} waiting requests, max_queue={self.max_queue})")
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # 1. Every decoding sequence gets room for the token it feeds this step.
        for request in [r for r in self.running if r.prefill_done]:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted below for an earlier request of this step
            while not self.kv_cache.allocate(request.request_id, request.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.decode.append(request)
        # 2. New requests (and preempted ones) in arrival order, blocks for their whole prompt.
        while self.waiting and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            if not self.kv_cache.allocate(request.request_id, request.prefill_length):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.admitted.append(request)
        return out

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.attempt += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def remove(self, request: Request) -> None:
        """Forget a finished or aborted request and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request.request_id)

    def requests(self) -> list[Request]:
        return [*self.running, *self.waiting]
