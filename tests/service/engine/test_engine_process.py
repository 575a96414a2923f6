"""The engine core runs in its own process: what clients, health and the OS see when it dies.

Everything here goes through the real server (service.process.ServerProcess), a real gRPC client
and the real /proc: the core is killed with SIGKILL as the OOM killer would.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from loadtest.streaming import timed_stream
from service.api import generation_pb2 as pb
from service.engine.core import StepOutputs
from service.engine.messages import Outputs, RequestOutput, RequestStatus, Stopped
from service.engine.processing.output_processor import Finished, OutputBatch, OutputProcessor, TokenMetrics
from service.engine.request import Request, SamplingParams
from service.metrics import ServiceMetrics
from service.process import ServerProcess, wait_for
from service.server_config import parse_config
from tests.service.engine.prompts.test_segments import DOCUMENT, segmented
from tests.service.test_service import offline_greedy_text

LONG = 3000  # new tokens: a stream still running when the core is killed
RESUMED = 400  # new tokens of a request resumed after the kill, compared with an uninterrupted run


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture()
def server(repository: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    flags = getattr(request, "param", ())  # extra server flags, where a test parametrizes them
    process = ServerProcess(repository, "--models", "alibi", "--max-new-tokens-limit", str(LONG), *flags).wait_serving()
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


def read_until(
    stream: Iterator[pb.GenerateStreamResponse], text: list[str], size: int,
    chunks: list[pb.GenerateStreamResponse] | None = None,
) -> None:  # fmt: skip
    """Chunks into `text` (and `chunks`) until it holds `size` characters (the stream still running)."""
    while len("".join(text)) < size:
        chunk = next(stream)
        assert chunk.finish_reason == pb.FINISH_REASON_UNSPECIFIED, "the stream ended before the kill"
        text.append(chunk.text)
        if chunks is not None:
            chunks.append(chunk)


def kill_core(server: ServerProcess) -> int:
    core = server.engine_core_pid()
    assert core is not None and alive(core)
    os.kill(core, signal.SIGKILL)
    return core


SEEDED = pb.GenerateRequest(
    model="alibi", prompt="import os\n", max_new_tokens=RESUMED, temperature=0.8, top_k=40, top_p=0.95, seed=17,
    logprobs=2,
)  # fmt: skip


def stream_logprobs(chunks: list[pb.GenerateStreamResponse]) -> tuple[list[int], np.ndarray]:
    """A stream's tokens and their log-probabilities (the chosen token's, then its alternatives')."""
    entries = [entry for chunk in chunks for entry in chunk.logprobs]
    return [e.token_id for e in entries], np.array([[e.logprob, *e.top_logprobs] for e in entries])


@pytest.mark.parametrize(
    "server", [(), ("--speculative-tokens", "8", "--speculative-max-batch", "8")], indirect=True,
    ids=["plain", "speculative"],
)  # fmt: skip
def test_streams_resume_on_the_restarted_core_with_the_text_of_an_uninterrupted_run(
    server: ServerProcess, repository: Path
) -> None:
    """kill -9 of the core mid-stream: greedy and seeded streams go on where their clients are, no byte
    twice or missing, and end with the uninterrupted text; health dips and comes back; the resumed
    requests are counted and their stall measured."""
    prompt = "def main():\n"
    greedy = pb.GenerateRequest(model="alibi", prompt=prompt, max_new_tokens=RESUMED, logprobs=2)
    seeded_chunks = list(server.stub.GenerateStream(SEEDED, timeout=120))
    seeded_alone = "".join(c.text for c in seeded_chunks)
    alone = [stream_logprobs(list(server.stub.GenerateStream(greedy, timeout=120))), stream_logprobs(seeded_chunks)]
    expected, _ = offline_greedy_text(repository, "alibi", prompt, RESUMED)
    seen: list[int] = []
    stop = threading.Event()
    watch_health(server, seen, stop)
    assert wait_for(lambda: seen == [health_pb2.HealthCheckResponse.SERVING])

    streams = [server.stub.GenerateStream(r, timeout=120) for r in (greedy, greedy, SEEDED)]
    texts: list[list[str]] = [[], [], []]
    received: list[list[pb.GenerateStreamResponse]] = [[], [], []]
    for stream, text, chunks in zip(streams, texts, received, strict=True):
        read_until(stream, text, 20, chunks)  # each is running
    core = kill_core(server)
    finals = []
    for stream, text, chunks in zip(streams, texts, received, strict=True):
        for chunk in stream:
            text.append(chunk.text)
            chunks.append(chunk)
        finals.append(chunk)
    assert ["".join(t) for t in texts] == [expected, expected, seeded_alone]
    # Log-probabilities go on across the restart: every token's once, none missing, none repeated.
    for chunks, (tokens, values) in zip(received, [alone[0], alone[0], alone[1]], strict=True):
        resumed_tokens, resumed_values = stream_logprobs(chunks)
        assert resumed_tokens == tokens
        np.testing.assert_allclose(resumed_values, values, atol=1e-4)
    generated = len(expected.encode())
    assert finals[0].usage.completion_tokens in (generated, generated + 1)  # + an EOS
    assert finals[0].usage.prompt_tokens == len(prompt.encode()) + 1

    assert wait_for(lambda: seen[-1:] == [health_pb2.HealthCheckResponse.SERVING] and len(seen) >= 3, timeout=60)
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
    stop.set()
    replacement = server.engine_core_pid()
    assert replacement is not None and replacement != core and not alive(core)
    assert server.metric("posenc_engine_restarts_total") == 1
    assert server.metric("posenc_resumed_requests_total") == 3
    assert server.metric("posenc_resume_failures_total") == 0
    assert server.metric("posenc_resume_stall_seconds_count") == 3
    # Nothing of the old core's requests is held: the new core's sequences hold no cache (the prefix
    # cache keeps the resubmitted prompts' blocks) and nothing runs.
    assert wait_for(lambda: server.metric("posenc_running_sequences", model="alibi") == 0)
    assert server.sequence_bytes("posenc_kv_cache_used_bytes", model="alibi") == 0


