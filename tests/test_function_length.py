"""No function over 80 lines in the project's packages: a reader should see a function whole, and a
long one is usually several steps that want names of their own (issue 53)."""

from __future__ import annotations

import ast
from pathlib import Path

from contract.paths import REPOSITORY_ROOT

PACKAGES = ("service", "loadtest", "bench", "export", "models")
MAX_LINES = 80
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def long_functions(root: Path = REPOSITORY_ROOT, limit: int = MAX_LINES) -> list[str]:
    """`path:line name (n lines)` for every function or method longer than `limit` lines."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path.name.endswith(GENERATED):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > limit:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_over_80_lines() -> None:
    assert long_functions() == []


def test_the_check_finds_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "long.py").write_text(f"def long():\n{body}\n")
    assert long_functions(tmp_path) == ["service/long.py:1 long (81 lines)"]
