"""Prefix affinity through HAProxy, proven on loopback: two real replicas behind Debian's haproxy
running the shipped deploy/haproxy/haproxy.cfg (loadtest/haproxy.py makes only its server lines
static). One routing key, one replica (gRPC and HTTP); keys spread over both; round robin as the
other mode; a replica killed mid-run: every request that had not started is retried elsewhere, and
a stream it was sending ends with an error."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest

from loadtest.haproxy import HAProxy, Replica
from loadtest.study.routing import kill_all
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.process import ServerProcess
from service.routing import ROUTING_HEADER, routing_key

# How a gRPC client sees a stream cut by its replica's death behind the proxy (HAProxy ends it with
# END_STREAM and no status: "Stream removed").
STREAM_CUT = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
LONG_STREAM = 4000


@pytest.fixture(scope="module")
def haproxy(tool: Callable[[str], str]) -> str:
    return tool("haproxy")


@pytest.fixture
def replicas(repository: Path, haproxy: str) -> Iterator[list[ServerProcess]]:
    # Streams long enough to be cut by a kill on a fast machine (1,000 tokens ended before it on CI).
    started = [ServerProcess(repository, "--models", "alibi", "--max-new-tokens-limit", str(LONG_STREAM))
               for _ in range(2)]  # fmt: skip
    try:
        yield [replica.wait_serving() for replica in started]
    finally:
        for replica in started:
            replica.stop()


def start(haproxy: str, replicas: list[ServerProcess], directory: Path, routing: str) -> HAProxy:
    addresses = [Replica(r.target, r.http_url.removeprefix("http://")) for r in replicas]
    proxy = HAProxy(haproxy, directory, addresses, routing)
    time.sleep(1.5)  # the first health checks (every second) have passed
    return proxy


def served(replicas: list[ServerProcess]) -> list[float]:
    counts = []
    for replica in replicas:
        try:
            counts.append(replica.metric("posenc_requests_total", code="OK"))
        except KeyError:
            counts.append(0.0)
    return counts


def generate(stub: generation_pb2_grpc.GenerationStub, key: str, tokens: int = 2) -> pb.GenerateResponse:
    request = pb.GenerateRequest(model="alibi", prompt=f"# {key}\n", max_new_tokens=tokens)
    return stub.Generate(request, metadata=[(ROUTING_HEADER, key)], timeout=60)


def keys_on(replica: ServerProcess, stub: generation_pb2_grpc.GenerationStub, keys: list[str]) -> list[str]:
    """The keys whose calls the proxy sends to `replica`."""
    found = []
    for key in keys:
        before = served([replica])[0]
        generate(stub, key)
        if served([replica])[0] > before:
            found.append(key)
    return found


def long_stream(stub: generation_pb2_grpc.GenerationStub, key: str) -> Iterator[pb.GenerateStreamResponse]:
    request = pb.GenerateRequest(model="alibi", prompt=f"# {key}\n", max_new_tokens=LONG_STREAM, ignore_eos=True)
    return stub.GenerateStream(request, metadata=[(ROUTING_HEADER, key)], timeout=120)


def stream_error(stream: Iterator[pb.GenerateStreamResponse]) -> grpc.RpcError | None:
    """How a stream ended: its error, or None when it finished."""
    try:
        for _ in stream:
            pass
    except grpc.RpcError as error:
        return error
    return None


def test_one_key_one_replica_and_keys_spread(haproxy: str, replicas: list[ServerProcess], tmp_path: Path) -> None:
    proxy = start(haproxy, replicas, tmp_path, "affinity")
    try:
        with grpc.insecure_channel(proxy.target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for key in ("conversation-1", routing_key("def main():\n" * 40)):
                before = served(replicas)
                for _ in range(8):
                    generate(stub, key)
                    httpx.post(proxy.http_url + "/v1/completions", headers={ROUTING_HEADER: key}, timeout=60,
                               json={"model": "alibi", "prompt": "x", "max_tokens": 2}).raise_for_status()  # fmt: skip
                delta = [after - first for after, first in zip(served(replicas), before, strict=True)]
                assert sorted(delta) == [0, 16], delta  # every call of the key on one replica
            before = served(replicas)
            for index in range(40):
                generate(stub, routing_key(f"prompt {index}"))
            delta = [after - first for after, first in zip(served(replicas), before, strict=True)]
            assert sum(delta) == 40 and min(delta) >= 8, delta  # the ring spreads keys over both
        for replica in replicas:  # what the Gateway API Inference Extension's endpoint picker reads
            values = replica.sample(["posenc_queued_sequences", "posenc_running_sequences",
                                     "posenc_kv_cache_usage_ratio"], model="alibi")  # fmt: skip
            assert 0.0 <= values["posenc_kv_cache_usage_ratio"] <= 1.0
    finally:
        proxy.stop()


def test_round_robin_spreads_one_key(haproxy: str, replicas: list[ServerProcess], tmp_path: Path) -> None:
    proxy = start(haproxy, replicas, tmp_path, "round_robin")
    try:
        with grpc.insecure_channel(proxy.target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            before = served(replicas)
            for _ in range(20):
                generate(stub, "one-key")
        delta = [after - first for after, first in zip(served(replicas), before, strict=True)]
        assert delta == [10, 10], delta
    finally:
        proxy.stop()


def test_a_killed_replica_fails_no_request_that_had_not_started(
    haproxy: str, replicas: list[ServerProcess], tmp_path: Path
) -> None:
    proxy = start(haproxy, replicas, tmp_path, "affinity")
    failures: list[Exception] = []
    done = threading.Event()
    try:
        with grpc.insecure_channel(proxy.target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            keys = [routing_key(f"key {index}") for index in range(16)]
            before = served(replicas)
            for key in keys:
                generate(stub, key)
            delta = [after - first for after, first in zip(served(replicas), before, strict=True)]
            victim = replicas[delta.index(max(delta))]
            # One stream (a second would go elsewhere: hash-balance-factor bounds one replica's share),
            # past its first chunk when its replica dies.
            stream = long_stream(stub, keys_on(victim, stub, keys)[0])
            next(stream)

            def unary_calls() -> int:
                calls = 0
                while not done.is_set():
                    for key in keys:
                        try:
                            generate(stub, key, tokens=16)
                        except grpc.RpcError as error:
                            failures.append(error)
                        calls += 1
                return calls

            with futures.ThreadPoolExecutor(4) as pool:
                running = [pool.submit(unary_calls) for _ in range(4)]
                try:
                    time.sleep(1.0)
                    kill_all(victim)  # SIGKILL, front end and engine core: no drain, connections reset
                    ended = stream_error(stream)
                    time.sleep(3.0)
                finally:
                    done.set()
                calls = sum(future.result() for future in running)
            assert calls > 20 and not failures, failures[:3]
            assert ended is not None and ended.code() in STREAM_CUT, ended  # a clear error, not a silent end
    finally:
        done.set()
        proxy.stop()
