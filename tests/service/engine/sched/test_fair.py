"""Fair scheduling across tenants (service.engine.sched.fair): deficit round robin over tokens at
admission, priorities within a tenant, the running batch shared by weight, and admission control's
estimate of a tenant's share. Pure logic: the scheduler over an allocator that always has room."""

from __future__ import annotations

import itertools

import pytest

from contract.cache_policy import FULL_POLICY, CachePolicy
from service.engine.request import Request, SamplingParams
from service.engine.sched.admission import Backlog, TenantBacklog
from service.engine.sched.fair import WaitingQueue, request_cost
from service.engine.sched.scheduler import NewestFirst, Scheduler

_ids = itertools.count()
_clock = itertools.count(1)


class Roomy:
    """A KV allocator with room for everything (admission limited by the batch alone)."""

    def reserve(
        self, sequence_id: str, tokens: int, policy: CachePolicy = FULL_POLICY, keep: frozenset[int] = frozenset()
    ) -> bool:
        return True

    def free(self, sequence_id: str) -> None:
        pass

    def capacity(self, sequence_id: str) -> int:
        return 0


def make(tenant: str, prompt: int = 20, new: int = 16, priority: int = 0) -> Request:
    request = Request(f"{tenant}-{next(_ids)}", "m", [1] * prompt, SamplingParams(new), eos_token_id=-1)
    request.tenant, request.priority, request.arrival_time = tenant, priority, float(next(_clock))
    return request


def test_one_waiting_request_of_a_quiet_tenant_goes_before_a_noisy_tenant_s_fiftieth() -> None:
    queue = WaitingQueue("fair")
    noisy = [make("noisy") for _ in range(50)]
    queue.extend(noisy)
    quiet = make("quiet")
    queue.append(quiet)
    order = [queue.pop() for _ in range(51)]
    assert order.index(quiet) <= 8  # within one round: the noisy tenant spends one quantum first
    assert [r for r in order if r is not quiet] == noisy  # each tenant's own stay in arrival order


def test_first_come_first_served_keeps_arrival_order_across_tenants() -> None:
    queue = WaitingQueue("fcfs")
    requests = [make("noisy") for _ in range(50)] + [make("quiet")]
    queue.extend(requests)
    assert [queue.pop() for _ in range(51)] == requests


def test_tokens_are_shared_by_weight_whatever_the_request_counts() -> None:
    queue = WaitingQueue("fair", {"big": 3.0})
    queue.extend(make("big", prompt=100, new=28) for _ in range(200))
    queue.extend(make("small", prompt=10, new=22) for _ in range(800))  # a quarter of the tokens each
    served = {"big": 0, "small": 0}
    for _ in range(400):
        request = queue.pop()
        served[request.tenant] += request_cost(request)
    assert served["big"] / served["small"] == pytest.approx(3.0, rel=0.1)


def test_priority_orders_a_tenant_s_own_requests_lower_first() -> None:
    queue = WaitingQueue("fair")
    late, urgent, early = make("a", priority=5), make("a", priority=-1), make("a", priority=5)
    queue.extend([late, urgent, early])
    assert [queue.pop() for _ in range(3)] == [urgent, late, early]


def test_peeking_does_not_change_who_is_next_and_removal_leaves_the_rest() -> None:
    queue = WaitingQueue("fair")
    a, b, c = make("a"), make("b"), make("a")
    queue.extend([a, b, c])
    assert queue[0] is queue[0] is queue.peek()
    queue.remove(a)
    assert len(queue) == 2 and set(queue) == {b, c}
    with pytest.raises(ValueError, match="scheduling"):
        WaitingQueue("lottery")


def test_free_rows_go_round_the_tenants_and_memory_is_taken_from_the_heaviest() -> None:
    scheduler = Scheduler(Roomy(), max_batch_size=4)  # type: ignore[arg-type]
    noisy = [make("noisy") for _ in range(8)]
    for request in noisy:
        scheduler.add(request)
    assert scheduler.schedule().admitted == noisy[:4]
    quiet = make("quiet")
    scheduler.add(quiet)
    assert scheduler.schedule().admitted == []  # the batch is full: nobody gives a row up
    for request in noisy[:4]:
        scheduler.remove(request)
    # The noisy tenant spends the rest of its turn's credit (256 - 4 x 36 tokens: three more), then
    # the quiet tenant's turn comes, ahead of the noisy tenant's eighth.
    assert scheduler.schedule().admitted == [*noisy[4:7], quiet]
    assert scheduler.preemption.victim(scheduler.running) is noisy[6]  # the heaviest tenant's newest
    lone = Scheduler(Roomy(), waiting=WaitingQueue("fcfs"))  # type: ignore[arg-type]
    assert isinstance(lone.preemption, NewestFirst)


def test_the_estimate_counts_other_tenants_only_up_to_the_newcomer_s_share() -> None:
    backlog = Backlog(
        prompt_tokens=5000, waiting=50, tenants=(TenantBacklog("noisy", 4900, 49), TenantBacklog("quiet", 100, 1))
    )
    quiet = backlog.seen_by("quiet", 50)
    assert (quiet.prompt_tokens, quiet.waiting) == (100 + 150, 1 + 2)  # its own, and as much of the other's
    assert backlog.seen_by("noisy", 50).prompt_tokens == 4900 + 100  # all of the quiet one's (it is small)
    heavy = Backlog(tenants=(TenantBacklog("noisy", 4900, 49, weight=1.0), TenantBacklog("quiet", 0, 0, 4.0)))
    assert heavy.seen_by("quiet", 40, 4.0).prompt_tokens == 10  # a quarter of its tokens: its weight is 4
    assert Backlog(prompt_tokens=7).seen_by("anyone", 1) == Backlog(prompt_tokens=7)  # fcfs: everything ahead
