"""One timed GenerateStream call, as every load generator here measures it."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.routing import routing_metadata


@dataclass
class StreamTiming:
    seconds: float = 0.0
    time_to_first_token: float | None = None
    decode_seconds: float = 0.0  # from the first chunk to the last that carried text
    decoded_tokens: int = 0  # tokens those later chunks carried (the tokenizer is byte-level: bytes)
    received_bytes: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # from the prefix cache (the last chunk's usage)
    error: grpc.RpcError | None = None

    @property
    def mean_inter_token(self) -> float | None:
        """Decode time per token after the first chunk. Not the mean gap between chunks: a chunk
        may hold several tokens (the server sends continuing tokens together, at most every
        --stream-interval-ms, and merges them when the client lags)."""
        return self.decode_seconds / self.decoded_tokens if self.decoded_tokens else None


def timed_stream(stub: generation_pb2_grpc.GenerationStub, request: pb.GenerateRequest, timeout: float) -> StreamTiming:
    timing = StreamTiming()
    started = time.perf_counter()
    first = started
    try:
        # The routing key: behind a prefix-affinity proxy, requests that share a prefix share a replica.
        for chunk in stub.GenerateStream(request, timeout=timeout, metadata=routing_metadata(request)):
            now = time.perf_counter()
            size = len(chunk.text.encode("utf-8"))
            if timing.time_to_first_token is None:
                timing.time_to_first_token = now - started
                first = now
            elif size:
                timing.decode_seconds = now - first
                timing.decoded_tokens += size
            timing.received_bytes += size
            if chunk.finish_reason:
                timing.completion_tokens = chunk.usage.completion_tokens
                timing.prompt_tokens = chunk.usage.prompt_tokens
                timing.cached_prompt_tokens = chunk.usage.cached_prompt_tokens
    except grpc.RpcError as error:
        timing.error = error
    timing.seconds = time.perf_counter() - started
    return timing
