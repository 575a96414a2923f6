"""Log-probabilities through both APIs, against Score and an offline ONNX Runtime loop: the real
server on loopback, the official `openai` client, raw HTTP for the error shapes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest

from export.runtime import OnnxCausalLM
from models.tokenizer import TOKENIZER
from service.api import generation_pb2 as pb
from service.engine.sampler import log_softmax
from service.process import ServerProcess

SCHEMES = ["alibi", "learned", "none", "relative", "rope", "sinusoidal"]
TEXT = "import os\n\ndef read(path):\n    with open(path) as handle:\n        return handle.read()\n"


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(repository, "--max-new-tokens-limit", "2048").wait_serving()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)


def score(server: ServerProcess, model: str, text: str) -> np.ndarray:
    return np.array(server.stub.Score(pb.ScoreRequest(model=model, text=text), timeout=60).token_logprobs)


@pytest.mark.parametrize("model", SCHEMES)
def test_echo_logprobs_equal_score_cold_and_on_a_prefix_cache_hit(
    server: ServerProcess, client: openai.OpenAI, model: str
) -> None:
    """echo + max_tokens 0 (lm-evaluation-harness's request) on a cold cache, then echo with a
    completion after the prompt's blocks are in the prefix cache: every prompt byte's log-probability
    equals Score's; the first token (BOS) has none."""
    expected = score(server, model, TEXT)
    cold = client.completions.create(model=model, prompt=TEXT, max_tokens=0, echo=True, logprobs=1)
    cold_logprobs = cold.choices[0].logprobs
    assert cold.choices[0].text == TEXT and cold_logprobs is not None
    assert cold_logprobs.tokens[0] == "<|bos|>" and cold_logprobs.token_logprobs[0] is None
    assert "".join(cold_logprobs.tokens[1:]) == TEXT
    np.testing.assert_allclose(cold_logprobs.token_logprobs[1:], expected, atol=1e-4)
    client.completions.create(model=model, prompt=TEXT, max_tokens=1, temperature=0)  # its blocks are kept
    hit = client.completions.create(model=model, prompt=TEXT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    assert hit.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    hit_logprobs = hit.choices[0].logprobs
    assert hit_logprobs is not None and hit.choices[0].text.startswith(TEXT)
    prompt_tokens = len(TEXT.encode()) + 1
    np.testing.assert_allclose(hit_logprobs.token_logprobs[1:prompt_tokens], expected, atol=1e-4)
    assert len(hit_logprobs.tokens) == prompt_tokens + 3


@pytest.mark.parametrize("model", SCHEMES)
def test_greedy_logprobs_equal_an_offline_onnx_loop(server: ServerProcess, repository: Path, model: str) -> None:
    """Each generated token's log-probability and its top 3 equal the log-softmax of ONNX Runtime's
    own greedy loop's logits at that step (the same tokens)."""
    prompt, new = "def fibonacci(n):\n", 24
    request = pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=new, ignore_eos=True, logprobs=3)
    response = server.stub.Generate(request, timeout=60)
    tokens, step_logits = OnnxCausalLM(repository / model).greedy([TOKENIZER.encode(prompt)], new)
    offline = log_softmax(np.stack([logits[0] for logits in step_logits]))
    if TOKENIZER.eos_token_id in tokens[0]:  # masked by ignore_eos in the service: compare up to it
        new = tokens[0].index(TOKENIZER.eos_token_id)
    served = response.logprobs[:new]
    assert [entry.token_id for entry in served] == tokens[0][:new]
    np.testing.assert_allclose([e.logprob for e in served], offline[np.arange(new), tokens[0][:new]], atol=1e-4)
    for step, entry in enumerate(served):
        top = np.argsort(-offline[step], kind="stable")[:3]
        np.testing.assert_allclose(entry.top_logprobs, offline[step][top], atol=1e-4)
        assert entry.top_logprobs[0] == pytest.approx(entry.logprob, abs=1e-6)  # greedy took the likeliest


def test_streamed_logprobs_equal_the_whole_responses_and_stop_at_a_stop_string(server: ServerProcess) -> None:
    base = dict(model="alibi", prompt="def main():\n", max_new_tokens=60, ignore_eos=True, logprobs=2)
    whole = server.stub.Generate(pb.GenerateRequest(**base), timeout=60)
    chunks = list(server.stub.GenerateStream(pb.GenerateRequest(**base), timeout=60))
    streamed = [entry for chunk in chunks for entry in chunk.logprobs]
    assert [e.token_id for e in streamed] == [e.token_id for e in whole.logprobs]
    assert len(whole.logprobs) == 60 and bytes(e.token_id for e in whole.logprobs).decode() == whole.text
    assert not any(chunk.prompt_logprobs for chunk in chunks)
    stop = whole.text[20:23]
    stopped = server.stub.Generate(pb.GenerateRequest(**base, stop=[stop]), timeout=60)
    assert stopped.finish_reason == pb.FINISH_REASON_STOP
    assert bytes(e.token_id for e in stopped.logprobs).decode() == stopped.text  # none past the stop's start
    plain = server.stub.Generate(
        pb.GenerateRequest(model="alibi", prompt="def main():\n", max_new_tokens=5), timeout=60
    )
    assert not plain.logprobs and not plain.prompt_logprobs  # none asked, none sent


def test_openai_client_reads_logprobs_from_completions_and_chat_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs = dict(model="rope", max_tokens=8, temperature=0)
    whole = client.completions.create(prompt="class Parser:\n", logprobs=3, **kwargs)  # type: ignore[call-overload]
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and "".join(logprobs.tokens) == whole.choices[0].text
    assert all(len(top) >= 3 for top in logprobs.top_logprobs) and logprobs.text_offset == list(range(8))
    streamed = list(client.completions.create(prompt="class Parser:\n", logprobs=3, stream=True, **kwargs))
    assert [v for c in streamed for v in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [])] \
        == pytest.approx(logprobs.token_logprobs, abs=1e-9)  # fmt: skip
    assert [o for c in streamed if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == list(range(8))

    messages = [{"role": "user", "content": "class Parser:"}]
    chat = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **kwargs)  # type: ignore[call-overload]
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)
    chunks = list(
        client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, stream=True, **kwargs)
    )  # type: ignore[call-overload]
    streamed_chat = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in streamed_chat] == pytest.approx([t.logprob for t in content], abs=1e-9)
    plain = client.chat.completions.create(messages=messages, **kwargs)  # type: ignore[call-overload]
    assert plain.choices[0].logprobs is None


