"""The exported tokenizer.json, read by Hugging Face `tokenizers`, encodes and decodes exactly as
the service tokenizes (service.engine.processing.input_processor); the shipped weights' folders carry the same file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from contract.manifest import Manifest
from export.manifest import TOKENIZER_JSON, huggingface_tokenizer, ship_tokenizers, write_tokenizer_json
from models.checkpoints import WEIGHTS_DIR, trained_schemes
from service.engine.processing.input_processor import InputLimits, InputProcessor

TRAINED = trained_schemes()  # the schemes with shipped weights: what the repository fixture exports

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


def test_every_shipped_model_folder_carries_the_tokenizer_export_writes(tmp_path: Path) -> None:
    # Out of date: python -c 'from export.manifest import ship_tokenizers; ship_tokenizers()'
    expected = write_tokenizer_json(tmp_path).read_bytes()
    assert json.loads(expected) == huggingface_tokenizer()
    for scheme in TRAINED:
        assert (WEIGHTS_DIR / scheme / TOKENIZER_JSON).read_bytes() == expected, scheme
    (tmp_path / "weights" / "alibi").mkdir(parents=True)
    assert ship_tokenizers(tmp_path / "weights") == [tmp_path / "weights" / "alibi" / TOKENIZER_JSON]


@pytest.mark.parametrize("scheme", TRAINED)
def test_the_shipped_file_read_by_tokenizers_encodes_as_the_service(
    service_tokenizer: InputProcessor, scheme: str
) -> None:
    tokenizer = Tokenizer.from_file(str(WEIGHTS_DIR / scheme / TOKENIZER_JSON))
    for text in TEXTS:
        assert tokenizer.encode(text).ids == service_tokenizer.tokenize(text), (scheme, text)
