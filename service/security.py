"""Access control: optional TLS (mutual with a client CA) and bearer-token authentication, the
same for both front ends.

The token check is a server interceptor over every RPC except the standard health service,
which stays reachable for probes; the HTTP API checks the same `Authorization` header on every
path but /health (service.openai_api.app).
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED unless `authorization: Bearer <token>` matches (constant-time compare)."""

    def __init__(self, token: str) -> None:
        self._expected = bearer(token)

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
        if authorized(str(metadata.get("authorization", "")), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


def bearer(token: str) -> bytes:
    """The `authorization` value a client must send: `Bearer <token>`."""
    return f"Bearer {token}".encode()


def authorized(supplied: str, expected: bytes) -> bool:
    """Constant-time comparison of a supplied `authorization` value with `bearer(token)`."""
    return hmac.compare_digest(supplied.encode(), expected)


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
