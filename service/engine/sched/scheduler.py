"""Iteration-level (continuous) batching: who runs this step, within the KV store and batch limits.

Each step every decoding sequence advances one token, and waiting requests are admitted in the
waiting queue's order (service.engine.sched.fair: deficit round robin across tenants, or arrival
order) while the batch has room and the KV store can allocate their rows; their prompts go to the
prefill worker and are written into those rows when computed. When the store cannot grow a
sequence, the preemption policy picks a victim whose row is freed (recomputed later), as vLLM
does; under fair scheduling the victim is the newest of the tenant holding the most rows for its
weight (`FairShare`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from contract.cache_policy import FULL_POLICY, CachePolicy
from service.engine.messages import RequestStatus
from service.engine.request import Request
from service.engine.sched.admission import Backlog, TenantBacklog
from service.engine.sched.fair import FairShare, WaitingQueue


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full."""


class KVAllocator(Protocol):
    """What the scheduler needs of the KV store: allocation that is the memory, and release."""

    def reserve(
        self,
        sequence_id: str,
        tokens: int,
        policy: CachePolicy = FULL_POLICY,
        keep: frozenset[int] = frozenset(),
    ) -> bool:
        """Room for `tokens` tokens (in a row of the storage its cache `policy` takes); cached prefix
        blocks in `keep` are not evicted for it."""
        ...

    def free(self, sequence_id: str) -> None: ...

    def capacity(self, sequence_id: str) -> int:
        """Tokens the sequence's row holds (0: none reserved)."""
        ...


class PreemptionPolicy(Protocol):
    def victim(self, running: list[Request]) -> Request:
        """The running request to give up its cache when memory runs out (`running` is in admission order)."""
        ...


class NewestFirst:
    """vLLM's default: the most recently admitted request has done the least work to redo."""

    def victim(self, running: list[Request]) -> Request:
        return running[-1]


@dataclass
class SchedulerOutput:
    decode: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # prompts to compute
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        kv: KVAllocator,
        max_batch_size: int = 32,
        max_queue: int = 128,
        preemption: PreemptionPolicy | None = None,
        prefix_blocks: Callable[[Request], frozenset[int]] = lambda request: frozenset(),
        waiting: WaitingQueue | None = None,
    ) -> None:
        """`waiting`: the admission order (fair across tenants by default); under fair scheduling the
        running batch is shared by FairShare, unless `preemption` names another rule."""
        self.kv = kv
        # The prefix cache's keys of a request's prompt blocks: the rows of later admissions must
        # not evict the blocks an earlier one of the same step is about to take.
        self.prefix_blocks = prefix_blocks
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.waiting = waiting if waiting is not None else WaitingQueue()  # (an empty queue is falsy)
        self.fair_share = FairShare(self.waiting) if self.waiting.policy == "fair" else None
        self.preemption: PreemptionPolicy = preemption or self.fair_share or NewestFirst()
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
        # 1. Every decoding sequence gets room for the token it feeds this step. Membership, not
        # `status`, decides who decodes: the delivering thread may mark a request finished by its
        # stop string at any time, and its row stays in the store (so in the step) until reaped.
        preempted: set[str] = set()
        for request in [r for r in self.running if r.prefill_done]:
            if request.request_id in preempted:
                continue  # preempted below for an earlier request of this step
            while not self.kv.reserve(request.request_id, request.cached_tokens):
                victim = self.preemption.victim(self.running)
                self._preempt(victim)
                out.preempted.append(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            else:
                out.decode.append(request)
        # 2. New requests (and preempted ones) in the waiting queue's order: a row for the prompt and its
        # first token (under fair scheduling the next free row goes to the tenant whose turn it is).
        # A row never evicts the cached prefix blocks of a prompt admitted before it in this step,
        # nor its own while others run (it waits for one of them to end rather than recompute
        # them); with nothing running it may evict its own, or it would wait forever.
        # None in a step that preempted (as vLLM v1): the memory just freed would go straight to a
        # waiting prompt, often the victim itself, recomputed at once instead of a decode resumed.
        taken: frozenset[int] = frozenset()
        while self.waiting and len(self.running) < self.max_batch_size and not out.preempted:
            request = self.waiting[0]
            policy = request.cache_policy
            own = self.prefix_blocks(request)
            keep = taken | own if self.running else taken
            if not self.kv.reserve(
                request.request_id, policy.cached(request.prefill_length + 1 + request.lookahead), policy, keep
            ):
                break
            taken |= own
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.admitted.append(request)
        out.decode = [r for r in out.decode if r.request_id not in preempted]
        return out

    def steady_steps(self, decoding: list[Request]) -> int:
        """How many more steps these sequences can decode, a token each, inside the rows they hold:
        the steps the engine may take without `schedule` (nothing to reserve, move or preempt)."""
        steps = sys.maxsize
        for request in decoding:
            capacity, policy = self.kv.capacity(request.request_id), request.cache_policy
            if policy.cached(sys.maxsize) <= capacity:
                continue  # a bounded policy whose budget fits its row: never grows past it
            # Each step adds up to 1 + lookahead tokens and needs room for its guesses beforehand.
            steps = min(steps, (capacity - request.cached_tokens) // (1 + request.lookahead) + 1)
        return max(steps, 0)

    def note_growth(self, decoding: list[Request]) -> None:
        """Sequences of a steady batch grew inside their rows (`steady_steps` left room for the
        next token): the store's count of what each holds catches up, as `schedule` would have
        reserved it, so the used-bytes gauge follows a long steady run."""
        for request in decoding:
            self.kv.reserve(request.request_id, request.cached_tokens)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.attempt += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def remove(self, request: Request) -> None:
        """Forget a finished or aborted request and free its cache."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)

    def requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

    def backlog(self) -> Backlog:
        """What is ahead of a new request now: prompts not yet computed (waiting, or admitted and
        in prefill), the waiting count, and the decode steps each running sequence has left."""
        waiting, running = list(self.waiting), self.running
        pending = [r for r in (*waiting, *running) if not r.output_ids]
        left = sorted(max(0, r.params.max_new_tokens - len(r.output_ids)) for r in running)
        uncached = sum(len(r.prefill_ids) - r.cached_prompt_tokens for r in pending)  # the prefix cache's hits
        return Backlog(uncached, len(waiting), tuple(left), self._tenant_backlogs(pending, waiting))

    def _tenant_backlogs(self, pending: list[Request], waiting: list[Request]) -> tuple[TenantBacklog, ...]:
        """Under fair scheduling, each tenant's part of the backlog (what admission's estimate shares out)."""
        if self.fair_share is None:
            return ()
        tokens: dict[str, int] = {}
        counts: dict[str, int] = {}
        for request in pending:
            tokens[request.tenant] = tokens.get(request.tenant, 0) + len(request.prefill_ids)
            tokens[request.tenant] -= request.cached_prompt_tokens
        for request in waiting:
            counts[request.tenant] = counts.get(request.tenant, 0) + 1
        names = sorted(tokens.keys() | counts.keys())
        weight = self.waiting.weight
        return tuple(TenantBacklog(name, tokens.get(name, 0), counts.get(name, 0), weight(name)) for name in names)
