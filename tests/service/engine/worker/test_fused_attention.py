"""The fused decode graph through the real server: `--attention fused` serves every scheme with one
GroupQueryAttention kernel per layer, and greedy output equals the PyTorch model's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from models.checkpoints import WEIGHTS_DIR
from models.tokenizer import TOKENIZER
from models.transformer import Transformer
from service.api import generation_pb2 as pb
from service.process import ServerProcess
from tests.schemes import trained_key_value_schemes

# The schemes with shipped weights that cache a K and a V (GroupQueryAttention's input; latent
# attention has no fused graph: `--attention fused` refuses it by name, as any export without one).
TRAINED = trained_key_value_schemes()

PROMPTS = ("def read_config(path):\n", "import os\nimport sys\n\nclass Loader(object):\n    def __init__(self, ")
NEW_TOKENS = 64


@torch.no_grad()
def pytorch_greedy(scheme: str, prompt: str, new_tokens: int) -> list[int]:
    """PyTorch's greedy continuation with its own KV cache, stopping after EOS."""
    model = Transformer.load(WEIGHTS_DIR / scheme)
    logits, past = model(torch.tensor([TOKENIZER.encode(prompt)]))
    generated: list[int] = []
    while len(generated) < new_tokens:
        generated.append(int(logits[0, -1].argmax()))
        if generated[-1] == TOKENIZER.eos_token_id:
            break
        logits, past = model(torch.tensor([[generated[-1]]]), past_key_values=past)
    return generated


@pytest.fixture(scope="module")
def fused_server(repository: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(repository, "--models", *TRAINED, "--attention", "fused").wait_serving()
    yield server
    server.stop()


def test_greedy_through_the_fused_graph_equals_pytorch(fused_server: ServerProcess) -> None:
    """Both prompts of every scheme at once (rows of different lengths share decode batches)."""
    cases = [(scheme, prompt) for scheme in TRAINED for prompt in PROMPTS]

    def generate(case: tuple[str, str]) -> pb.GenerateResponse:
        scheme, prompt = case
        request = pb.GenerateRequest(model=scheme, prompt=prompt, max_new_tokens=NEW_TOKENS)
        return fused_server.stub.Generate(request, timeout=300)

    with ThreadPoolExecutor(len(cases)) as pool:
        responses = list(pool.map(generate, cases))
    for (scheme, prompt), response in zip(cases, responses, strict=True):
        served = list(response.text.encode("utf-8"))
        if response.finish_reason == pb.FINISH_REASON_EOS:
            served.append(TOKENIZER.eos_token_id)
        assert served == pytorch_greedy(scheme, prompt, NEW_TOKENS), (scheme, prompt)


def test_fused_refuses_an_export_without_the_graph(repository: Path, tmp_path: Path) -> None:
    """--attention fused names the model whose export lacks the fused graph and does not start."""
    folder = tmp_path / "alibi"
    shutil.copytree(repository / "alibi", folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["variants"]["serving-fused"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    server = ServerProcess(tmp_path, "--attention", "fused")
    try:
        assert server.process.wait(timeout=120) != 0
        assert "has no fused float32 decode graph" in server.output()
    finally:
        server.stop()
