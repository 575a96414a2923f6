"""Per-tenant limits and per-tenant accounting in the front end, shared by gRPC and HTTP.

Two limits, each optional (a tenant's line in --auth-tokens-file, else the --tenant-* flags'):

- `max_concurrent`: generations in flight at once;
- `tokens_per_minute`: prompt and generated tokens over a sliding 60-second window. A request is
  charged its prompt and its max_new_tokens when it is accepted (as OpenAI counts a rate limit),
  and what it really used once it ends.

A request past either is refused at once with RESOURCE_EXHAUSTED (HTTP 429) naming the limit, with
a retry hint: when a request ends (concurrency), or when enough of the window has passed (tokens).
One tenant's limits never touch another's requests. The same object counts each tenant's requests,
tokens, queue time and refusals (service.metrics `posenc_tenant_*`); its `tenant` label takes only
the tenants' names from the token file, never a string a client chose.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from service.api.retry import MIN_RETRY_AFTER_SECONDS
from service.engine.messages import ErrorKind, RequestError
from service.metrics import ServiceMetrics
from service.security import TenantTerms

WINDOW_SECONDS = 60.0
CONCURRENCY_RETRY_SECONDS = 0.5  # a place comes back when one of its requests ends: unknown when, soon at load


@dataclass
class _Charge:
    """Tokens a request is counted for in its tenant's window (its reservation, then its usage)."""

    time: float
    tokens: int


@dataclass
class _TenantState:
    terms: TenantTerms
    in_flight: int = 0
    charges: deque[_Charge] = field(default_factory=deque)

    def used(self, now: float) -> int:
        while self.charges and self.charges[0].time <= now - WINDOW_SECONDS:
            self.charges.popleft()
        return sum(charge.tokens for charge in self.charges)

    def tokens_free_after(self, now: float, needed: int, limit: int) -> float:
        """Seconds until the window holds room for `needed` more tokens."""
        used = self.used(now)
        for charge in self.charges:
            used -= charge.tokens
            if used + needed <= limit:
                return charge.time + WINDOW_SECONDS - now
        return WINDOW_SECONDS


@dataclass
class Ticket:
    """An accepted request's hold on its tenant's quota, given back by `TenantQuota.release`;
    `labels`: its metric labels (model, scheme, tenant)."""

    tenant: str
    charge: _Charge | None
    labels: dict[str, str]
    released: bool = False


class TenantQuota:
    """Each tenant's limits and counters. Every method may be called from any thread."""

    def __init__(
        self,
        terms: dict[str, TenantTerms],
        defaults: TenantTerms | None = None,
        metrics: ServiceMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        defaults = defaults or TenantTerms()
        self._tenants = {
            name: _TenantState(
                TenantTerms(
                    t.weight,
                    t.max_concurrent if t.max_concurrent is not None else defaults.max_concurrent,
                    t.tokens_per_minute if t.tokens_per_minute is not None else defaults.tokens_per_minute,
                )
            )
            for name, t in terms.items()
        }
        self._metrics, self._clock = metrics, clock
        self._lock = threading.Lock()

    def label(self, tenant: str) -> str:
        """The metric label of a tenant: its name when the token file names it (always, for a
        tenant the token check let in), else "" (never a client's string)."""
        return tenant if tenant in self._tenants else ""

    def acquire(self, tenant: str, tokens: int, model: dict[str, str] | None = None) -> Ticket:
        """Hold a place for a request of `tokens` (prompt plus max_new_tokens), or refuse it;
        `model`: the request's model labels (model, scheme; empty for a model not served)."""
        labels = {"model": "", "scheme": "", **(model or {}), "tenant": self.label(tenant)}
        with self._lock:
            state = self._tenants.get(tenant)
            if state is None:
                return Ticket(tenant, None, labels)
            now = self._clock()
            terms = state.terms
            if terms.max_concurrent is not None and state.in_flight >= terms.max_concurrent:
                self._refuse(labels, "max_concurrent", f"{state.in_flight} requests in flight, "
                             f"its max_concurrent is {terms.max_concurrent}", CONCURRENCY_RETRY_SECONDS)  # fmt: skip
            limit = terms.tokens_per_minute
            if limit is not None and state.used(now) + tokens > limit:
                retry = state.tokens_free_after(now, tokens, limit) if tokens <= limit else None
                asked = f"this request asks for {tokens} (prompt and max_new_tokens)"
                self._refuse(labels, "tokens_per_minute", f"{state.used(now)} tokens in the last minute and "
                             f"{asked}, the tenant's tokens_per_minute is {limit}", retry)  # fmt: skip
            state.in_flight += 1
            charge = _Charge(now, tokens) if limit is not None else None
            if charge is not None:
                state.charges.append(charge)
        if self._metrics is not None:
            self._metrics.tenant_requests.labels(**labels).inc()
        return Ticket(tenant, charge, labels)

    def _refuse(self, labels: dict[str, str], limit: str, detail: str, retry_after: float | None) -> None:
        self.refused(labels, limit)
        tenant = labels["tenant"]
        hint = f"; retry after {retry_after:.1f} s" if retry_after is not None else "; it never fits the limit"
        raise RequestError(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"{limit}: tenant {tenant!r} is at its limit ({detail}){hint}",
            retry_after=None if retry_after is None else max(MIN_RETRY_AFTER_SECONDS, math.ceil(retry_after * 10) / 10),
        )

    def refused(self, labels: dict[str, str], reason: str) -> None:
        """A refusal (a limit; or the engine's: admission control, a full queue, a bad request)
        counted for the tenant of `labels` (a Ticket's)."""
        if self._metrics is not None:
            self._metrics.tenant_refusals.labels(**labels, reason=reason).inc()

    def release(self, ticket: Ticket, prompt_tokens: int, completion_tokens: int, queue_seconds: float | None) -> None:
        """The request ended: its place comes back, its window charge becomes what it used, and its
        tokens and queue time are counted."""
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            state = self._tenants.get(ticket.tenant)
            if state is None:
                return
            state.in_flight -= 1
            if ticket.charge is not None:
                ticket.charge.tokens = prompt_tokens + completion_tokens
        if self._metrics is not None:
            labels = ticket.labels
            self._metrics.tenant_tokens.labels(**labels, kind="prompt").inc(prompt_tokens)
            self._metrics.tenant_tokens.labels(**labels, kind="completion").inc(completion_tokens)
            if queue_seconds is not None:
                self._metrics.tenant_queue_time.labels(**labels).observe(queue_seconds)
