"""The SSE timer measures a /v1/completions stream as timed_stream measures a GenerateStream call."""

from __future__ import annotations

import json
from argparse import Namespace

from loadtest.sse import SseTimer, completion_body, http_base_url


def event(text: str, finish: str | None = None) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}]}).encode()


def test_first_text_is_the_first_token_and_later_bytes_are_decoded_tokens() -> None:
    timer = SseTimer(started=10.0)
    timer.line(b": keep-alive comment", 10.1)
    timer.line(event("ab"), 10.5)  # first chunk: TTFT, its bytes are not inter-token gaps
    timer.line(b"", 10.6)
    timer.line(event("c\u00e9"), 10.7)  # 3 bytes
    timer.line(event("", "length"), 10.8)
    timer.line(b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}}', 10.8)
    timer.line(b"data: [DONE]", 10.8)
    timing = timer.finish(11.0)
    assert timing.time_to_first_token == 0.5
    assert (timing.decoded_tokens, timing.received_bytes, timing.completion_tokens) == (3, 5, 5)
    assert abs(timing.decode_seconds - 0.2) < 1e-9 and abs(timing.mean_inter_token - 0.2 / 3) < 1e-9
    assert timing.seconds == 1.0 and timer.done and timer.error is None


def test_chat_role_chunk_is_not_a_token_and_errors_are_kept() -> None:
    timer = SseTimer(started=0.0)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    timer.line("data: " + json.dumps(role), 0.1)
    assert timer.timing.time_to_first_token is None
    timer.line("data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "x"}}]}), 0.3)
    assert timer.timing.time_to_first_token == 0.3
    timer.line(b'data: {"error": {"message": "deadline exceeded", "type": "server_error"}}', 0.4)
    assert timer.error == "deadline exceeded" and not timer.done


def test_completion_body_streams_with_usage() -> None:
    body = completion_body("alibi", "x", 64, seed=3, ignore_eos=True)
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["seed"], body["ignore_eos"], body["temperature"]) == (64, 3, True, 0.0)
    assert "seed" not in completion_body("alibi", "x", 64)


def test_http_users_base_url() -> None:
    assert http_base_url(None, "localhost:50051") == "http://localhost:8000"
    assert http_base_url(None, "https://proxy:8443/") == "https://proxy:8443"
    assert http_base_url(Namespace(http_host="http://other:9000"), "localhost:50051") == "http://other:9000"
    assert http_base_url(Namespace(http_host=""), "10.0.0.5:50051") == "http://10.0.0.5:8000"
