"""The OpenAI-compatible HTTP API on a real server on loopback: the official client, raw SSE, every
error code, and a client that disconnects mid-stream."""

from __future__ import annotations

import itertools
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from service.api import generation_pb2 as pb
from service.process import ServerProcess, wait_for

PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(repository, "--models", "alibi", "rope").wait_serving()
    yield process
    process.stop()


def client(server: ServerProcess, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key=key, max_retries=0, timeout=60)


def grpc_text(server: ServerProcess, model: str, prompt: str, max_new_tokens: int) -> str:
    request = pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=max_new_tokens)
    return server.stub.Generate(request, timeout=60).text


def sse_events(stream: Iterator[str]) -> list[str]:
    """The `data:` payloads of a server-sent event stream's lines, checking its framing on the way."""
    events, lines = [], []
    for line in stream:
        if line:
            lines.append(line)
            continue
        assert len(lines) == 1 and lines[0].startswith("data: "), lines
        events.append(lines.pop()[len("data: ") :])
    assert not lines
    return events


def test_official_client_sync_completion_equals_grpc(server: ServerProcess) -> None:
    completion = client(server).completions.create(model="alibi", prompt=PROMPT, max_tokens=24, temperature=0)
    assert completion.choices[0].text == grpc_text(server, "alibi", PROMPT, 24)
    assert completion.choices[0].finish_reason in ("length", "stop")
    usage = completion.usage
    assert usage is not None and usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert [model.id for model in client(server).models.list()] == ["alibi", "rope"]


def test_official_client_streaming_completion_and_chat(server: ServerProcess) -> None:
    stream = client(server).completions.create(
        model="rope", prompt=PROMPT, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert text == grpc_text(server, "rope", PROMPT, 30)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 30
    assert chunks[-2].choices[0].finish_reason == "length"
    chat = client(server).chat.completions.create(
        model="alibi", messages=[{"role": "system", "content": "# utils"}, {"role": "user", "content": "import os"}],
        max_tokens=16, temperature=0,
    )  # fmt: skip
    # The documented chat template: contents joined with a newline.
    assert chat.choices[0].message.content == grpc_text(server, "alibi", "# utils\nimport os", 16)
    assert chat.choices[0].message.role == "assistant"
    streamed = client(server).chat.completions.create(
        model="alibi", messages=[{"role": "user", "content": "# utils\nimport os"}], max_tokens=16, temperature=0,
        stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content


def test_raw_sse_is_framed_as_openai_sends_it(server: ServerProcess) -> None:
    body = {"model": "alibi", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.http_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "text_completion" and chunk["id"] == chunks[0]["id"] for chunk in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 40
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == grpc_text(server, "alibi", PROMPT, 40)


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        ({"model": "alibi", "prompt": "x", "max_tokens": 5000}, 400, ("max_tokens", "[1, 1024]", "5000")),
        ({"model": "alibi", "prompt": []}, 400, ("prompt", "a token-id list")),
        ({"model": "alibi", "prompt": "x", "n": 2}, 400, ("n", "only 1")),
        ({"model": "alibi", "prompt": "x", "logprobs": 21}, 400, ("logprobs", "[0, 20]")),
        ({"model": "alibi", "prompt": "x", "max_tokens": 8, "min_tokens": 5000}, 400, ("min_tokens", "[0, 1024]")),
        ({"model": "alibi", "prompt": "x", "temperature": -1}, 400, ("temperature", ">= 0")),
        ({"model": "alibi", "prompt": "x", "cache_policy": "window:0"}, 400, ("cache_policy",)),
        ({"model": "alibi", "prompt": "x" * 5000, "max_tokens": 8}, 400, ("prompt", "4096")),
        ({"model": "gpt-4", "prompt": "x"}, 404, ("gpt-4", "alibi, rope")),
    ],
)
def test_errors_name_the_field_and_the_limit(
    server: ServerProcess, body: dict[str, object], status: int, names: tuple[str, ...]
) -> None:
    response = httpx.post(server.http_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for name in names:
        assert name in error["message"]
    assert error["param"] == names[0] if status == 400 else error["code"] == "model_not_found"


def test_a_client_leaving_mid_stream_cancels_its_request(server: ServerProcess) -> None:
    def cancelled() -> float:
        try:
            return server.metric("posenc_requests_total", api="http", code="CANCELLED")
        except KeyError:
            return 0.0

    before = cancelled()
    body = {"model": "alibi", "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.http_url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.metric("posenc_running_sequences", model="alibi") == 1
    assert wait_for(lambda: cancelled() == before + 1)
    assert wait_for(lambda: server.metric("posenc_running_sequences", model="alibi") == 0)
    assert wait_for(lambda: server.sequence_bytes("posenc_kv_cache_used_bytes", model="alibi") == 0)
    assert server.metric("posenc_cancellation_latency_seconds_count", model="alibi") >= 1


def test_token_queue_limit_and_drain(repository: Path) -> None:
    """401 without the gRPC token, 429 with Retry-After from admission control, 503 while draining."""
    server = ServerProcess(
        repository, "--models", "alibi", "--auth-token", "s3cret", "--max-batch-size", "1", "--max-queue", "1",
        "--grace-seconds", "20",
    ).wait_serving()  # fmt: skip
    try:
        with pytest.raises(openai.AuthenticationError) as denied:
            client(server, "wrong").completions.create(model="alibi", prompt="x", max_tokens=2)
        assert "bearer token" in str(denied.value)
        assert httpx.get(server.http_url + "/health", timeout=10).status_code == 200  # probes need no token
        headers = {"Authorization": "Bearer s3cret"}
        body = {"model": "alibi", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
        with httpx.Client(headers=headers, timeout=120) as http:
            results: list[httpx.Response] = []
            url = server.http_url + "/v1/completions"
            threads = [threading.Thread(target=lambda: results.append(http.post(url, json=body))) for _ in range(5)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            limited = [r for r in results if r.status_code == 429]
            assert limited and sum(r.status_code == 200 for r in results) >= 2
            assert int(limited[0].headers["Retry-After"]) >= 1
            assert limited[0].json()["error"]["code"] == "rate_limit_exceeded"
            assert "max_queue=1" in limited[0].json()["error"]["message"]
            with http.stream("POST", server.http_url + "/v1/completions", json={**body, "stream": True}) as running:
                stream = running.iter_lines()
                first = next(stream)
                server.process.send_signal(signal.SIGTERM)
                assert wait_for(lambda: http.get(server.http_url + "/health").status_code == 503)
                refused = http.post(server.http_url + "/v1/completions", json=body)
                assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
                events = sse_events(itertools.chain([first], stream))
            assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    finally:
        server.stop()


def test_min_tokens_past_max_tokens_runs_to_max_tokens(server: ServerProcess) -> None:
    """The description cannot relate two fields: min_tokens past max_tokens means only that EOS never ends it."""
    body = {"model": "alibi", "prompt": "x", "max_tokens": 8, "min_tokens": 9, "temperature": 0}
    response = httpx.post(server.http_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8


def test_echo_of_a_one_token_prompt_has_no_log_probability_to_give(server: ServerProcess) -> None:
    """Once a 500: scoring one token ran a graph call of length 0 (found by schemathesis)."""
    body = {"model": "alibi", "prompt": [255], "echo": True, "logprobs": 0, "max_tokens": 1}
    response = httpx.post(server.http_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None
