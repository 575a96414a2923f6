"""The benchmark's per-layer decode rates: a figure it prints must mean what its label says."""

from __future__ import annotations

from pathlib import Path

from bench.layers import decode_tokens_per_second_core, decode_tokens_per_second_genai


def test_single_stream_figures_come_from_the_paths_they_name(repository: Path) -> None:
    """The engine core figure is read from a real core process; genai runs with the threads asked."""
    assert decode_tokens_per_second_core(repository, "alibi", 48, 1) > 0
    genai = decode_tokens_per_second_genai(repository / "alibi", 48, 1)
    assert genai is None or genai > 0  # None: onnxruntime-genai not installed