def test_a_stream_built_from_reusable_segments_resumes_with_its_segments_reused(server: ServerProcess) -> None:
    """kill -9 under a request built from segments: the new core rebuilds it as it was, its reusable
    segment placed rather than recomputed in context (alibi's keys carry no position), so the stream
    ends with the text of an uninterrupted run and reports the segment's tokens as reused."""
    request = segmented("alibi", "# first\n")
    request.max_new_tokens = RESUMED
    alone = list(server.stub.GenerateStream(request, timeout=120))
    assert alone[-1].usage.reused_prompt_tokens == len(DOCUMENT)
    stream = server.stub.GenerateStream(request, timeout=120)
    text: list[str] = []
    read_until(stream, text, 20)
    kill_core(server)
    chunks = list(stream)
    text += [chunk.text for chunk in chunks]
    assert "".join(text) == "".join(chunk.text for chunk in alone)
    assert chunks[-1].usage.reused_prompt_tokens == len(DOCUMENT)  # the new core reused it too
    assert server.metric("posenc_resumed_requests_total") == 1


def test_a_unary_generate_resumes_on_the_restarted_core(server: ServerProcess, repository: Path) -> None:
    """A unary call shows nothing until it ends, so the kill waits for its first tokens in the core's
    counter, polled every 5 ms: 1,200 tokens take 0.2 s on a fast machine (400 ended between two
    polls of 50 ms)."""
    prompt, new_tokens = "class Parser:\n", 3 * RESUMED
    request = pb.GenerateRequest(model="alibi", prompt=prompt, max_new_tokens=new_tokens)
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(server.stub.Generate, request, timeout=120)
        assert wait_for(lambda: generated(server) >= 8, timeout=30, interval=0.005)
        kill_core(server)
        response = reply.result()
    expected, _ = offline_greedy_text(repository, "alibi", prompt, new_tokens)
    assert response.text == expected
    assert server.metric("posenc_resumed_requests_total") == 1


def generated(server: ServerProcess) -> float:
    """Tokens the core has generated so far (0 before the first)."""
    try:
        return server.metric("posenc_generated_tokens_total", model="alibi")
    except KeyError:
        return 0.0


