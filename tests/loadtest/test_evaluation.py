"""lm-evaluation-harness against the real service, from its own virtual environment: its bits per
byte on held-out windows equals the Score RPC's on the same windows, and its multiple-choice task
runs. The environment is made on first use (`.venv-lmeval`, pinned); POSENC_LMEVAL_PYTHON names an
interpreter that already has lm-eval (for quick local iterations)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loadtest.evaluation import choice_documents, evaluate


def test_lm_eval_bits_per_byte_equals_score_on_the_same_windows(repository: Path) -> None:
    python = os.environ.get("POSENC_LMEVAL_PYTHON")
    figures = evaluate(repository, ["alibi", "learned"], windows=3, choices=4, python=Path(python) if python else None)
    for scheme, row in figures.items():
        assert abs(row["lm_eval_bits_per_byte"] / row["score_bits_per_byte"] - 1) < 0.005, (scheme, row)
        assert 0 <= row["lm_eval_choice_accuracy"] <= 1
    # Windows that fit a request with room for lm-eval's one token are scored as Score scores them.
    assert figures["alibi"]["lm_eval_bits_per_byte"] == pytest.approx(figures["alibi"]["score_bits_per_byte"], rel=1e-5)


def test_multiple_choice_documents_hold_the_true_rest_among_three_others() -> None:
    documents = choice_documents(5, seed=3)
    assert documents == choice_documents(5, seed=3)  # seeded
    for document in documents:
        assert len(document["choices"]) == 4 and len(set(document["choices"])) == 4
        truth = document["choices"][document["label"]]
        assert truth.endswith("\n") and not document["context"].endswith("\n")
