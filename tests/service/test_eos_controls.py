"""ignore_eos and min_tokens (vLLM's names) through the real server: EOS never ends a request
that may not end yet, and the limits are checked with their names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from service.api import generation_pb2 as pb
from service.process import ServerProcess

# A sampled stream that the model ends with EOS after a few dozen tokens (alibi, seed 1).
ENDS_EARLY = pb.GenerateRequest(
    model="alibi", prompt="def f():\n    return 1\n", max_new_tokens=200, temperature=1.0, seed=1
)


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(repository, "--models", "alibi").wait_serving()
    yield process
    process.stop()


def _generate(server: ServerProcess, **fields: object) -> pb.GenerateResponse:
    return server.stub.Generate(_with(**fields), timeout=120)


def test_the_model_ends_this_stream_with_eos(server: ServerProcess) -> None:
    response = _generate(server)
    assert response.finish_reason == pb.FINISH_REASON_EOS
    assert response.usage.completion_tokens < 150


def test_ignore_eos_runs_to_max_new_tokens(server: ServerProcess) -> None:
    response = _generate(server, ignore_eos=True)
    assert response.finish_reason == pb.FINISH_REASON_LENGTH
    assert response.usage.completion_tokens == 200
    chunks = list(server.stub.GenerateStream(_with(ignore_eos=True), timeout=120))
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH and chunks[-1].usage.completion_tokens == 200
    assert "".join(chunk.text for chunk in chunks) == response.text  # seeded: the same sample


def test_min_tokens_defers_eos(server: ServerProcess) -> None:
    early = _generate(server).usage.completion_tokens
    response = _generate(server, min_tokens=early + 40)
    assert response.usage.completion_tokens >= early + 40
    assert response.finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH)


def test_min_tokens_past_the_limit_is_invalid(server: ServerProcess) -> None:
    with pytest.raises(grpc.RpcError) as error:
        _generate(server, min_tokens=1025)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for name in ("min_tokens", "1024", "1025"):
        assert name in error.value.details()


def test_min_tokens_past_max_new_tokens_runs_to_max_new_tokens(server: ServerProcess) -> None:
    """As over HTTP (whose description cannot relate two fields): EOS never ends it, max_new_tokens does."""
    response = _generate(server, min_tokens=5, max_new_tokens=4)
    assert response.finish_reason == pb.FINISH_REASON_LENGTH and response.usage.completion_tokens == 4


def _with(**fields: object) -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    request.CopyFrom(ENDS_EARLY)
    for name, value in fields.items():
        setattr(request, name, value)
    return request
