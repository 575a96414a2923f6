"""Corpus: deterministic list, stable split by file, recorded hashes, --corpus paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from models.corpus import SPLITS, list_files, load_corpus, split_of, stdlib_root
from models.tokenizer import TOKENIZER


def test_split_is_stable_and_roughly_90_5_5() -> None:
    assert split_of("json/decoder.py") == split_of("json/decoder.py")
    names = [f"pkg/module_{i}.py" for i in range(4000)]
    counts = {name: sum(split_of(n) == name for n in names) for name in SPLITS}
    assert 0.87 < counts["train"] / 4000 < 0.93
    assert counts["validation"] > 100 and counts["test"] > 100


def test_stdlib_file_list_is_sorted_python_without_site_packages() -> None:
    files = list_files(stdlib_root())
    relative = [f.relative_to(stdlib_root()).as_posix() for f in files]
    assert relative == sorted(relative)
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert len(files) > 500


def test_folder_corpus_splits_by_file_and_records_sha256(tmp_path: Path) -> None:
    for i in range(60):
        (tmp_path / f"file_{i}.py").write_text(f"x = {i}\n" * 20)
    first, second = load_corpus(tmp_path), load_corpus(tmp_path)
    assert first.sha256 == second.sha256 and all(len(h) == 64 for h in first.sha256.values())
    assert sum(first.file_counts.values()) == 60
    for name in SPLITS:
        np.testing.assert_array_equal(first.splits[name], second.splits[name])
    # every file ends with EOS in the stream
    assert int((first.splits["train"] == TOKENIZER.eos_token_id).sum()) == first.file_counts["train"]


def test_single_file_corpus_splits_by_position(tmp_path: Path) -> None:
    text = tmp_path / "book.txt"
    text.write_text("hello world. " * 1000)
    corpus = load_corpus(text)
    assert corpus.file_counts == {"train": 1, "validation": 1, "test": 1}
    sizes = {name: len(tokens) for name, tokens in corpus.splits.items()}
    assert sizes["train"] > 8 * sizes["test"]


def test_tokenizer_round_trip_and_specials() -> None:
    ids = TOKENIZER.encode("héllo")
    assert ids[0] == TOKENIZER.bos_token_id and len(ids) == 1 + len("héllo".encode())
    assert TOKENIZER.decode([*ids, TOKENIZER.eos_token_id]) == "héllo"
    assert TOKENIZER.vocab_size == 259