def test_openai_client_sends_token_id_prompts_and_lists_of_prompts(client: openai.OpenAI) -> None:
    ids = TOKENIZER.encode("def add(a, b):\n")
    by_ids = client.completions.create(model="relative", prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model="relative", prompt="def add(a, b):\n", max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text  # BOS sent by the client, as the server adds it
    prompts = ["def add(a, b):\n", "import sys\n", "class A:\n"]
    several = client.completions.create(model="relative", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in several.choices] == [0, 1, 2]
    singles = [client.completions.create(model="relative", prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert [c.text for c in several.choices] == [s.choices[0].text for s in singles]
    assert several.usage.prompt_tokens == sum(len(p.encode()) + 1 for p in prompts)
    lists = client.completions.create(model="relative", prompt=[ids, TOKENIZER.encode("import sys\n")], max_tokens=6,
                                      temperature=0, echo=True, logprobs=0)  # fmt: skip
    assert [c.text for c in lists.choices] == [
        p + s.choices[0].text for p, s in zip(prompts[:2], singles, strict=False)
    ]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="relative", prompt=prompts, max_tokens=6, temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == [s.choices[0].text for s in singles]


@pytest.mark.parametrize(
    ("path", "body", "field", "limit"),
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs", "[0, 20]"),
        ("/v1/completions", {"logprobs": -1}, "logprobs", "[0, 20]"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens", "0 only with echo"),
        ("/v1/completions", {"prompt": [1, 300]}, "prompt[1]", "[0, 259)"),
        ("/v1/completions", {"model": "learned", "prompt": "x" * 300, "echo": True, "max_tokens": 0}, "prompt",
         "max_positions=256"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -3}, "top_logprobs", "[0, 20]"),
    ],
)  # fmt: skip
def test_bad_logprob_values_get_a_400_naming_the_field_and_the_limit(
    server: ServerProcess, path: str, body: dict[str, object], field: str, limit: str
) -> None:
    base: dict[str, object] = {"model": "rope", "max_tokens": 4}
    base.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    response = httpx.post(server.http_url + path, json={**base, **body}, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field, error
    assert error["message"].startswith(f"{field}:") and limit in error["message"], error


def test_grpc_refuses_bad_logprob_values_with_invalid_argument(server: ServerProcess) -> None:
    cases = [
        (pb.GenerateRequest(model="rope", prompt="x", logprobs=21), "logprobs: must be in [0, 20], got 21"),
        (pb.GenerateRequest(model="rope", prompt="x", prompt_logprobs=99), "prompt_logprobs: must be in [0, 20]"),
        (pb.GenerateRequest(model="rope", prompt_token_ids=[256, 999]), "prompt[1]: token id 999 is outside"),
        (pb.GenerateRequest(model="rope", prompt="x", max_new_tokens=0), "(0 only with prompt_logprobs"),
        (pb.GenerateRequest(model="learned", prompt="y" * 300, max_new_tokens=0, prompt_logprobs=0),
         "prompt: 300 tokens to score exceed max_positions=256"),
    ]  # fmt: skip
    for request, message in cases:
        with pytest.raises(grpc.RpcError) as error:
            server.stub.Generate(request, timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.value.details()


def test_tokenizer_endpoints_in_vllms_shapes(server: ServerProcess) -> None:
    """What lm-evaluation-harness's remote tokenizer calls: /tokenizer_info, /tokenize, /detokenize."""
    info = httpx.get(server.http_url + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "<|eos|>" and info["bos_token"] == "<|bos|>"
    plain = httpx.post(server.http_url + "/tokenize", json={"prompt": "é!", "add_special_tokens": False}).json()
    assert plain["tokens"] == list("é!".encode()) and plain["count"] == 3
    special = httpx.post(server.http_url + "/tokenize", json={"prompt": "a", "model": "learned"}).json()
    assert special["tokens"] == [TOKENIZER.bos_token_id, 97] and special["max_model_len"] == 256
    text = httpx.post(server.http_url + "/detokenize", json={"tokens": [256, *"é!".encode()]}).json()
    assert text == {"prompt": "é!"}
    bad = httpx.post(server.http_url + "/detokenize", json={"tokens": [1000]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
