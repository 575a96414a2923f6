"""`python -m models.lesson` prints the seed lesson's table and its equivariance check."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from contract.paths import REPOSITORY_ROOT


def lesson_table(n: int, d: int) -> np.ndarray:
    """The lesson's own code for the sinusoidal table."""
    pos = np.arange(n)[:, None]
    angle = pos / 10000 ** (np.arange(0, d, 2) / d)
    table = np.zeros((n, d))
    table[:, 0::2], table[:, 1::2] = np.sin(angle), np.cos(angle)
    return table


@pytest.mark.server  # runs a subprocess
def test_lesson_command_prints_the_table_and_the_check() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "models.lesson"],
        cwd=REPOSITORY_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "Sinusoidal table, 4 positions x 6 dimensions:"
    printed = np.array([[float(v) for v in line.strip(" []").split()] for line in lines[1:5]])
    np.testing.assert_allclose(printed, lesson_table(4, 6), atol=5e-4)
    assert "shape (4, 6)" in lines[5] and lines[5].endswith("[0. 1. 0. 1. 0. 1.]")
    checks = {line.split(":")[0].strip(): line.split(":")[1].strip() for line in lines if line.startswith("  ")}
    assert checks == {
        "without positions": "True",
        "with the sinusoidal code added": "False",
        "without positions, causal mask": "False",
    }
    assert "causal mask already breaks" in result.stdout
