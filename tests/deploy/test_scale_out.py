"""Scale-out, proven on loopback: two real replicas behind Debian's nginx running the shipped
deploy/nginx/nginx.conf. Balance, streaming, cancellation, deadlines, metadata and draining go
through the proxy (gRPC; balance, unbuffered streaming and cancellation for the HTTP API too), and
each is read back from the replicas' own /metrics.

Only the listen addresses and the upstreams differ from what ships (loadtest.proxy.Proxy).
Clients use service/channel.py's retry channel, as the README tells users to.
"""

from __future__ import annotations

import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest

from loadtest.proxy import Proxy
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.channel import RETRY_SERVICE_CONFIG, open_channel
from service.process import ServerProcess, free_port, wait_for

TOKEN = "scale-out-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
REPLICA_FLAGS = (
    "--models", "alibi", "rope", "--kv-cache-bytes", str(64 << 20), "--max-new-tokens-limit", "2048",
    "--auth-token", TOKEN, "--grace-seconds", "30",
    "--final-scrape-seconds", "5",  # the drained replica's final counters stay readable (SIGTERM test)
)  # fmt: skip
LONG = pb.GenerateRequest(model="alibi", prompt="def main():\n", max_new_tokens=2000)  # seconds of decoding


@pytest.fixture(scope="module")
def nginx(tool: Callable[[str], str]) -> str:
    return tool("nginx")


