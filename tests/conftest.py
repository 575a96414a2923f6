"""Shared fixtures: one model repository exported from the shipped weights per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from export.repository import ExportOptions, run


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
