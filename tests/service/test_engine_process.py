"""The engine core runs in its own process: what clients, health and the OS see when it dies.

Everything here goes through the real server (service.process.ServerProcess), a real gRPC client
and the real /proc: the core is killed with SIGKILL as the OOM killer would.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from service.api import generation_pb2 as pb
from service.engine.core import StepOutputs
from service.engine.request import Request, RequestStatus, SamplingParams
from service.process import ServerProcess, wait_for

LONG = 3000  # new tokens: a stream still running when the core is killed


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture()
def server(repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(repository, "--models", "alibi", "--max-new-tokens-limit", str(LONG)).wait_serving()
    yield process
    process.stop()


def watch_health(server: ServerProcess, seen: list[int], stop: threading.Event) -> threading.Thread:
    """Every status the standard health Watch stream sends, in order."""

    def run() -> None:
        try:
            for response in server.health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60):
                seen.append(response.status)
                if stop.is_set():
                    return
        except grpc.RpcError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_killed_core_fails_streams_with_unavailable_and_is_restarted(server: ServerProcess) -> None:
    core = server.engine_core_pid()
    assert core is not None and alive(core)
    seen: list[int] = []
    stop = threading.Event()
    watch_health(server, seen, stop)
    assert wait_for(lambda: seen == [health_pb2.HealthCheckResponse.SERVING])

    request = pb.GenerateRequest(model="alibi", prompt="def main():\n", max_new_tokens=LONG)
    streams = [server.stub.GenerateStream(request, timeout=60) for _ in range(3)]
    for stream in streams:
        next(stream)  # each is running: its first token arrived
    os.kill(core, signal.SIGKILL)
    started = time.monotonic()
    for stream in streams:
        with pytest.raises(grpc.RpcError) as caught:
            for _ in stream:
                pass
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine process was killed (signal 9)" in caught.value.details()
    assert time.monotonic() - started < 10  # ended at once, not by the client's deadline

    # Health went NOT_SERVING, then SERVING again with a new core, which serves.
    assert wait_for(lambda: seen[-1:] == [health_pb2.HealthCheckResponse.SERVING] and len(seen) >= 3, timeout=60)
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
    stop.set()
    replacement = server.engine_core_pid()
    assert replacement is not None and replacement != core and not alive(core)
    reply = server.stub.Generate(pb.GenerateRequest(model="alibi", prompt="x = 1\n", max_new_tokens=8), timeout=30)
    assert reply.usage.completion_tokens == 8
    assert server.metric("posenc_engine_restarts_total") == 1
    # Nothing of the old core's requests is held: the new core's cache is empty and nothing runs.
    assert wait_for(lambda: server.metric("posenc_running_sequences", model="alibi") == 0)
    assert server.metric("posenc_kv_cache_used_bytes", model="alibi") == 0


def test_server_exits_non_zero_when_the_core_keeps_dying(server: ServerProcess) -> None:
    for _ in range(4):  # RESTARTS_ALLOWED = 3 within five minutes
        assert wait_for(lambda: server.engine_core_pid() is not None, timeout=60)
        core = server.engine_core_pid()
        assert core is not None
        assert wait_for(lambda: server_serving(server), timeout=60)
        os.kill(core, signal.SIGKILL)
        assert wait_for(lambda c=core: not alive(c), timeout=10)
    assert server.process.wait(timeout=60) == 1
    assert "giving up: the engine core died 4 times" in server.output()


def server_serving(server: ServerProcess) -> bool:
    try:
        status = server.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
    except grpc.RpcError:
        return False
    return status == health_pb2.HealthCheckResponse.SERVING


def test_core_dies_with_the_front_end(server: ServerProcess) -> None:
    core = server.engine_core_pid()
    assert core is not None
    server.process.kill()  # SIGKILL: no drain, no goodbye
    server.process.wait(timeout=10)
    assert wait_for(lambda: not alive(core), timeout=10)


class _Sender:
    def __init__(self) -> None:
        self.sent: list[list[object]] = []

    def send(self, message: list[object]) -> None:
        self.sent.append(message)


def test_step_outputs_send_one_message_per_step() -> None:
    """Texts of one step are merged per request; a final entry carries usage and times."""
    sender = _Sender()
    outputs = StepOutputs(sender)  # type: ignore[arg-type]
    observed: list[float] = []
    a = Request("a", "m", [1, 2, 3], SamplingParams(8), 257)
    b = Request("b", "m", [1], SamplingParams(8), 257)
    a.output, b.output = outputs.sink(a), outputs.sink(b)
    outputs.flush()
    assert sender.sent == []  # nothing produced: nothing sent
    a.emit("x")
    b.emit("y")
    a.emit("z")
    outputs.record(observed.append, 0.25)
    outputs.flush()
    assert wait_for(lambda: len(sender.sent) == 1)  # sent by the publisher thread
    assert observed == [0.25]  # observations are applied there too
    assert sender.sent[-1][1] == [["a", "xz", None, None, None], ["b", "y", None, None, None]]
    a.output_ids.extend([5, 6])
    a.finish(RequestStatus.FINISHED_LENGTH)
    outputs.flush(then=["after"])
    outputs.close_publisher()
    assert sender.sent[-1] == ["after"]
    (entry,) = sender.sent[-2][1]
    assert entry[:4] == ["a", "", int(RequestStatus.FINISHED_LENGTH), None]
    assert entry[4][:2] == [3, 2]  # prompt and completion tokens
    assert "a" not in outputs.requests and "b" in outputs.requests
