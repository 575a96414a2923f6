"""The bench's policies section prints what the service answers: a hybrid's refused forms as refused."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.policies import print_int8_ratio, print_policy_steps


def test_a_hybrid_s_refused_forms_print_refused_and_full_is_timed(
    repository: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = argparse.Namespace(threads=1, device="cpu")
    print_policy_steps([repository / "rnope-swa"], args, steps=2)
    print_int8_ratio([repository / "rnope-swa"], args, steps=2)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("rnope-swa"))
    full = row.split()[1:4]  # batch 1 / batch 8 step times (ms)
    assert full[1] == "/" and float(full[0]) > 0 and float(full[2]) > 0
    assert row.count("refused") == 5  # window:256, sinks, window:64, int8, window:256+int8
    assert "int8 rows" not in out  # the int8 ratio leaves a model out that refuses int8
