"""Who is admitted next among waiting requests: deficit round robin over tokens across tenants, and
each tenant's own requests by priority.

Deficit round robin (Shreedhar and Varghese, "Efficient fair queueing using deficit round robin",
SIGCOMM 1995): every tenant with waiting requests is a flow in a round-robin list; a flow visited
earns `quantum * weight` tokens of credit (its deficit) and spends it on the requests it admits,
each costing the tokens it asks the engine for (uncomputed prompt tokens plus max_new_tokens); a
flow whose next request costs more than its credit waits for the next round, and a flow that
empties loses its credit. Over a busy period each flow gets tokens in proportion to its weight
whatever its request count, and a tenant with one waiting request is admitted within one round,
ahead of another tenant's fiftieth. A request preempted (its row given up) is not charged again.

Within a flow requests go by (priority, arrival): vLLM's priority scheduling, lower values first.
`fcfs` puts every tenant in one flow: first come, first served (priority still orders it).

The running batch is shared the same way (`FairShare`): when memory runs out, the row given up is
the newest of the tenant holding the most rows for its weight. A full batch does not give a row up
to a lighter tenant: its newcomer takes the next row that frees (measured: displacing a noisy
tenant's newest request for each quiet one cost the noisy tenant 28% of its tokens a second, to
halve a 2x TTFT; `python -m loadtest.compare --sections tenants`).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from service.engine.messages import SCHEDULING_POLICIES
from service.engine.request import Request

DRR_QUANTUM_TOKENS = 256  # credit per round at weight 1: about one short request's prompt and output


def request_cost(request: Request) -> int:
    """Tokens a request asks the engine for: its uncomputed prompt and its new tokens (0 when re-admitted
    after a preemption: it was charged once)."""
    if request.attempt:
        return 0
    return max(1, request.prefill_length - request.cached_prompt_tokens + request.params.max_new_tokens)


@dataclass
class _Flow:
    """One tenant's waiting requests, by (priority, arrival), and its credit."""

    heap: list[tuple[int, float, int, Request]] = field(default_factory=list)
    deficit: float = 0.0


class WaitingQueue:
    """The waiting requests of every tenant, admitted by deficit round robin (`fair`) or in one
    flow (`fcfs`). `peek` names the next request without committing; `pop` admits it."""

    def __init__(
        self, policy: str = "fair", weights: dict[str, float] | None = None, quantum: int = DRR_QUANTUM_TOKENS
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling: must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        self.policy, self.weights, self.quantum = policy, dict(weights or {}), quantum
        self._flows: dict[str, _Flow] = {}
        self._round: deque[str] = deque()  # flows with waiting requests, the one being served first
        self._order = itertools.count()  # ties of priority and arrival: the order of insertion
        self._size = 0

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def flow_of(self, request: Request) -> str:
        return request.tenant if self.policy == "fair" else ""

    # ------------------------------------------------------------------ in and out

    def append(self, request: Request) -> None:
        name = self.flow_of(request)
        flow = self._flows.get(name)
        if flow is None:
            flow = self._flows[name] = _Flow()
        new = not flow.heap
        heapq.heappush(flow.heap, (request.priority, request.arrival_time, next(self._order), request))
        self._size += 1
        if new:
            self._round.append(name)
            if len(self._round) == 1:
                self._turn()

    def extend(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.append(request)

    def appendleft(self, request: Request) -> None:
        """A preempted request: back in its flow, ahead of later arrivals of its priority (its
        arrival time stands); not charged again when re-admitted (`request_cost`)."""
        self.append(request)

    def peek(self) -> Request | None:
        """The request deficit round robin admits next (None: nothing waits). Credit earned while
        looking stays with its flow, so looking twice names the same request."""
        while self._round:
            flow = self._flows[self._round[0]]
            head = flow.heap[0][3]
            if flow.deficit >= request_cost(head) or len(self._round) == 1:
                return head
            self._round.rotate(-1)  # its turn ends: the next flow's begins
            self._turn()
        return None

    def _turn(self) -> None:
        """The flow at the head of the round begins its turn: it earns its quantum (credit beyond one
        quantum and its next request's cost is not kept: a flow must not bank a burst)."""
        name = self._round[0]
        flow, quantum = self._flows[name], self.quantum * self.weight(name)
        flow.deficit = min(flow.deficit + quantum, quantum + request_cost(flow.heap[0][3]))

    def pop(self) -> Request:
        """Admit the request `peek` names: its flow pays for it."""
        head = self.peek()
        assert head is not None, "pop from an empty waiting queue"
        name = self._round[0]
        flow = self._flows[name]
        heapq.heappop(flow.heap)
        self._size -= 1
        flow.deficit = max(0.0, flow.deficit - request_cost(head))
        if not flow.heap:
            self._empty(name)
        return head

    def remove(self, request: Request) -> None:
        name = self.flow_of(request)
        flow = self._flows[name]
        flow.heap = [entry for entry in flow.heap if entry[3] is not request]
        heapq.heapify(flow.heap)
        self._size -= 1
        if not flow.heap:
            self._empty(name)

    def _empty(self, name: str) -> None:
        """A flow with nothing waiting leaves the round and loses its credit (DRR's rule)."""
        head = self._round[0] == name
        self._round.remove(name)
        del self._flows[name]
        if head and self._round:
            self._turn()

    # ------------------------------------------------------------------ views

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Request]:
        for flow in list(self._flows.values()):
            yield from (entry[3] for entry in sorted(flow.heap))

    def __getitem__(self, index: int) -> Request:
        """`queue[0]`: the next to be admitted."""
        if index != 0 or not self._size:
            raise IndexError(index)
        head = self.peek()
        assert head is not None
        return head

    def popleft(self) -> Request:
        return self.pop()


class FairShare:
    """The running batch's preemption rule under fair scheduling: the newest request of the tenant
    holding the most rows for its weight gives its row up."""

    def __init__(self, queue: WaitingQueue) -> None:
        self.queue = queue

    def rows(self, running: list[Request]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for request in running:
            counts[request.tenant] = counts.get(request.tenant, 0) + 1
        return counts

    def victim(self, running: list[Request]) -> Request:
        shares = {tenant: rows / self.queue.weight(tenant) for tenant, rows in self.rows(running).items()}
        tenant = max(shares, key=lambda name: shares[name])
        return next(request for request in reversed(running) if request.tenant == tenant)
