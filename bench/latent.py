"""What RoPE costs latent attention: the absorbed decode step against the one full-key RoPE would force.

MLA caches one latent (and a small rotated key) per token. Decoupling RoPE lets the key up-projection
fold into the query, so a decode step attends over the cached latents themselves (the absorbed form,
what the service runs). Were RoPE on every key dimension, a rotation would sit between query and key
up-projection: the cached latents would have to be up-projected to per-head keys and values again at
every step (rotated full keys cannot be cached compressed). This section times both graphs, exported
from the same weights, one decode step at each context, in the same run, and prints the ratio.

The up-projected yardstick leaves out the rotation of the up-projected keys themselves, so the ratio
understates what full-key RoPE would cost.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from contract.graph import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, past_names
from contract.manifest import Manifest
from export.onnx import export_onnx
from export.runtime import session_options
from models.positional import matched_config
from models.transformer import Transformer

ROUNDS = 5


def _graphs(scratch: Path) -> dict[str, Path]:
    """The absorbed and up-projected serving graphs of one seeded mla model (step cost needs no training)."""
    torch.manual_seed(1234)
    model = Transformer(matched_config("mla")).eval()
    paths = {}
    for form, absorbed in (("absorbed", True), ("up-projected", False)):
        copied = copy.deepcopy(model)
        for block in copied.blocks:
            block.attn.serve_in_place(absorbed)
        paths[form] = scratch / f"{form}.onnx"
        export_onnx(copied, paths[form])  # in place already: its serving layout is the one set above
    return paths


def _step_seconds(session: ort.InferenceSession, n_layers: int, width: int, context: int, steps: int) -> float:
    """Median seconds of one decode step (batch 1) over a cache of `context` tokens."""
    past = np.random.default_rng(0).standard_normal((1, 1, context, width)).astype(np.float32)
    feeds = {name: past for name in past_names(n_layers, ("latent",))}
    feeds |= {
        INPUT_IDS: np.array([[65]], dtype=np.int64),
        ATTENTION_MASK: np.ones((1, context + 1), dtype=np.int64),
        POSITION_IDS: np.array([[context]], dtype=np.int64),
    }
    session.run(None, feeds)  # warm-up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        session.run(None, feeds)  # logits and each layer's new entry
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def absorbed_step_ratios(contexts: tuple[int, ...], threads: int, steps: int) -> dict[int, tuple[float, float]]:
    """Per context: (absorbed step seconds, up-projected step seconds), each the median of ROUNDS rounds."""
    config = matched_config("mla")
    width = config.latent_width + config.latent_rope_width
    with tempfile.TemporaryDirectory(prefix="mla-forms-") as scratch:
        paths = _graphs(Path(scratch))
        sessions = {form: ort.InferenceSession(str(path), session_options(threads)) for form, path in paths.items()}
        samples: dict[str, dict[int, list[float]]] = {form: {c: [] for c in contexts} for form in sessions}
        for round_index in range(ROUNDS):
            forms = list(sessions)[round_index % 2 :] + list(sessions)[: round_index % 2]
            for form in forms:
                for context in contexts:
                    samples[form][context].append(
                        _step_seconds(sessions[form], config.n_layers, width, context, steps)
                    )
    return {
        c: (statistics.median(samples["absorbed"][c]), statistics.median(samples["up-projected"][c])) for c in contexts
    }


def print_absorbed_step(folders: list[Path], contexts: tuple[int, ...], threads: int, steps: int) -> None:
    """The absorbed decode step over the up-project-every-step one, where the repository serves mla."""
    if not any(Manifest.load(folder).scheme == "mla" for folder in folders):
        return
    print(
        "\nWhat RoPE costs latent attention: its absorbed decode step (the served graph) against up-projecting "
        f"every cached latent each step (the form full-key RoPE would force); graph only, batch 1, {threads} "
        f"thread(s), median of {ROUNDS} rounds of {steps} steps:"
    )
    for context, (absorbed, projected) in absorbed_step_ratios(contexts, threads, steps).items():
        print(
            f"  mla absorbed / up-projected  {absorbed / projected:.2f}   (at {context} tokens of context: "
            f"{absorbed * 1000:.2f} ms against {projected * 1000:.2f} ms)"
        )
