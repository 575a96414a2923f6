"""Access control: optional TLS (mutual with a client CA) and bearer-token authentication, the
same for both front ends; tenants, each with its own token and its own prefix cache.

The token check is a server interceptor over every RPC except the standard health service,
which stays reachable for probes; the HTTP API checks the same `Authorization` header on every
path but /health (service.openai_api.app).

Tenants. A token file (--auth-tokens-file) holds one `TENANT:TOKEN[:WEIGHT] [max_concurrent=N]
[tokens_per_minute=N]` per line: the weight is the tenant's share of the server under fair
scheduling (service.engine.sched.fair; 1 by default), the limits its quota (service.quota; the
--tenant-* flags' by default). The token a call carries names its tenant, and every request is
salted by it in the prefix cache, so one tenant's prompts never give another a cache hit (which
would tell, through its time to first token, that someone sent that prompt before: vLLM's
CVE-2025-46570). A client's own `cache_salt` is combined
with its tenant's, never used alone: a salt chosen by the caller alone could be copied from a victim.
"""

from __future__ import annotations

import hmac
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from service.engine.messages import MAX_CACHE_SALT_CHARACTERS, ErrorKind, RequestError

HEALTH_PREFIX = "/grpc.health.v1.Health/"
TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TENANT_WEIGHT = 1000.0


@dataclass(frozen=True)
class TenantTerms:
    """A tenant's share under fair scheduling and its limits (None: the server's default, --tenant-*)."""

    weight: float = 1.0
    max_concurrent: int | None = None  # requests in flight at once
    tokens_per_minute: int | None = None  # prompt and generated tokens over the last 60 s


LIMIT_KEYS = ("max_concurrent", "tokens_per_minute")
OPTIONS = re.compile(rf"(\s+({'|'.join(LIMIT_KEYS)})=\S*)+$")  # a line's trailing limits


class Tenants:
    """Bearer tokens by tenant. No token: anyone may call, as the anonymous tenant "". The single
    --auth-token is tenant "" too: its requests keep today's unsalted prefix cache."""

    def __init__(self, tokens: dict[str, str] | None = None, terms: dict[str, TenantTerms] | None = None) -> None:
        """`tokens`: tenant name -> its token; `terms`: tenant name -> its weight and limits."""
        tokens = tokens or {}
        if len(set(tokens.values())) < len(tokens):
            raise ValueError("tenants: two tenants share a token")
        self._expected = [(bearer(token), tenant) for tenant, token in tokens.items()]
        self.terms = {tenant: (terms or {}).get(tenant, TenantTerms()) for tenant in tokens} or {"": TenantTerms()}

    @property
    def names(self) -> list[str]:
        """Every tenant's name (the only values a metric's `tenant` label takes)."""
        return list(self.terms)

    def weights(self) -> dict[str, float]:
        return {tenant: terms.weight for tenant, terms in self.terms.items() if terms.weight != 1.0}

    @property
    def required(self) -> bool:
        return bool(self._expected)

    def tenant(self, authorization: str) -> str | None:
        """The tenant whose token `authorization` (`Bearer <token>`) carries; None: no tenant's.
        Every token is compared, each in constant time, so the time taken tells nothing of which matched."""
        if not self._expected:
            return ""
        supplied, found = authorization.encode(), None
        for expected, tenant in self._expected:
            if hmac.compare_digest(supplied, expected):
                found = tenant
        return found

    @classmethod
    def read(cls, token: str | None, tokens_file: Path | None) -> Tenants:
        """The single token (tenant "") and the token file's lines (# starts a comment)."""
        tokens = {"": token} if token else {}
        terms: dict[str, TenantTerms] = {}
        lines = tokens_file.read_text().splitlines() if tokens_file is not None else []
        for number, line in enumerate(lines, 1):
            line = line.partition("#")[0].strip()
            if not line:
                continue
            try:
                tenant, secret, terms[tenant] = _tenant_line(line)
            except ValueError as error:
                raise ValueError(f"{tokens_file}:{number}: {error}") from None
            if tenant in tokens:
                raise ValueError(f"{tokens_file}:{number}: tenant {tenant!r} appears twice")
            tokens[tenant] = secret
        return cls(tokens, terms)


def _tenant_line(line: str) -> tuple[str, str, TenantTerms]:
    """`TENANT:TOKEN[:WEIGHT] [max_concurrent=N] [tokens_per_minute=N]` (a token may hold colons:
    a last part that is a number is the weight)."""
    trailing = OPTIONS.search(line)
    options = trailing.group(0).split() if trailing else []
    first = line[: trailing.start()] if trailing else line
    tenant, _, secret = (part.strip() for part in first.partition(":"))
    weight = 1.0
    head, _, tail = secret.rpartition(":")
    if head and re.fullmatch(r"[0-9]+(\.[0-9]+)?", tail):
        secret, weight = head, float(tail)
        if not 0 < weight <= MAX_TENANT_WEIGHT:
            raise ValueError(f"weight: must be in (0, {MAX_TENANT_WEIGHT:g}], got {tail}")
    if not TENANT_NAME.fullmatch(tenant) or not secret:
        raise ValueError(f"expected TENANT:TOKEN[:WEIGHT], TENANT of {TENANT_NAME.pattern}")
    limits: dict[str, int] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in LIMIT_KEYS or not value.isdigit() or int(value) < 1:
            raise ValueError(f"{option!r}: expected one of {', '.join(k + '=N' for k in LIMIT_KEYS)} with N >= 1")
        limits[key] = int(value)
    return tenant, secret, TenantTerms(weight, **limits)


def cache_salt(tenant: str, client_salt: str) -> str:
    """A request's prefix-cache salt: its tenant's name, then the client's salt (a tenant name holds
    no NUL, so no two pairs give one salt); "" for the anonymous tenant without a salt."""
    if len(client_salt) > MAX_CACHE_SALT_CHARACTERS:
        raise RequestError(
            ErrorKind.INVALID_ARGUMENT,
            f"cache_salt: at most {MAX_CACHE_SALT_CHARACTERS} characters, got {len(client_salt)}",
        )
    return f"{tenant}\x00{client_salt}" if tenant or client_salt else ""


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED unless `authorization: Bearer <token>` carries one of the tenants' tokens."""

    def __init__(self, tenants: Tenants) -> None:
        self._tenants = tenants

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or invalid bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:  # fmt: skip
        if handler_call_details.method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self._tenants.tenant(str(metadata.get("authorization", ""))) is not None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


def bearer(token: str) -> bytes:
    """The `authorization` value a client must send: `Bearer <token>`."""
    return f"Bearer {token}".encode()


def ssl_context(cert: Path, key: Path, client_ca: Path | None) -> ssl.SSLContext:
    """The HTTP API's TLS: the gRPC port's certificate and key; with `client_ca`, mutual TLS as there."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def server_credentials(cert: Path, key: Path, client_ca: Path | None) -> grpc.ServerCredentials:
    """TLS with the server's certificate; with `client_ca`, clients must present a certificate it signed."""
    return grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())],
        root_certificates=client_ca.read_bytes() if client_ca else None,
        require_client_auth=client_ca is not None,
    )


def read_token(token: str | None, token_file: Path | None) -> str | None:
    if token_file is not None:
        return token_file.read_text().strip() or None
    return token or None
