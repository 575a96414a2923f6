"""Fixtures of the deployment tests."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import pytest


def _tool(name: str) -> str:
    """A Debian tool the tests need; CI installs it (.ci/run), elsewhere its absence skips."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed (.ci/run installs it)")
        pytest.skip(f"{name} not installed (apt-get install prometheus docker-compose nginx haproxy)")
    return path


@pytest.fixture(scope="session")
def tool() -> Callable[[str], str]:
    """`tool("promtool")`: the path of a Debian tool; fails in CI, skips elsewhere when missing."""
    return _tool
