"""Shared fixtures (one model repository exported from the shipped weights per test session) and the
test layers as markers: `unit`, `server` and `deploy` (README, "Tests")."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from export.repository import ExportOptions, run
from tests.standins import linked_weights, seed_weights

# Fixtures that export a model repository; every fixture that starts a server is built on one of them,
# so a test that reaches one of these (directly or through other fixtures) crosses a process.
REPOSITORY_FIXTURES = frozenset({"repository", "seeded_repository"})
LAYERS = ("unit", "server", "deploy")
DEPLOY_FOLDER = Path(__file__).parent / "deploy"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test exactly one layer, by rule rather than by hand in 70 files.

    `deploy` for tests/deploy/; `server` for a test that reaches a repository fixture, or that a
    module marks `server` itself (it runs a subprocess without a fixture); `unit` for the rest.
    """
    for item in items:
        if DEPLOY_FOLDER in Path(item.path).parents:
            layer = "deploy"
        elif REPOSITORY_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("server"):
            layer = "server"
        else:
            layer = "unit"
        if not item.get_closest_marker(layer):
            item.add_marker(layer)


class ProcessStarted(RuntimeError):
    """A `unit` test tried to start a process: mark it (or its module) `server`."""


@pytest.fixture(autouse=True)
def _unit_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Hold `unit` tests to their promise: starting a subprocess or a multiprocessing child raises.

    This is what keeps `pytest -m unit` fast and safe to run while working; a test that needs a
    process belongs to the `server` layer.
    """
    if request.node.get_closest_marker("unit") is None:
        yield
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise ProcessStarted(f"{request.node.nodeid} is marked unit but starts a process")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield


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
    options = ExportOptions(
        weights=weights, out=out, schemes=("alibi",), graphs=("serving-float32",), verify=False, extra_seeds=True
    )
    assert [r.name for r in run(options)] == ["alibi", "alibi@seed2"]
    return out
