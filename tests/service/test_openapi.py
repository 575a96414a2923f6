"""GET /openapi.json: the HTTP API's own OpenAPI 3.1 description, made from its types. The parser
reads exactly the fields the types declare, and schemathesis runs every operation of a real server
against it (no server error, only documented status codes, answers that match their schemas)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from service.engine.messages import ModelInfo
from service.openai_api import types
from service.openai_api.openapi import OPERATIONS, openapi
from service.openai_api.protocol import SEGMENT_FIELDS, ApiError, conform, parse_generation
from service.process import ServerProcess

MODEL = ModelInfo(
    name="alibi", scheme="alibi", max_positions=0, train_context=256, kv_cache_bytes_per_token=1, n_layers=1,
    n_heads=1, head_dim=1, dtype="float32", max_new_tokens_limit=64, max_sequence_tokens=512,
    kv_cache_capacity_bytes=1, cache_policies=["full"], default_cache_policy="full", eviction_positions="cache",
)  # fmt: skip
# Read only to refuse them with a pointer to the other endpoint.
REFUSED = {False: {"top_logprobs"}, True: {"echo", "segments", "segment_repair_tokens", "suffix", "best_of"}}
IGNORED = {"user"}  # OpenAI's end-user id: accepted, not used


class Recording(dict[str, Any]):
    """A request body that notes every field the parser looks at."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


@pytest.mark.parametrize(("chat", "kind"), [(False, types.CompletionRequest), (True, types.ChatCompletionRequest)])
def test_the_parser_reads_the_fields_the_types_declare(chat: bool, kind: type) -> None:
    body = Recording(model="alibi", prompt="x", messages=[{"role": "user", "content": "x"}])
    parse_generation(body, {"alibi": MODEL}, chat)
    declared = set(kind.__struct_fields__)
    assert body.read - REFUSED[chat] == declared - IGNORED - ({"messages"} if not chat else {"prompt"})
    assert set(SEGMENT_FIELDS) == set(types.Segment.__struct_fields__)


def test_the_document_is_openapi_3_1_and_names_every_route() -> None:
    document = openapi()
    assert document["openapi"] == "3.1.0"
    assert {(o.method, o.path) for o in OPERATIONS} == {
        (method, path) for path, item in document["paths"].items() for method in item
    }
    schemas = document["components"]["schemas"]
    stop = schemas["CompletionRequest"]["properties"]["stop"]["anyOf"]
    assert {"type": "array", "items": {"type": "string", "maxLength": 256}, "maxItems": 16} in stop


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    # A low token limit keeps each generated case short (longer ones are refused, a documented 400).
    limits = ("--max-new-tokens-limit", "8", "--default-max-new-tokens", "8")
    process = ServerProcess(repository, "--models", "alibi", *limits).wait_serving()
    yield process
    process.stop()


def test_the_server_serves_the_document(server: ServerProcess) -> None:
    response = httpx.get(server.http_url + "/openapi.json", timeout=10)  # no token needed, as /health
    served = response.json()
    assert response.status_code == 200 and served["paths"].keys() == openapi()["paths"].keys()
    model = served["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert model["enum"] == ["alibi"]  # the served models
    assert "security" not in served  # this server takes no tokens


# The document the server serves (the test above): loaded here, not from a fixture, so that each
# operation is a test of its own (schemathesis's fixture loader does not run on this pytest).
schema = schemathesis.openapi.from_dict(openapi())


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_keeps_what_the_document_promises(case: Any, server: ServerProcess) -> None:
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = "alibi"  # a served model: the case reaches the engine, not a 404
    case.call_and_validate(
        base_url=server.http_url,
        timeout=60,
        checks=[not_a_server_error, status_code_conformance, response_schema_conformance],
    )


def test_the_cases_reached_the_engine(server: ServerProcess) -> None:
    """Run after the schemathesis cases: some of them were served in full, not all refused."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert server.metric("posenc_requests_total", method=path, code="OK") > 0, path


def test_schemathesis_with_every_check_finds_nothing(server: ServerProcess, tmp_path: Path) -> None:
    """The schemathesis CLI with `--checks all` over the served description: schema-valid requests
    are accepted, schema-invalid ones refused, 405s carry Allow, and no answer breaks its schema."""
    command = [
        str(Path(sys.executable).parent / "st"), "run", f"{server.http_url}/openapi.json", "--checks", "all",
        "--max-examples", "40", "--seed", "1", "--no-color",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-8000:]


def test_the_shape_check_leaves_every_limit_to_the_field_checks() -> None:
    """conform checks shapes and types only: a value past a limit the description states reaches the
    one check of each field (service.engine.processing.fields), which words it for gRPC and HTTP alike."""
    body = {"model": "alibi", "prompt": "x", "temperature": -1, "logprobs": 99, "stop": ["x"] * 40, "priority": 2**40}
    parsed = conform(body, types.CompletionRequest, lambda body: parse_generation(body, {"alibi": MODEL}, False))
    assert parsed.input.temperature == -1.0 and parsed.input.logprobs == 99 and len(parsed.input.stop) == 40
    with pytest.raises(ApiError) as refused:  # a wrong type is the shape check's
        conform({**body, "user": 3}, types.CompletionRequest, lambda body: None)
    assert refused.value.status == 400 and refused.value.param == "user"


def test_chat_takes_one_length_field() -> None:
    """max_tokens and max_completion_tokens both given: the one left out would go unchecked."""
    body = {"model": "alibi", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0,
            "max_completion_tokens": 8}  # fmt: skip
    with pytest.raises(ApiError) as refused:
        parse_generation(body, {"alibi": MODEL}, True)
    assert refused.value.param == "max_tokens" and "not both" in refused.value.message
    assert parse_generation({**body, "max_tokens": None}, {"alibi": MODEL}, True).input.max_new_tokens == 8
