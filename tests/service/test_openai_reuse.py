"""KV reuse through the OpenAI-compatible API on real servers on loopback: the usage's
prompt_tokens_details (cached_tokens as OpenAI and vLLM send it, reused_tokens), reusable segments as
extra body fields against the same segments over gRPC, and each model's segment_reuse in /v1/models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.api import generation_pb2 as pb
from service.process import ServerProcess
from tests.service.engine.prompts.test_prefix_cache_server import PREFIX, TAILS
from tests.service.engine.prompts.test_segments import DOCUMENT, QUESTION, segmented

PROMPT = PREFIX + TAILS[0]
WHOLE_BLOCKS = (len(PROMPT) + 1) // 16 * 16  # with BOS; the prompt's last token is always computed
OTHER_PREFIX = "# a longer, different prefix\n"  # with BOS, one whole block: cached once it has been seen
REUSE = {"alibi": "as_is", "rope": "rotate", "sinusoidal": "recompute"}


@pytest.fixture(scope="module")
def servers(repository: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    cached = ServerProcess(repository, "--models", "alibi", "rope")
    uncached = ServerProcess(repository, "--models", "alibi", "sinusoidal", "--no-prefix-cache")
    try:
        yield cached.wait_serving(), uncached.wait_serving()
    finally:
        cached.stop()
        uncached.stop()


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0, timeout=120)


def complete(server: ServerProcess, model: str, **fields: Any) -> openai.types.Completion:
    return client(server).completions.create(model=model, max_tokens=24, temperature=0, **fields)


def over_http(server: ServerProcess, model: str, prefix: str, repair: int = 0) -> openai.types.Completion:
    """test_segments' segmented request, as extra body fields."""
    segments = [{"text": prefix}, {"text": DOCUMENT, "reusable": True}, {"text": QUESTION}]
    return complete(server, model, prompt=None, extra_body={"segments": segments, "segment_repair_tokens": repair})


def http_reuse(usage: Any) -> tuple[int, int]:
    details = usage.prompt_tokens_details
    return details.cached_tokens, details.model_extra["reused_tokens"]


def grpc_reuse(response: pb.GenerateResponse) -> tuple[int, int]:
    return response.usage.cached_prompt_tokens, response.usage.reused_prompt_tokens


