"""The benchmark's per-layer decode rates: a figure it prints must mean what its label says."""

from __future__ import annotations

from pathlib import Path

from bench.layers import decode_tokens_per_second_core, decode_tokens_per_second_genai
from bench.prefill import genai_prompt_seconds


def test_single_stream_figures_come_from_the_paths_they_name(repository: Path) -> None:
    """The engine core figure is read from a real core process; genai runs with the threads asked."""
    assert decode_tokens_per_second_core(repository, "alibi", 48, 1) > 0
    genai = decode_tokens_per_second_genai(repository / "alibi", 48, 1)
    assert genai is None or genai > 0  # None: onnxruntime-genai not installed


def test_genai_figures_are_absent_for_a_model_it_has_no_config_for(tmp_path: Path) -> None:
    """mla's folder has no genai_config.json (genai knows no latent cache): no figure, not a crash."""
    (tmp_path / "model.onnx").write_bytes(b"")
    assert decode_tokens_per_second_genai(tmp_path, 4, 1) is None
    assert genai_prompt_seconds(tmp_path, "def f():\n", 1) is None
