"""How an export runs: models side by side in worker processes of one thread each (tracing is
single-threaded Python, so one process per core is what makes it fast), or in this process when one
worker is asked, and the bar that follows the graph files as they land."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

PROGRESS_POLL_S = 2.0
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} graphs written and models checked [{elapsed}]"


def _one_thread() -> None:
    """Worker initializer: the cores are shared out as processes, so each uses one thread."""
    torch.set_num_threads(1)


class InProcess(Executor):
    """An executor that runs each call at submission: one worker needs no process pool."""

    def submit(self, fn: Callable[..., object], /, *args: object, **kwargs: object) -> Future:  # type: ignore[override]
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as error:  # handed to whoever reads the result, as a pool would
            future.set_exception(error)
        return future


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def executor(workers: int) -> Executor:
    if workers <= 1:
        return InProcess()
    # spawn: a fork of a process that has run torch can deadlock in its thread pools.
    context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(workers, mp_context=context, initializer=_one_thread)


class ExportProgress:
    """The export's bar, one step per graph file written and per model checked: tracing a model's
    graphs takes a minute or more here, so a bar of whole models would sit at 0% for minutes. Graph
    files are counted on disk (workers are other processes), each polled PROGRESS_POLL_S."""

    def __init__(self, paths: list[Path], checks: int) -> None:
        """`paths`: the graph files the export writes; `checks`: the models it checks after."""
        # What each file was before (a file system's clock can lag time.time(), so no time threshold).
        self.before, self.checked = {path: self._stamp(path) for path in paths}, 0
        total = len(paths) + checks
        self.bar = tqdm(total=total, desc="export", unit="step", bar_format=BAR_FORMAT)

    @staticmethod
    def _stamp(path: Path) -> int | None:
        return path.stat().st_mtime_ns if path.is_file() else None

    def refresh(self) -> None:
        written = sum(1 for path, before in self.before.items() if self._stamp(path) not in (None, before))
        self.bar.update(written + self.checked - self.bar.n)

    def check(self) -> None:
        self.checked += 1
        self.refresh()
