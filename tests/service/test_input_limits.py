"""Bad input refused before any work, with the field and the limit named (HTTP 400, gRPC
INVALID_ARGUMENT), and logit_bias applied before sampling: units for the pure parts, then a real
server on loopback that keeps serving after each refusal."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import numpy as np
import pytest

from service.api import generation_pb2 as pb
from service.engine.messages import (
    MAX_CACHE_SALT_CHARACTERS,
    MAX_STOP_CHARACTERS,
    MAX_STOP_STRINGS,
    GenerateInput,
    RequestError,
)
from service.engine.sampler import processed_logits
from service.openai_api.app import MAX_JSON_DEPTH, json_depth
from service.openai_api.protocol import ApiError, logit_bias
from service.process import ServerProcess

PROMPT = "def fibonacci(n):\n"
A = ord("A")


# ---------------------------------------------------------------------------- units


def rows(*params: SimpleNamespace) -> list[SimpleNamespace]:
    """Stand-ins for requests: processed_logits reads only params and eos_token_id."""
    return [SimpleNamespace(params=p, eos_token_id=3) for p in params]


def params(bias: tuple[tuple[int, float], ...] = (), eos_allowed: bool = True) -> SimpleNamespace:
    return SimpleNamespace(logit_bias=bias, eos_allowed=lambda generated: eos_allowed)


def test_processed_logits_add_the_bias_and_mask_eos_on_a_copy() -> None:
    logits = np.zeros((3, 5), dtype=np.float32)
    out = processed_logits(logits, rows(params(((1, 100.0), (2, -5.0))), params(), params(eos_allowed=False)), [0] * 3)  # type: ignore[arg-type]
    assert out[0].tolist() == [0, 100, -5, 0, 0]
    assert out[1].tolist() == [0] * 5
    assert out[2, 3] == -np.inf and out[2, :3].tolist() == [0, 0, 0]
    assert not logits.any()  # the raw logits stay raw (log-probabilities read them)
    untouched = processed_logits(logits, rows(params(), params()), [0, 0])  # type: ignore[arg-type]
    assert untouched is logits


def test_logit_bias_parsing_takes_openai_string_keys() -> None:
    assert logit_bias({"65": 100, "10": -2.5}) == ((65, 100.0), (10, -2.5))
    assert logit_bias(None) == ()
    for bad in ({"A": 1}, {"-1": 1}, {"65": "up"}, {"65": True}, [65]):
        with pytest.raises(ApiError) as error:
            logit_bias(bad)
        assert error.value.param == "logit_bias"


def test_json_depth() -> None:
    assert json_depth(1) == 0
    assert json_depth({"a": [1, {"b": []}]}) == 4
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    assert json_depth(deep) == 10_001  # no recursion


# ---------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(repository, "--models", "alibi").wait_serving()
    yield process
    process.stop()


def post(server: ServerProcess, body: object, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.http_url + path, json=body, timeout=60)


BAD_BODIES = [
    ({"stop": ["x"] * 10_000}, "stop", f"at most {MAX_STOP_STRINGS}"),
    ({"stop": "y" * 100_000}, "stop", f"at most {MAX_STOP_CHARACTERS} characters"),
    ({"logit_bias": {"300": 1}}, "logit_bias", "outside the vocabulary [0, 259)"),
    ({"logit_bias": {"65": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"A": 1}}, "logit_bias", "token ids"),
    ({"cache_salt": "s" * 1000}, "cache_salt", f"at most {MAX_CACHE_SALT_CHARACTERS}"),
    ({"cache_salt": 7}, "cache_salt", "a string"),
    ({"segments": [{"text": "x"}] * 300, "prompt": None}, "segments", "at most 256"),
    ({"top_k": 2**70}, "top_k", "64-bit integer"),  # once a 500: too large for the engine's messages
    ({"speculative_tokens": -(2**64)}, "speculative_tokens", "64-bit integer"),
]


@pytest.mark.parametrize(("extra", "field", "limit"), BAD_BODIES)
def test_http_refuses_each_bad_field_naming_it_and_the_limit(
    server: ServerProcess, extra: dict[str, object], field: str, limit: str
) -> None:
    response = post(server, {"model": "alibi", "prompt": PROMPT, "max_tokens": 4, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and limit in error["message"], error
    assert len(error["message"]) < 400  # the refused value is quoted cut short
    assert post(server, {"model": "alibi", "prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_json_nested_100000_deep_is_a_400_not_a_500(server: ServerProcess) -> None:
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"model": "alibi", "prompt": ' + b"[" * 40 + b"]" * 40 + b"}"):
        response = httpx.post(server.http_url + "/v1/completions", content=body, timeout=60,
                              headers={"Content-Type": "application/json"})  # fmt: skip
        assert response.status_code == 400, response.text
        assert f"nested deeper than {MAX_JSON_DEPTH}" in response.json()["error"]["message"]
    assert post(server, {"model": "alibi", "prompt": PROMPT, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    ("fields", "limit"),
    [
        ({"stop": ["x"] * 10_000}, "stop: at most"),
        ({"stop": ["y" * 100_000]}, "stop: each string at most"),
        ({"logit_bias": {65: 100.5}}, "logit_bias: the bias of token 65 must be in [-100, 100]"),
        ({"logit_bias": {259: 1.0}}, "logit_bias: token id 259 is outside the vocabulary"),
        ({"cache_salt": "s" * 1000}, "cache_salt: at most"),
    ],
)
def test_grpc_refuses_each_bad_field_as_invalid_argument(
    server: ServerProcess, fields: dict[str, object], limit: str
) -> None:
    request = pb.GenerateRequest(model="alibi", prompt=PROMPT, max_new_tokens=4, **fields)  # type: ignore[arg-type]
    with pytest.raises(grpc.RpcError) as error:
        server.stub.Generate(request, timeout=60)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert limit in error.value.details()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_plus_100_makes_the_token_appear_greedy_and_sampled(
    server: ServerProcess, temperature: float
) -> None:
    body = {"model": "alibi", "prompt": PROMPT, "max_tokens": 8, "temperature": temperature, "seed": 1}
    plain = post(server, body).json()["choices"][0]["text"]
    assert "AAAAAAAA" not in plain
    forced = post(server, {**body, "logit_bias": {str(A): 100}}).json()["choices"][0]["text"]
    assert forced == "A" * 8
    request = pb.GenerateRequest(model="alibi", prompt=PROMPT, max_new_tokens=8, temperature=temperature, seed=1,
                                 logit_bias={A: 100.0})  # fmt: skip
    assert server.stub.Generate(request, timeout=60).text == "A" * 8


def test_logit_bias_minus_100_bans_the_greedy_token(server: ServerProcess) -> None:
    body = {"model": "alibi", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    first = post(server, body).json()["choices"][0]["text"]
    banned = post(server, {**body, "logit_bias": {str(ord(first)): -100}}).json()["choices"][0]["text"]
    assert banned != first


def test_every_field_is_checked_in_one_function() -> None:
    """fields.check_fields is the one place (both front ends reach it through the engine client)."""
    from service.engine.processing.fields import FieldLimits, check_fields

    limits = FieldLimits("alibi", 1024, 64, 259)
    check_fields(GenerateInput("alibi", "x", stop=("a",) * MAX_STOP_STRINGS), limits)
    for bad, field in [
        (GenerateInput("alibi", "x", stop=("a",) * (MAX_STOP_STRINGS + 1)), "stop"),
        (GenerateInput("alibi", "x", max_new_tokens=0), "max_new_tokens"),
        (GenerateInput("alibi", "x", min_tokens=1025), "min_tokens"),  # above the limit
        (GenerateInput("alibi", "x", temperature=math.nan), "temperature"),
        (GenerateInput("alibi", "", prompt_ids=(256, 259)), "prompt[1]"),
        (GenerateInput("alibi", "x", seed=-1), "seed"),
        (GenerateInput("alibi", "x", segment_repair_tokens=2**32), "segment_repair_tokens"),
    ]:
        with pytest.raises(RequestError) as error:
            check_fields(bad, limits)
        assert error.value.message.startswith(f"{field}: "), error.value.message
    check_fields(GenerateInput("alibi", "x", max_new_tokens=0, prompt_logprobs=0), limits)  # echo alone


# Each bad value as gRPC and HTTP send it: (gRPC fields, HTTP fields, the message's start).
BAD_FIELDS = [
    ({"max_new_tokens": 5000}, {"max_tokens": 5000}, "max_new_tokens: must be in [1, 1024]"),
    ({"max_new_tokens": 0}, {"max_tokens": 0}, "max_new_tokens: must be in [1, 1024] (0 only with"),
    ({"max_new_tokens": 8, "min_tokens": 5000}, {"max_tokens": 8, "min_tokens": 5000}, "min_tokens: must be in [0,"),
    ({"temperature": -1.0}, {"temperature": -1}, "temperature: must be >= 0"),
    ({"top_p": 1.5}, {"top_p": 1.5}, "top_p: must be in (0, 1]"),
    ({"top_p": 0.0}, {"top_p": 0}, "top_p: must be in (0, 1]"),
    ({"top_k": -5}, {"top_k": -5}, "top_k: must be >= 0"),
    ({"logprobs": 21}, {"logprobs": 21}, "logprobs: must be in [0, 20]"),
    ({"stop": ["x"] * 17}, {"stop": ["x"] * 17}, f"stop: at most {MAX_STOP_STRINGS}"),
    ({"stop": ["y" * 300]}, {"stop": ["y" * 300]}, f"stop: each string at most {MAX_STOP_CHARACTERS}"),
    ({"logit_bias": {300: 1.0}}, {"logit_bias": {"300": 1}}, "logit_bias: token id 300 is outside"),
    ({"logit_bias": {65: 101.0}}, {"logit_bias": {"65": 101}}, "logit_bias: the bias of token 65"),
    ({"speculative_tokens": 17}, {"speculative_tokens": 17}, "speculative_tokens: must be in [0, 16]"),
    ({"prompt": "", "prompt_token_ids": [256, 999]}, {"prompt": [256, 999]}, "prompt[1]: token id 999"),
    ({"prompt": "", "segments": [pb.PromptSegment(text="x")] * 257},
     {"prompt": None, "segments": [{"text": "x"}] * 257}, "segments: at most 256"),
]  # fmt: skip


@pytest.mark.parametrize(("grpc_fields", "http_fields", "start"), BAD_FIELDS)
def test_grpc_and_http_refuse_each_bad_value_with_the_same_message(
    server: ServerProcess, grpc_fields: dict[str, object], http_fields: dict[str, object], start: str
) -> None:
    """One check for both front ends: the same words, only the field's name as each API spells it."""
    request = pb.GenerateRequest(**{"model": "alibi", "prompt": PROMPT, "max_new_tokens": 4, **grpc_fields})  # type: ignore[arg-type]
    with pytest.raises(grpc.RpcError) as refused:
        server.stub.Generate(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = refused.value.details()
    assert message.startswith(start), message
    response = post(server, {"model": "alibi", "prompt": PROMPT, "max_tokens": 4, **http_fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] == message.replace("max_new_tokens", "max_tokens").replace("prompt_logprobs", "echo")
    assert error["param"] == error["message"].partition(":")[0]
