"""The command-line client as a user runs it: a subprocess, with nothing else set up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.paths import REPOSITORY_ROOT
from service.process import ServerProcess, free_port


def run_client(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "service.client", *args]
    return subprocess.run(command, cwd=REPOSITORY_ROOT, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.server  # runs a subprocess
def test_client_without_a_service_exits_1_and_says_where_the_address_comes_from() -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    result = run_client("--model", "alibi", "--target", target, "def fib(n):")
    assert result.returncode == 1
    assert result.stdout == ""  # the prompt is echoed only once the service answered
    assert "UNAVAILABLE" in result.stderr and target in result.stderr
    assert "--target" in result.stderr and "POSENC_TARGET" in result.stderr


@pytest.mark.server  # runs a subprocess
def test_client_takes_its_target_from_posenc_target() -> None:
    target = f"127.0.0.1:{free_port()}"
    result = run_client("--model", "alibi", "def fib(n):", env={**os.environ, "POSENC_TARGET": target})
    assert result.returncode == 1 and target in result.stderr


@pytest.mark.server  # runs a subprocess
def test_client_help_shows_how_it_is_run_and_its_defaults() -> None:
    result = run_client("--help", env={k: v for k, v in os.environ.items() if k != "POSENC_TARGET"})
    assert result.returncode == 0
    assert result.stdout.startswith("usage: python -m service.client")
    assert "(default: localhost:50051)" in " ".join(result.stdout.split())


def test_client_streams_the_prompt_then_the_generated_text(repository: Path) -> None:
    server = ServerProcess(repository, "--models", "alibi").wait_serving()
    try:
        result = run_client("--model", "alibi", "--target", server.target, "--max-new-tokens", "16", "def fib(n):")
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def fib(n):") and len(result.stdout) > len("def fib(n):")
    assert "[length: 16 tokens" in result.stderr
