"""Shared fixtures: one model repository exported from the shipped weights per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from export.repository import ExportOptions, run
from tests.standins import linked_weights, seed_weights


@pytest.fixture(scope="session")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """POSENC_TEST_REPOSITORY reuses an existing repository (for quick local iterations).

    The float16 graphs are asked for: tests hold them to PyTorch, though a CPU export skips them.
    Further training seeds (models/weights/seed<N>/) are left out: tests/export/test_seeds.py exports
    stand-ins of its own.
    """
    if os.environ.get("POSENC_TEST_REPOSITORY"):
        return Path(os.environ["POSENC_TEST_REPOSITORY"])
    out = tmp_path_factory.mktemp("model_repository")
    run(ExportOptions(out=out, verify=False, fp16=True, extra_seeds=False))
    return out


@pytest.fixture(scope="session")
def seeded_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """alibi and a perturbed stand-in of a further training seed of it, `alibi@seed2` (tests/standins.py),
    exported from weights laid out as training leaves them (float32 and serving graphs)."""
    tmp_path = tmp_path_factory.mktemp("seeds")
    weights = linked_weights(tmp_path, ("alibi",))
    seed_weights(weights, "alibi", 2)
    out = tmp_path / "repository"
    options = ExportOptions(weights=weights, out=out, schemes=("alibi",), graphs=("serving-float32",), verify=False)
    assert [r.name for r in run(options)] == ["alibi", "alibi@seed2"]
    return out
