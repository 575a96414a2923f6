"""The README's two set-up commands stay the ones CI and users run."""

from __future__ import annotations

import re

from contract.paths import REPOSITORY_ROOT


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (REPOSITORY_ROOT / "README.md").read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith("python3 -m venv .venv")]


def test_readme_has_exactly_two_setup_commands_creating_dot_venv() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    assert ".venv/bin/python -m export && " in commands[0]
    assert ".venv/bin/python -m service.demo && " in commands[0]
    assert commands[0].endswith(".venv/bin/python -m loadtest.compare --quick")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci_lines = (REPOSITORY_ROOT / ".ci" / "run").read_text().splitlines()
    assert ci_lines[-1] == readme_commands()[1]
