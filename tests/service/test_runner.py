"""The runner's batch bookkeeping against ONNX Runtime alone, for both cache layouts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from export.manifest import Manifest
from export.runtime import OnnxCausalLM
from models.tokenizer import TOKENIZER
from service.engine.runner import ModelRunner, PrefillChunk

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

    record(runner.prefill([PrefillChunk("a", PROMPTS["a"], 0, True)])[0])
    for _ in range(3):
        record(runner.decode({r: tokens[r] for r in runner.rows}))
    # "b" arrives in two chunks while "a" decodes, then "c" joins whole.
    b = PROMPTS["b"]
    record(runner.prefill([PrefillChunk("b", b[:20], 0, False)])[0])
    record(runner.decode({r: tokens[r] for r in runner.rows}))
    record(runner.prefill([PrefillChunk("b", b[20:], 20, True), PrefillChunk("c", PROMPTS["c"], 0, True)])[0])
    for _ in range(4):
        record(runner.decode({r: tokens[r] for r in runner.rows}))
    runner.remove({"a"})
    for _ in range(4):
        record(runner.decode({r: tokens[r] for r in runner.rows}))
    assert sorted(runner.rows) == ["b", "c"]
    for rid, logits in seen.items():
        assert len(logits) > 1
        for step, value in enumerate(logits):
            np.testing.assert_allclose(value, expected[rid][step], atol=1e-4, err_msg=f"{rid} step {step}")
    runner.remove({"b", "c"})
    assert runner.rows == [] and runner.cache_slots == 0
