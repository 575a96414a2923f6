"""The runner's batch bookkeeping against ONNX Runtime alone, for both cache layouts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from export.manifest import Manifest
from export.runtime import OnnxCausalLM
from models.tokenizer import TOKENIZER
from service.engine.runner import ModelRunner, PrefilledPrompt

PROMPTS = {
    "a": TOKENIZER.encode("def f(x):\n"),
    "b": TOKENIZER.encode('class Parser(object):\n    """Parse things."""\n'),
    "c": TOKENIZER.encode("import os\n"),
}


def lone_logits(repository: Path, model: str, prompt: list[int], steps: int) -> list[np.ndarray]:
    """Per-step logits of a lone greedy run (step 0 = after the prompt)."""
    _, logits = OnnxCausalLM(repository / model).greedy([prompt], steps)
    return [step[0] for step in logits]


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("model", ["alibi", "relative", "rope"])
def test_sequences_joining_and_leaving_match_lone_runs(repository: Path, model: str, in_place: bool) -> None:
    runner = ModelRunner(Manifest.load(repository / model), "cpu", threads=1, growth_tokens=8, in_place=in_place)
    assert runner.in_place == in_place
    expected = {rid: lone_logits(repository, model, prompt, 12) for rid, prompt in PROMPTS.items()}
    seen: dict[str, list[np.ndarray]] = {rid: [] for rid in PROMPTS}
    tokens: dict[str, int] = {}

    def record(results: dict[str, np.ndarray]) -> None:
        for rid, logits in results.items():
            seen[rid].append(logits)
            tokens[rid] = int(np.argmax(expected[rid][len(seen[rid]) - 1]))  # follow the lone run's path

    def joined(prompts: list[PrefilledPrompt]) -> None:
        runner.join(prompts)
        record({p.request_id: p.logits for p in prompts})

    def step() -> None:
        logits = runner.decode(np.array([tokens[r] for r in runner.rows]))
        record(dict(zip(runner.rows, logits, strict=True)))

    joined(runner.prefill_batch({"a": PROMPTS["a"]}))
    for _ in range(3):
        step()
    # "b" is computed in chunks (longer than "a" so far), then "b" and "c" join together.
    b = runner.prefill_chunked("b", PROMPTS["b"], chunk_tokens=20)
    assert b is not None
    step()
    joined([b, *runner.prefill_batch({"c": PROMPTS["c"]})])
    for _ in range(4):
        step()
    runner.remove({"a"})
    for _ in range(4):
        step()
    assert sorted(runner.rows) == ["b", "c"]
    for rid, logits in seen.items():
        assert len(logits) > 1
        for step, value in enumerate(logits):
            np.testing.assert_allclose(value, expected[rid][step], atol=1e-4, err_msg=f"{rid} step {step}")
    runner.remove({"b", "c"})
    assert runner.rows == [] and runner.cache_slots == 0


def test_batched_prompts_match_lone_prompts(repository: Path) -> None:
    """Left padding of a batched prefill is cut off: each row's cache is its lone cache."""
    runner = ModelRunner(Manifest.load(repository / "rope"), "cpu", threads=1)
    together = runner.prefill_batch(PROMPTS)
    for prompt in together:
        alone = runner.prefill_batch({prompt.request_id: PROMPTS[prompt.request_id]})[0]
        assert prompt.cache[0].shape == alone.cache[0].shape == (1, 4, len(PROMPTS[prompt.request_id]), 32)
        np.testing.assert_allclose(prompt.logits, alone.logits, atol=1e-4)
        for mine, lone in zip(prompt.cache, alone.cache, strict=True):
            np.testing.assert_allclose(mine, lone, atol=1e-4)


def test_aborted_chunked_prefill_returns_nothing(repository: Path) -> None:
    runner = ModelRunner(Manifest.load(repository / "alibi"), "cpu", threads=1)
    calls = iter([False, True])
    assert runner.prefill_chunked("x", PROMPTS["b"], chunk_tokens=8, aborted=lambda: next(calls)) is None
