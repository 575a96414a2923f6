"""Prefix affinity from the client's side: the routing key a request carries so that a proxy that
hashes it (deploy/haproxy/haproxy.cfg) sends requests sharing a prompt prefix to one replica, whose
prefix cache then holds that prefix once instead of every replica holding it.

The key is a hash of the prompt's first bytes (or of any id the caller chooses instead, such as a
conversation's): prompts that differ only after them get the same key.
"""

from __future__ import annotations

import hashlib

from service.api import generation_pb2 as pb

ROUTING_HEADER = "x-routing-key"  # gRPC metadata and HTTP header alike (lower case, as gRPC requires)
PREFIX_BYTES = 256  # 16 blocks of 16 tokens: long enough to name a shared prefix, short enough to share


def routing_key(prompt: str | bytes, prefix_bytes: int = PREFIX_BYTES) -> str:
    """The key of a prompt: 16 hex digits of SHA-256 over its first `prefix_bytes` bytes (UTF-8)."""
    data = prompt.encode() if isinstance(prompt, str) else prompt
    return hashlib.sha256(data[:prefix_bytes]).hexdigest()[:16]


def request_key(request: pb.GenerateRequest) -> str:
    """A GenerateRequest's key: its prompt's (given as text, segments or token ids)."""
    if request.prompt_token_ids:
        return routing_key(bytes(t for t in request.prompt_token_ids[: PREFIX_BYTES * 2] if t < 256))
    return routing_key(request.prompt or "".join(segment.text for segment in request.segments))


def routing_metadata(request: pb.GenerateRequest) -> list[tuple[str, str]]:
    """The gRPC metadata that routes a request by its prompt's prefix."""
    return [(ROUTING_HEADER, request_key(request))]