def test_a_repeated_prompt_reports_cached_tokens_in_every_response_shape(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    cached, uncached = servers
    first = complete(cached, "alibi", prompt=PROMPT)
    assert first.usage is not None and http_reuse(first.usage) == (0, 0)
    again = complete(cached, "alibi", prompt=PROMPT)
    assert again.usage is not None and again.usage.prompt_tokens_details.cached_tokens == WHOLE_BLOCKS > 0
    assert again.choices[0].text == first.choices[0].text  # the prefix cache changes no greedy token
    chat = client(cached).chat.completions.create(
        model="alibi", messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=0
    )
    assert chat.usage is not None and chat.usage.prompt_tokens_details.cached_tokens == WHOLE_BLOCKS
    streams = [
        complete(cached, "alibi", prompt=PROMPT, stream=True, stream_options={"include_usage": True}),
        client(cached).chat.completions.create(
            model="alibi", messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        ),
    ]  # fmt: skip
    for stream in streams:
        last = list(stream)[-1]
        assert last.choices == [] and last.usage is not None
        assert last.usage.prompt_tokens_details.cached_tokens == WHOLE_BLOCKS
    for _ in range(2):  # --no-prefix-cache: the same prompt again is computed again
        uncached_usage = complete(uncached, "alibi", prompt=PROMPT).usage
        assert uncached_usage is not None and http_reuse(uncached_usage) == (0, 0)


@pytest.mark.parametrize("scheme", ["alibi", "rope"])
def test_segments_over_http_equal_the_same_segments_over_grpc(
    servers: tuple[ServerProcess, ServerProcess], scheme: str
) -> None:
    cached, _ = servers
    grpc_first = cached.stub.Generate(segmented(scheme, "# first\n"), timeout=60)
    first = over_http(cached, scheme, "# first\n")
    assert first.choices[0].text == grpc_first.text
    assert first.usage is not None and first.usage.prompt_tokens == grpc_first.usage.prompt_tokens
    assert http_reuse(first.usage) == grpc_reuse(grpc_first) == (0, len(DOCUMENT))
    # Another offset, in the same cache state on both sides: the prefix's whole block is cached by then.
    cached.stub.Generate(segmented(scheme, OTHER_PREFIX), timeout=60)
    later = over_http(cached, scheme, OTHER_PREFIX)
    grpc_later = cached.stub.Generate(segmented(scheme, OTHER_PREFIX), timeout=60)
    assert later.choices[0].text == grpc_later.text
    assert later.usage is not None and http_reuse(later.usage) == grpc_reuse(grpc_later) == (16, len(DOCUMENT))
    repaired = over_http(cached, scheme, "# first\n", repair=4)
    grpc_repaired = cached.stub.Generate(segmented(scheme, "# first\n", repair=4), timeout=60)
    assert repaired.choices[0].text == grpc_repaired.text
    assert repaired.usage is not None and http_reuse(repaired.usage) == grpc_reuse(grpc_repaired)
    assert http_reuse(repaired.usage) == (0, len(DOCUMENT) - 4)


def test_a_scheme_that_recomputes_reuses_nothing_and_models_say_why(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    _, uncached = servers
    completion = over_http(uncached, "sinusoidal", "# first\n")
    plain = pb.GenerateRequest(model="sinusoidal", prompt="# first\n" + DOCUMENT + QUESTION, max_new_tokens=24)
    assert completion.choices[0].text == uncached.stub.Generate(plain, timeout=60).text  # computed in place
    assert completion.usage is not None and http_reuse(completion.usage) == (0, 0)
    for server in servers:
        listed = {model.id: model.model_extra["segment_reuse"] for model in client(server).models.list()}
        over_grpc = {m.name: m.segment_reuse for m in server.stub.ListModels(pb.ListModelsRequest(), timeout=10).models}
        assert listed == over_grpc == {name: REUSE[name] for name in over_grpc}


SEGMENT = {"text": "def f():\n", "reusable": True}


@pytest.mark.parametrize(
    ("path", "body", "names"),
    [
        ("completions", {"prompt": "x", "segments": [SEGMENT]}, ("segments", "either prompt or segments")),
        ("completions", {"segments": "def f():\n"}, ("segments", "a list")),
        ("completions", {"segments": [SEGMENT, "x"]}, ("segments[1]", "text, reusable")),
        ("completions", {"segments": [{"text": "x", "reuse": True}]}, ("segments[0]", "only the fields")),
        ("completions", {"segments": [{"text": 3}]}, ("segments[0].text", "a string")),
        ("completions", {"segments": [{"text": "x", "reusable": 1}]}, ("segments[0].reusable", "a boolean")),
        ("completions", {"segments": [SEGMENT], "segment_repair_tokens": -1},
         ("segment_repair_tokens", "[0, 4294967295]", "-1")),
        ("completions", {"segments": [{"text": "x" * 3000}, {"text": "x" * 2000, "reusable": True}], "max_tokens": 8},
         ("prompt", "4096")),
        ("completions", {"segments": [], "prompt": ""}, ("prompt", "empty")),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "segments": [SEGMENT]},
         ("segments", "only on /v1/completions")),
    ],
)  # fmt: skip
def test_bad_segments_are_400s_naming_the_field_and_the_limit(
    servers: tuple[ServerProcess, ServerProcess], path: str, body: dict[str, Any], names: tuple[str, ...]
) -> None:
    response = httpx.post(f"{servers[0].http_url}/v1/{path}", json={"model": "alibi", **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == names[0]
    for name in names:
        assert name in error["message"]
