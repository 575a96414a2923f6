"""The span alphabet: one for every copy probe, its chance derived from it, importable without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from contract.paths import REPOSITORY_ROOT
from models.data import SPAN_BYTES
from models.spans import SPAN_ALPHABET, SPAN_CHANCE


def test_chance_is_one_over_the_alphabet_and_training_draws_from_it() -> None:
    assert SPAN_CHANCE == 1 / len(SPAN_ALPHABET) and len(set(SPAN_ALPHABET)) == len(SPAN_ALPHABET)
    assert bytes(SPAN_BYTES).decode() == SPAN_ALPHABET


@pytest.mark.server  # runs a subprocess
def test_the_alphabet_imports_nothing_but_the_standard_library() -> None:
    check = "import sys, models.spans; assert not {'numpy', 'torch'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", check], cwd=REPOSITORY_ROOT, check=True)
