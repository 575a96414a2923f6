"""Tests' short forms of the runner's one way into a prompt (ModelRunner.prefill)."""

from __future__ import annotations

from collections.abc import Callable

from service.engine.prompts.prompt import PrefilledPrompt, PromptRun
from service.engine.worker.runner import ModelRunner


def batch(runner: ModelRunner, prompts: dict[str, list[int]]) -> list[PrefilledPrompt]:
    """Whole prompts in one padded call."""
    runs = [PromptRun(rid, ids) for rid, ids in prompts.items()]
    *_, computed = runner.prefill(runs, max(len(run.token_ids) for run in runs))
    assert computed is not None
    return computed


def chunked(
    runner: ModelRunner, request_id: str, ids: list[int], chunk_tokens: int, aborted: Callable[[], bool] = lambda: False
) -> PrefilledPrompt | None:
    """One prompt, every chunk at once; None if `aborted()` turns true in between."""
    for computed in runner.prefill([PromptRun(request_id, ids)], chunk_tokens):
        if computed is not None:
            return computed[0]
        if aborted():
            return None
    raise ValueError("chunked: empty prompt")
