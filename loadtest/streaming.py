"""One timed GenerateStream call, as every load generator here measures it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc


@dataclass
class StreamTiming:
    seconds: float = 0.0
    time_to_first_token: float | None = None
    gaps: list[float] = field(default_factory=list)  # between chunks that carried text
    received_bytes: int = 0
    completion_tokens: int = 0
    error: grpc.RpcError | None = None

    @property
    def mean_inter_token(self) -> float | None:
        return sum(self.gaps) / len(self.gaps) if self.gaps else None


def timed_stream(stub: generation_pb2_grpc.GenerationStub, request: pb.GenerateRequest, timeout: float) -> StreamTiming:
    timing = StreamTiming()
    started = time.perf_counter()
    last = started
    try:
        for chunk in stub.GenerateStream(request, timeout=timeout):
            now = time.perf_counter()
            if timing.time_to_first_token is None:
                timing.time_to_first_token = now - started
            elif chunk.text:
                timing.gaps.append(now - last)
            last = now
            timing.received_bytes += len(chunk.text.encode("utf-8"))
            if chunk.finish_reason:
                timing.completion_tokens = chunk.usage.completion_tokens
    except grpc.RpcError as error:
        timing.error = error
    timing.seconds = time.perf_counter() - started
    return timing
