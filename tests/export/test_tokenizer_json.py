"""The exported tokenizer.json, read by Hugging Face `tokenizers`, encodes and decodes exactly as
the service tokenizes (service.engine.input_processor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from contract.manifest import Manifest
from export.manifest import huggingface_tokenizer
from service.engine.input_processor import InputLimits, InputProcessor

TEXTS = ["def f(x):\n    return x * 2\n", "", " leading space", "tabs\tand\r\nCRLF", "naïve café ☃ 🐍 中文",
         "\x00\x01\x7f control", "<|eos|> is text here", "Ā ġ Ł bytes GPT-2 remaps"]  # fmt: skip


@pytest.fixture(scope="module")
def service_tokenizer(repository: Path) -> InputProcessor:
    return InputProcessor(Manifest.load(repository / "alibi"), InputLimits(1024, 64, 4096))


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizers_encodes_and_decodes_as_the_service(service_tokenizer: InputProcessor, text: str) -> None:
    tokenizer = Tokenizer.from_str(json.dumps(huggingface_tokenizer()))
    ids = tokenizer.encode(text).ids
    assert ids == service_tokenizer.tokenize(text)
    assert tokenizer.decode(ids[1:]) == text
    assert tokenizer.get_vocab_size() == 259
    assert tokenizer.token_to_id("<|eos|>") == service_tokenizer.eos_token_id
