"""The layers hold: import-linter's contracts (pyproject.toml) pass, breaking one fails them, and no
package imports itself back in a circle (imports inside functions and under TYPE_CHECKING count)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from contract.paths import REPOSITORY_ROOT

PACKAGES = ("contract", "models", "export", "service", "loadtest", "bench")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(root), "PATH": str(Path(sys.executable).parent)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def copy_code(to: Path) -> Path:
    """The packages' Python files and pyproject.toml, nothing else (no weights, no caches)."""
    for package in PACKAGES:
        shutil.copytree(
            REPOSITORY_ROOT / package,
            to / package,
            ignore=lambda folder, names: (
                [n for n in names if not n.endswith(".py") and not (Path(folder) / n).is_dir()]
                + [n for n in names if n in ("__pycache__", "weights")]
            ),
        )
    shutil.copy(REPOSITORY_ROOT / "pyproject.toml", to / "pyproject.toml")
    return to


@pytest.mark.server  # runs a subprocess
def test_the_import_contracts_hold() -> None:
    result = lint_imports(REPOSITORY_ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "BROKEN" not in result.stdout and "5 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("service/servicer.py", "import models.tokenizer", "service imports only contract and itself"),
        ("service/engine_client.py", "import service.engine.worker.runner", "the front end loads neither the engine"),
        ("contract/manifest.py", "import export.manifest", "contract imports nothing of the project"),
    ],
)
@pytest.mark.server  # runs a subprocess
def test_breaking_a_contract_fails_the_check(tmp_path: Path, module: str, line: str, contract: str) -> None:
    root = copy_code(tmp_path)
    with (root / module).open("a") as source:
        source.write(f"\n{line}  # noqa\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert f"{contract}" in result.stdout and "BROKEN" in result.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back_through_others() -> None:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    assert _cycles(graph) == []
