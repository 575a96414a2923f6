"""Client channels that ride out a draining or restarting replica.

A replica that is draining (SIGTERM) or still loading answers UNAVAILABLE before it does any work
for the call, so a retry is always safe: gRPC's own retry policy (the service config below) sends
it again, and behind a per-request load balancer the retry reaches another replica. A stream is
only retried before its first message arrives, so no client ever sees text twice.
CANCELLED is retried too, for one case: gRPC core cancels a call that reaches a server in the
instant it shuts down, before any handler ran (grpc/grpc#41785: it answers CANCELLED where
UNAVAILABLE is meant), which a SIGTERM on a replica behind nginx hits now and then. A retry policy
only ever resends a call that got no response headers, and a client's own cancellation or deadline
ends its call on the client, so no call the server worked on, and none the client gave up, is sent
again. RESOURCE_EXHAUSTED (queue full, or a time-to-first-token target that cannot be met) is not
retried: that is load shedding, and an immediate retry would defeat it.
"""

from __future__ import annotations

import json
import os

import grpc

DEFAULT_TARGET = "localhost:50051"
TARGET_ENV = "POSENC_TARGET"

RETRY_SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": "posenc.v1.Generation"}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.05s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
            },
        }
    ]
}


def default_target() -> str:
    """POSENC_TARGET, else localhost:50051."""
    return os.environ.get(TARGET_ENV, DEFAULT_TARGET)


def channel_options(retry: bool = True) -> list[tuple[str, object]]:
    """Channel arguments carrying the retry policy (on by default)."""
    options: list[tuple[str, object]] = [("grpc.enable_retries", 1 if retry else 0)]
    if retry:
        options.append(("grpc.service_config", json.dumps(RETRY_SERVICE_CONFIG)))
    return options


def open_channel(
    target: str,
    credentials: grpc.ChannelCredentials | None = None,
    retry: bool = True,
) -> grpc.Channel:
    """An insecure or TLS channel to `target` with the retry policy."""
    options = channel_options(retry)
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=options)
    return grpc.insecure_channel(target, options=options)