def unavailable(call: Callable[[], object]) -> str:
    """The details of the UNAVAILABLE that `call` ends with."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    return caught.value.details()


def wait_resumed_and_running(server: ServerProcess, resumed: int) -> None:
    """Until `resumed` requests have been resumed and the new core has generated tokens since: text a
    client reads after a kill may have been on its way from the old core, the new one not yet started."""
    assert wait_for(lambda: server.metric("posenc_resumed_requests_total") == resumed, timeout=60)
    tokens = generated(server)
    assert wait_for(lambda: generated(server) >= tokens + 8, timeout=60)


def test_a_request_whose_cores_keep_dying_ends_with_unavailable_and_says_why(server: ServerProcess) -> None:
    """A request is resumed at most RESUMES_ALLOWED times; the core's next death ends it with a clear
    UNAVAILABLE (a non-retrying client loses it; the server stays up within its restart budget).
    A unary Generate and a stream alike: the unary one arrived first, so it is resubmitted first
    and runs on each new core by the time the stream's text goes on."""
    unary = pb.GenerateRequest(model="alibi", prompt="class A:\n", max_new_tokens=LONG, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(server.stub.Generate, unary, timeout=300)
        assert wait_for(lambda: server.metric("posenc_running_sequences", model="alibi") == 1, timeout=30)
        stream = server.stub.GenerateStream(
            pb.GenerateRequest(model="alibi", prompt="def f(x):\n", max_new_tokens=LONG)
        )
        text: list[str] = []
        for kills in range(1, 4):
            read_until(stream, text, 20 * kills)
            if kills > 1:
                wait_resumed_and_running(server, resumed=2 * (kills - 1))
            kill_core(server)
        expected = "engine process was killed (signal 9); the request ran on 3 engine cores that died: not resumed"
        assert unavailable(lambda: [None for _ in stream]) == expected
        assert unavailable(reply.result) == expected
    assert server.metric("posenc_resumed_requests_total") == 4
    assert server.metric("posenc_resume_failures_total") == 2
    assert wait_for(lambda: server_serving(server), timeout=60)


CANNOT_FIT = re.compile(
    r"engine process was killed \(signal 9\); the request could not be resumed: cannot resume: its prompt "
    r"\(\d+ tokens\) and the (\d+) tokens it produced exceed max_sequence_tokens=128, the longest prompt this "
    r"server computes"
)


def test_a_request_that_no_longer_fits_ends_with_unavailable_and_says_why(repository: Path) -> None:
    """A bounded cache policy lets a request generate past the longest sequence this server computes
    (--max-sequence-tokens 128); once it has, a new core cannot rebuild it (prompt + output would be
    one prompt of more than 128 tokens): the unary Generate and the stream both end with UNAVAILABLE
    naming the limit, counted as resume failures, and the server goes on serving."""
    server = ServerProcess(
        repository, "--models", "alibi", "--max-sequence-tokens", "128", "--max-new-tokens-limit", str(LONG)
    ).wait_serving()
    try:
        long = {"model": "alibi", "max_new_tokens": LONG, "cache_policy": "window:64", "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(server.stub.Generate, pb.GenerateRequest(prompt="class A:\n", **long), timeout=300)
            assert wait_for(lambda: generated(server) > 200, timeout=60)  # past 128 tokens
            stream = server.stub.GenerateStream(pb.GenerateRequest(prompt="def f(x):\n", **long), timeout=300)
            read_until(stream, [], 200)  # one byte a token: past 128 tokens too
            kill_core(server)
            refusals = [unavailable(lambda: [None for _ in stream]), unavailable(reply.result)]
        for details in refusals:
            match = CANNOT_FIT.fullmatch(details)
            assert match is not None and int(match[1]) > 128, details
        assert server.metric("posenc_resumed_requests_total") == 0
        assert server.metric("posenc_resume_failures_total") == 2
        assert wait_for(lambda: server_serving(server), timeout=60)
        short = pb.GenerateRequest(model="alibi", prompt="x = ", max_new_tokens=4, ignore_eos=True)
        assert server.stub.Generate(short, timeout=60).usage.completion_tokens == 4
    finally:
        server.stop()


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
        self.sent: list[Any] = []

    def send(self, message: Any) -> None:
        self.sent.append(message)


def _processor(on_stop: Callable[[], None] = lambda: None) -> OutputProcessor:
    metrics = ServiceMetrics(CollectorRegistry())
    labels = {"model": "m", "scheme": "alibi", "policy": "full"}
    children = [metrics.time_to_first_token, metrics.inter_token_latency, metrics.generated_tokens]
    return OutputProcessor(257, {"full": TokenMetrics(*(child.labels(**labels) for child in children))}, on_stop)


def test_step_outputs_deliver_each_step_on_the_publisher_and_send_it_as_one_message() -> None:
    """Each submitted step is delivered (text, final events, observations) on the publisher
    thread, in order, and sent as one message; a final entry carries usage and times."""
    sender = _Sender()
    outputs = StepOutputs(sender)  # type: ignore[arg-type]
    processor = _processor()
    observed: list[tuple[float, str]] = []
    a = Request("a", "m", [1, 2, 3], SamplingParams(2), 257)
    b = Request("b", "m", [1], SamplingParams(8), 257)
    a.output, b.output = outputs.sink(a), outputs.sink(b)
    outputs.flush()
    assert sender.sent == []  # nothing produced: nothing sent
    now = time.monotonic()
    first = OutputBatch(tokens=[(a, ord("x"), now), (b, ord("y"), now)])
    first.records.append((lambda value: observed.append((value, threading.current_thread().name)), 0.25))
    outputs.submit(processor.deliver, first)
    a.status = RequestStatus.FINISHED_LENGTH  # as the loop marks it when it decides
    outputs.submit(processor.deliver, OutputBatch(tokens=[(a, ord("z"), now)], finishes=[Finished(a, a.status)]))
    outputs.flush(then=Stopped(0, 0))
    outputs.close_publisher()
    assert observed == [(0.25, "publisher")]  # observations are applied there
    assert sender.sent[0] == Outputs([RequestOutput("a", "x"), RequestOutput("b", "y")])
    (entry,) = sender.sent[1].entries
    assert (entry.request_id, entry.text, entry.status, entry.error) == ("a", "z", RequestStatus.FINISHED_LENGTH, None)
    assert (entry.final.prompt_tokens, entry.final.completion_tokens) == (3, 2)
    assert sender.sent[2] == Stopped(0, 0)
    assert "a" not in outputs.requests and "b" in outputs.requests


def test_a_stop_string_found_after_the_loop_moved_on_ends_the_text_and_the_count_there() -> None:
    """The publisher finds a stop string one step after the loop sampled past it: the client's
    text ends before the stop string and its usage counts the tokens up to it, not the extra one."""
    sender = _Sender()
    outputs = StepOutputs(sender)  # type: ignore[arg-type]
    stops: list[bool] = []
    processor = _processor(on_stop=lambda: stops.append(True))
    request = Request("r", "m", [1], SamplingParams(16, stop=("END",)), 257)
    request.output = outputs.sink(request)
    now = time.monotonic()
    for token in b"okEND!":  # "!" is the step the loop decoded before it learned of the stop
        outputs.submit(processor.deliver, OutputBatch(tokens=[(request, token, now)]))
    request.status = RequestStatus.FINISHED_STOP  # the loop's next step reaps it
    outputs.submit(processor.deliver, OutputBatch(finishes=[Finished(request, RequestStatus.FINISHED_STOP)]))
    outputs.close_publisher()
    text = "".join(entry.text for message in sender.sent for entry in message.entries)
    final = sender.sent[-1].entries[-1]
    assert text == "ok" and stops == [True]
    assert final.status == RequestStatus.FINISHED_STOP and final.final.completion_tokens == 5  # o k E N D


class _TimedSender(_Sender):
    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def send(self, message: Any) -> None:
        self.times.append(time.monotonic())
        super().send(message)


def test_paced_outputs_send_first_tokens_and_finishes_at_once_and_the_rest_together() -> None:
    """With an interval, a stream's continuing tokens wait for it and go out as one message; a
    first token and a finish do not wait (time to first token and the end are not delayed)."""
    sender = _TimedSender()
    interval = 0.5
    outputs = StepOutputs(sender, interval)  # type: ignore[arg-type]
    processor = _processor()
    request = Request("r", "m", [1], SamplingParams(8), 257)
    request.output = outputs.sink(request)
    now = time.monotonic()
    started = time.monotonic()
    outputs.submit(processor.deliver, OutputBatch(tokens=[(request, ord("a"), now)], first_tokens=True))
    assert wait_for(lambda: len(sender.sent) == 1, timeout=30)
    assert sender.times[0] - started < interval * 0.9  # at once: it did not wait for the interval
    for token in b"bcd":
        outputs.submit(processor.deliver, OutputBatch(tokens=[(request, token, now)]))
    assert wait_for(lambda: len(sender.sent) == 2, timeout=30)
    assert sender.sent[1] == Outputs([RequestOutput("r", "bcd")])  # three steps, one message
    assert sender.times[1] - started >= interval * 0.9  # it waited for the interval
    outputs.submit(processor.deliver, OutputBatch(tokens=[(request, ord("e"), now)]))
    ended = time.monotonic()
    request.status = RequestStatus.FINISHED_LENGTH
    outputs.submit(processor.deliver, OutputBatch(finishes=[Finished(request, request.status)]))
    assert wait_for(lambda: len(sender.sent) == 3, timeout=30)
    assert sender.times[2] - ended < interval * 0.9  # the end cut the wait short
    (entry,) = sender.sent[2].entries
    assert (entry.text, entry.status, entry.final.completion_tokens) == ("e", RequestStatus.FINISHED_LENGTH, 5)
    outputs.close_publisher()


def test_a_paced_stream_arrives_in_few_chunks_with_every_token_and_every_metric(repository: Path) -> None:
    """Through the real server with a long --stream-interval-ms: the first token comes alone, the
    rest in one or two messages, and the text and the per-token metrics are those of every token."""
    server = ServerProcess(
        repository, "--models", "alibi", "--stream-interval-ms", "1000", "--max-new-tokens-limit", "256"
    ).wait_serving()  # fmt: skip
    try:
        prompt, tokens = "def main():\n", 256
        before = server.metric("posenc_inter_token_latency_seconds_count", model="alibi")
        chunks = list(server.stub.GenerateStream(
            pb.GenerateRequest(model="alibi", prompt=prompt, max_new_tokens=tokens), timeout=60
        ))  # fmt: skip
        observed = server.metric("posenc_inter_token_latency_seconds_count", model="alibi") - before
        timing = timed_stream(server.stub, pb.GenerateRequest(model="alibi", prompt=prompt, max_new_tokens=tokens), 60)
    finally:
        server.stop()
    text = "".join(chunk.text for chunk in chunks)
    expected, reason = offline_greedy_text(repository, "alibi", prompt, tokens)
    assert text == expected
    generated = len(expected.encode()) + (reason == "eos")  # byte-level: a token per byte, and the EOS
    # The first step's tokens go at once (the one sampled from the prompt and its first decode's, and
    # any step queued by the time the publisher runs), not held back for the interval with the rest.
    assert len(chunks[0].text.encode()) < len(text.encode()) // 2
    assert 2 <= len(chunks) <= 4, [c.text for c in chunks]
    assert chunks[-1].usage.completion_tokens == generated
    assert observed == generated - 1  # one inter-token observation per token after the first
    # What load generators measure: time per token after the first chunk, not per chunk.
    assert timing.received_bytes == len(text.encode())
    assert len(text.encode()) // 2 < timing.decoded_tokens < len(text.encode())  # all but the first chunk
    assert timing.mean_inter_token is not None
    assert timing.mean_inter_token * timing.decoded_tokens <= timing.seconds - (timing.time_to_first_token or 0)


@pytest.mark.parametrize("value", ["-1", "1001", "nan"])
def test_a_stream_interval_out_of_range_is_refused_naming_the_flag(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_config(["--stream-interval-ms", value])
    assert exited.value.code == 2
    assert "--stream-interval-ms must be between 0 and 1000" in capsys.readouterr().err


def test_the_stream_interval_reaches_the_engine_from_its_flag_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_config([]).engine.stream_interval_ms == 4.0
    assert parse_config(["--stream-interval-ms", "0"]).engine.stream_interval_ms == 0.0
    monkeypatch.setenv("POSENC_STREAM_INTERVAL_MS", "12.5")
    assert parse_config([]).engine.stream_interval_ms == 12.5


def test_outputs_carry_the_ids_of_every_delivered_token_with_the_text_they_made() -> None:
    """Token ids travel with text, held-back bytes included (a possible stop string, part of a
    character): a front end that keeps them resumes a request exactly where its client is."""
    sender = _Sender()
    outputs = StepOutputs(sender)  # type: ignore[arg-type]
    processor = _processor()
    request = Request("r", "m", [1], SamplingParams(16, stop=("END",)), 257)
    request.output = outputs.sink(request)
    for token in "ab€EN".encode():
        batch = OutputBatch()
        processor.accept([request], [token], time.monotonic(), batch)
        outputs.submit(processor.deliver, batch)
        outputs.flush()
    outputs.close_publisher()
    entries = [entry for message in sender.sent for entry in message.entries]
    assert [(e.text, bytes(e.token_ids)) for e in entries] == [("a", b"a"), ("b", b"b"), ("€", "€".encode())]
    assert bytes(request.output_ids) == "ab€EN".encode()  # "EN" held back: its ids go with its text, later