@pytest.fixture(scope="module")
def replicas(repository: Path, nginx: str) -> Iterator[list[ServerProcess]]:
    started = [ServerProcess(repository, *REPLICA_FLAGS) for _ in range(2)]  # both load at once
    try:
        yield [replica.wait_serving() for replica in started]
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture(scope="module")
def proxy(nginx: str, replicas: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    http = [r.http_url.removeprefix("http://") for r in replicas]
    running = Proxy(nginx, tmp_path_factory.mktemp("nginx") / "proxy", [r.target for r in replicas], http)
    yield running
    running.stop()


def finished(replica: ServerProcess, **labels: str) -> float:
    """Calls the replica finished (its own posenc_requests_total) with these labels; 0 before the first."""
    try:
        return replica.metric("posenc_requests_total", **labels)
    except KeyError:
        return 0.0


def requests_by(replicas: list[ServerProcess], code: str = "OK") -> list[float]:
    """Finished calls per replica with that status code."""
    return [finished(replica, code=code) for replica in replicas]


def unary(stub: generation_pb2_grpc.GenerationStub, i: int, max_new_tokens: int = 4) -> pb.GenerateResponse:
    request = pb.GenerateRequest(model=("alibi", "rope")[i % 2], prompt=f"x{i} = ", max_new_tokens=max_new_tokens)
    return stub.Generate(request, metadata=AUTH, timeout=30)


def stream(stub: generation_pb2_grpc.GenerationStub, i: int) -> list[pb.GenerateStreamResponse]:
    request = pb.GenerateRequest(model=("rope", "alibi")[i % 2], prompt=f"def f{i}():\n", max_new_tokens=8)
    return list(stub.GenerateStream(request, metadata=AUTH, timeout=30))


def test_every_call_is_balanced_and_both_replicas_serve_a_fair_share(
    proxy: Proxy, replicas: list[ServerProcess]
) -> None:
    before = requests_by(replicas)
    with futures.ThreadPoolExecutor(8) as pool:  # one client connection, eight calls in flight
        answers = list(pool.map(lambda i: unary(proxy.stub, i), range(200)))
        streams = list(pool.map(lambda i: stream(proxy.stub, i), range(50)))
    assert all(answer.finish_reason != pb.FINISH_REASON_UNSPECIFIED for answer in answers)
    assert all(chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED for chunks in streams)
    served = [after - first for after, first in zip(requests_by(replicas), before, strict=True)]
    assert sum(served) == 250
    assert all(0.35 <= count / 250 <= 0.65 for count in served), served


def test_metadata_reaches_the_replica(proxy: Proxy) -> None:
    """The bearer token passes through (every other test depends on it); without it the replica,
    not nginx, refuses the call, and the client does not retry that."""
    assert unary(proxy.stub, 0).finish_reason != pb.FINISH_REASON_UNSPECIFIED
    request = pb.GenerateRequest(model="alibi", prompt="x = ", max_new_tokens=4)
    with pytest.raises(grpc.RpcError) as error:
        proxy.stub.Generate(request, timeout=30)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "bearer token" in error.value.details()


def test_a_stream_cancelled_through_the_proxy_frees_its_cache_on_the_replica(
    proxy: Proxy, replicas: list[ServerProcess]
) -> None:
    def total(name: str) -> float:
        return sum(replica.metric(name, model="alibi") for replica in replicas)

    cancellations = total("posenc_cancellation_latency_seconds_count")
    call = proxy.stub.GenerateStream(LONG, metadata=AUTH, timeout=60)
    for _ in range(5):
        next(call)
    assert total("posenc_kv_cache_used_bytes") > 0
    call.cancel()
    assert wait_for(lambda: total("posenc_kv_cache_used_bytes") == 0)
    assert wait_for(lambda: total("posenc_running_sequences") == 0)
    assert total("posenc_cancellation_latency_seconds_count") == cancellations + 1  # the engine saw the cancel


def http_calls(replicas: list[ServerProcess], code: str = "OK") -> list[float]:
    """Finished HTTP API calls per replica with that status code."""
    return [finished(replica, api="http", code=code) for replica in replicas]


def test_the_http_api_is_balanced_and_streams_unbuffered_through_the_proxy(
    proxy: Proxy, replicas: list[ServerProcess]
) -> None:
    before = http_calls(replicas)
    body = {"model": "alibi", "prompt": "x = ", "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=proxy.http_url, headers=dict(AUTH), timeout=60) as client:  # one keep-alive connection
        assert [model["id"] for model in client.get("/v1/models").json()["data"]] == ["alibi", "rope"]
        answers = [client.post("/v1/completions", json=body) for _ in range(20)]
        assert all(a.status_code == 200 and a.json()["usage"]["completion_tokens"] == 4 for a in answers)
        assert client.get("/health").status_code == 200
        # Server-sent events pass as they come: the first chunk long before the last. A fast machine
        # makes 300 tokens in 50 ms, which the front end sends as 10-20 events: ask for 2,000.
        streamed = {**body, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        started, arrivals = time.monotonic(), []
        with client.stream("POST", "/v1/completions", json=streamed) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    arrivals.append((time.monotonic() - started, line))
    assert arrivals[-1][1] == "data: [DONE]" and len(arrivals) > 10
    assert arrivals[0][0] < 0.5 * arrivals[-1][0], (arrivals[0][0], arrivals[-1][0])

    def served() -> list[float]:
        return [after - first for after, first in zip(http_calls(replicas), before, strict=True)]

    # /v1/models, 20 completions and the stream (counted as its handler returns, after [DONE]).
    assert wait_for(lambda: sum(served()) == 22), served()
    assert all(count >= 5 for count in served()), served()


def test_a_client_leaving_an_http_stream_at_the_proxy_cancels_it_on_the_replica(
    proxy: Proxy, replicas: list[ServerProcess]
) -> None:
    def total(name: str) -> float:
        return sum(replica.metric(name, model="alibi") for replica in replicas)

    cancelled = sum(http_calls(replicas, "CANCELLED"))
    body = {"model": "alibi", "prompt": "def main():\n", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", proxy.http_url + "/v1/completions", json=body, headers=dict(AUTH), timeout=60
    ) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert total("posenc_kv_cache_used_bytes") > 0
    assert wait_for(lambda: sum(http_calls(replicas, "CANCELLED")) == cancelled + 1)
    assert wait_for(lambda: total("posenc_kv_cache_used_bytes") == 0)
    assert wait_for(lambda: total("posenc_running_sequences") == 0)


def test_the_client_deadline_reaches_the_replica(proxy: Proxy, replicas: list[ServerProcess]) -> None:
    """grpc-timeout passes through: the replica's engine ends the call at the deadline itself and
    counts DEADLINE_EXCEEDED. Had only the client known the deadline, the replica could only ever
    see (and count) a cancellation. The client's own cancellation at its deadline races the
    replica's deadline, which lies later by the one-way latency through the proxy (both within a
    millisecond), so some calls count as CANCELLED: one DEADLINE_EXCEEDED in up to ten calls is
    the proof (measured: three calls in four)."""

    def ended() -> tuple[float, float]:
        return sum(requests_by(replicas, "DEADLINE_EXCEEDED")), sum(requests_by(replicas, "CANCELLED"))

    for _ in range(10):
        expired, total = ended()[0], sum(ended())
        with pytest.raises(grpc.RpcError) as error:
            proxy.stub.Generate(LONG, metadata=AUTH, timeout=0.3)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_for(lambda total=total: sum(ended()) == total + 1)  # the replica ended it, one way
        if ended()[0] == expired + 1:
            return
    pytest.fail("no replica ever ended a call at its deadline: grpc-timeout does not pass the proxy")


def test_no_reachable_replica_is_a_retryable_unavailable(nginx: str, tmp_path: Path) -> None:
    """nginx's own 502 reaches gRPC clients as a gRPC UNAVAILABLE with the proxy's message (not
    an HTML page), and the channel's policy retries it."""
    proxy = Proxy(nginx, tmp_path / "proxy", [f"127.0.0.1:{free_port()}"])
    try:
        with pytest.raises(grpc.RpcError) as error:
            unary(proxy.stub, 0)
        refused = httpx.post(proxy.http_url + "/v1/completions", json={"model": "alibi", "prompt": "x"}, timeout=30)
    finally:
        proxy.stop()
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error.value.details() == "posenc proxy: no replica reachable"
    attempts = RETRY_SERVICE_CONFIG["methodConfig"][0]["retryPolicy"]["maxAttempts"]
    answered = proxy.log.read_text().count('"POST /posenc.v1.Generation/Generate HTTP/2.0" 204 ')  # access log
    assert answered == attempts  # the channel retried it as often as its policy allows
    # The HTTP API's side: an OpenAI-shaped 503, which OpenAI's clients retry.
    assert refused.status_code == 503
    assert refused.json()["error"] == {"message": "posenc proxy: no replica reachable", "type": "server_error",
                                       "param": None, "code": "service_unavailable"}  # fmt: skip


class Draining(generation_pb2_grpc.GenerationServicer):
    """A replica as the README documents it during its drain: every new call refused with
    UNAVAILABLE before any work."""

    def __init__(self) -> None:
        self.refused = 0

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        self.refused += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "draining")

    GenerateStream = Generate


def test_a_draining_replica_s_refusals_are_retried_on_the_other(
    nginx: str, replicas: list[ServerProcess], tmp_path: Path
) -> None:
    """nginx cannot see a gRPC status; the client's retry policy takes the refused call to the
    next replica. Independent of how the real server drains (next test)."""
    draining = Draining()
    fake = grpc.server(futures.ThreadPoolExecutor(4))
    generation_pb2_grpc.add_GenerationServicer_to_server(draining, fake)
    port = fake.add_insecure_port("127.0.0.1:0")
    fake.start()
    live = replicas[1]
    proxy = Proxy(nginx, tmp_path / "proxy", [f"127.0.0.1:{port}", live.target])
    try:
        before = finished(live, code="OK")
        for i in range(10):
            assert unary(proxy.stub, i).finish_reason != pb.FINISH_REASON_UNSPECIFIED
            assert stream(proxy.stub, i)[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert finished(live, code="OK") == before + 20
        assert draining.refused >= 5  # it kept its share of first attempts
    finally:
        proxy.stop()
        fake.stop(0)


class Resetting:
    """A replica that reads each call nginx writes to it and resets the connection before any answer,
    as a replica does to a kept-alive connection when its port closes or it dies (the reset that
    reached the SIGTERM test's non-retrying client as UNAVAILABLE in one CI run)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.resets, self.received = self.listener.getsockname()[1], 0, 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:  # closed
                return
            with connection:
                connection.settimeout(1)
                received = b""
                try:  # the client preface, SETTINGS and the call's HEADERS and DATA frames
                    while len(received) < 100 and (chunk := connection.recv(4096)):
                        received += chunk
                except TimeoutError:
                    pass
                self.received = max(self.received, len(received))
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.resets += 1  # closing with linger 0 sends RST

    def close(self) -> None:
        self.listener.close()


def test_a_call_reset_before_any_answer_is_the_proxy_s_unavailable_and_the_channel_retries_it(
    nginx: str, replicas: list[ServerProcess], tmp_path: Path
) -> None:
    """nginx streams a gRPC call's body to the replica, so once it has written a call it cannot send
    it to another replica, whatever `grpc_next_upstream` says (`non_idempotent` included: tried). A
    replica that resets the connection before answering therefore reaches a client as the proxy's
    own UNAVAILABLE, the status that means "not processed, retry": a client without a retry policy
    loses that call, `service/channel.py`'s channel gets its answer from the other replica."""
    resetting, live = Resetting(), replicas[1]
    upstreams = [f"127.0.0.1:{resetting.port}", live.target]
    proxy = Proxy(nginx, tmp_path / "plain", upstreams)
    plain = open_channel(f"127.0.0.1:{proxy.port}", retry=False)
    stub = generation_pb2_grpc.GenerationStub(plain)
    try:
        outcomes = []
        for i in range(4):  # round robin: the resetting replica gets the first or the second
            try:
                outcomes.append(unary(stub, i).finish_reason)
            except grpc.RpcError as error:
                outcomes.append((error.code(), error.details()))
        lost = [outcome for outcome in outcomes if isinstance(outcome, tuple)]
        assert lost and set(lost) == {(grpc.StatusCode.UNAVAILABLE, "posenc proxy: no replica reachable")}, outcomes
        assert "while reading response header from upstream" in proxy.log.read_text()
        assert resetting.received >= 100  # the call was written to it, then reset: not refused
    finally:
        plain.close()
        proxy.stop()
    proxy = Proxy(nginx, tmp_path / "retrying", upstreams)  # a fresh rotation, the failure forgotten
    try:
        resets, before = resetting.resets, finished(live, code="OK")
        for i in range(4):
            assert unary(proxy.stub, i).finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert resetting.resets > resets  # one was reset, and the retry policy took it to `live`
        assert finished(live, code="OK") == before + 4
    finally:
        proxy.stop()
        resetting.close()


def test_sigterm_on_one_replica_loses_no_call_of_a_retrying_client_and_its_streams_finish(
    proxy: Proxy, replicas: list[ServerProcess]
) -> None:
    """Runs last: it stops a replica. Calls keep coming from two clients while `leaving` gets
    SIGTERM: the project's (retry policy) and one without retries. Health goes NOT_SERVING, then the
    port closes (GOAWAY) while running calls finish, so nginx sends each new call to `staying`
    (a refused connection is an `error` it may retry): the project's client loses no call and every
    stream already running on `leaving` finishes.

    The client without retries can lose a call that reaches `leaving` in the instant its gRPC server
    shuts down: gRPC core answers it CANCELLED before any handler runs (grpc/grpc#41785; seen in one
    CI run in five), or resets the connection nginx had just written it to, which nginx answers with
    its own UNAVAILABLE (it cannot resend a gRPC call it has written: the reset test above; seen in
    one CI run). So its losses may only be those: few, and never a call the replica's handler
    saw (the replica counted no CANCELLED call)."""
    leaving, staying = replicas
    request = pb.GenerateRequest(model="alibi", prompt="def main():\n", max_new_tokens=1500)
    streams = [proxy.stub.GenerateStream(request, metadata=AUTH, timeout=60) for _ in range(4)]
    for call in streams:
        next(call)  # started, on one replica or the other
    assert leaving.metric("posenc_running_sequences") > 0 and staying.metric("posenc_running_sequences") > 0

    plain = open_channel(f"127.0.0.1:{proxy.port}", retry=False)
    clients = {"retrying": proxy.stub, "not retrying": generation_pb2_grpc.GenerationStub(plain)}
    calls: dict[str, list[tuple[float, grpc.StatusCode, str]]] = {name: [] for name in clients}
    stop = threading.Event()

    def client(name: str) -> None:
        i = 0
        while not stop.is_set():
            started = time.monotonic()
            try:
                unary(clients[name], i) if i % 2 else stream(clients[name], i)
                calls[name].append((started, grpc.StatusCode.OK, ""))
            except grpc.RpcError as error:
                calls[name].append((started, error.code(), error.details() or ""))
            i += 1

    threads = [threading.Thread(target=client, args=(name,)) for name in clients]
    served_before = finished(staying, code="OK")
    cancelled_before = finished(leaving, code="CANCELLED")
    for thread in threads:
        thread.start()
    assert wait_for(lambda: all(calls.values()), timeout=30)  # both clients are calling
    signalled = time.monotonic()
    leaving.process.send_signal(signal.SIGTERM)
    closed: list[float] = []  # when `leaving` stopped taking connections, its streams still running

    def port_closed() -> bool:
        try:
            socket.create_connection(("127.0.0.1", leaving.port), timeout=1).close()
        except OSError:
            closed.append(time.monotonic())
            return True
        return False

    def after(moment: float, count: int) -> bool:
        return all(sum(1 for started, *_ in made if started > moment) >= count for made in calls.values())

    # Calls keep coming through the whole drain: after the signal and after the port closes.
    assert wait_for(port_closed, timeout=30)
    assert wait_for(lambda: after(signalled, 5) and after(closed[0], 2), timeout=30)
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    plain.close()

    last_chunks = [list(call)[-1] for call in streams]  # the drain: each ends normally
    assert all(chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED for chunk in last_chunks)
    for name, made in calls.items():
        assert sum(1 for started, *_ in made if started > signalled) >= 5, name
    assert not [code for _, code, _ in calls["retrying"] if code != grpc.StatusCode.OK]
    refused = [(code, details) for _, code, details in calls["not retrying"] if code != grpc.StatusCode.OK]
    proxy_s = (grpc.StatusCode.UNAVAILABLE, "posenc proxy: no replica reachable")  # a reset call, answered by nginx
    assert len(refused) <= 2, refused
    assert all(code == grpc.StatusCode.CANCELLED or (code, details) == proxy_s for code, details in refused), refused
    cancelled_after: list[float] = []  # read by the scrape that finds `leaving` drained, its last

    def drained() -> bool:
        lines = leaving.metrics().splitlines()
        if "posenc_drained 1.0" not in lines:
            return False
        counted = [line for line in lines if line.startswith("posenc_requests_total{") and 'code="CANCELLED"' in line]
        cancelled_after.append(sum(float(line.rpartition(" ")[2]) for line in counted))
        return True

    assert wait_for(drained, timeout=30)
    assert cancelled_after == [cancelled_before]  # its handlers cancelled nothing
    assert finished(staying, code="OK") > served_before
    assert leaving.process.wait(timeout=40) == 0
