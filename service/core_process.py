"""The engine core as an operating-system process: how one is started, how its death is named, how
often it may die before the server gives up, and how one that will not stop is ended.

Kept apart from `service.engine_client`, which routes requests and events over the pipes these
processes hold and decides what survives a death.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from service.engine.messages import CoreConfig, EngineConfig, MessageWriter

logger = logging.getLogger(__name__)

RESTARTS_ALLOWED = 3  # unexpected core exits within RESTART_WINDOW_SECONDS before the server gives up
RESTART_WINDOW_SECONDS = 300.0


@dataclass
class CoreProcess:
    """A running core, the pipe its commands go down, and the read end of its events."""

    process: subprocess.Popen[bytes]
    commands: MessageWriter
    events_fd: int


def spawn_core(repository: Path, config: EngineConfig, names: list[str] | None) -> CoreProcess:
    """A new core (`python -m service.engine.core`) with a new pair of pipes."""
    commands_read, commands_write = os.pipe()
    events_read, events_write = os.pipe()
    core_config = CoreConfig(
        repository, config, names, commands_read, events_write, logging.getLogger().getEffectiveLevel()
    )
    # A fresh interpreter, not fork: the front end already runs gRPC's threads. Its configuration
    # comes on stdin; its log goes where ours does.
    process = subprocess.Popen(
        [sys.executable, "-m", "service.engine.core"], stdin=subprocess.PIPE, pass_fds=(commands_read, events_write)
    )
    os.close(commands_read)  # ours are the other ends: EOF on events when the core dies
    os.close(events_write)
    assert process.stdin is not None
    process.stdin.write(pickle.dumps(core_config))
    process.stdin.close()
    logger.info("engine core started (pid %d)", process.pid)
    return CoreProcess(process, MessageWriter(commands_write), events_read)


def exit_cause(code: int | None) -> str:
    """What a core's exit code says about its death, for logs and the requests it cut."""
    if code is not None and code >= 0:
        return f"engine process exited unexpectedly (exit code {code})"
    return f"engine process was killed (signal {-(code or 0)})"


class RestartWindow:
    """Unexpected exits within the last RESTART_WINDOW_SECONDS: past RESTARTS_ALLOWED the server
    stops restarting (a core that keeps dying is for its supervisor to act on)."""

    def __init__(self, allowed: int = RESTARTS_ALLOWED, seconds: float = RESTART_WINDOW_SECONDS) -> None:
        self.allowed, self.seconds = allowed, seconds
        self._exits: deque[float] = deque()

    def give_up(self, now: float) -> str | None:
        """Record an exit at `now`; the reason to stop restarting, or None to restart."""
        self._exits.append(now)
        while self._exits and now - self._exits[0] > self.seconds:
            self._exits.popleft()
        if len(self._exits) > self.allowed:
            return f"the engine core died {len(self._exits)} times within {self.seconds:.0f} s"
        return None


def end_process(process: subprocess.Popen[bytes], wait_seconds: float = 10.0) -> None:
    """Wait for a core told to stop; kill it if it does not exit in time."""
    try:
        process.wait(wait_seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)
