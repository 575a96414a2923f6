"""Parity: ONNX Runtime versus PyTorch, and ONNX cached decoding versus full recomputation."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from contract.cache_policy import parse_cache_policy
from contract.graph import LOGITS, input_names, left_pad_batch, new_kv_names, right_pad_batch
from contract.kv_int8 import quantize_numpy
from contract.manifest import SERVING_INT8, variant_dtype
from export.runtime import FusedDecoder, OnnxCausalLM, PromptGraph
from models.streaming import stream_logits
from models.tokenizer import TOKENIZER
from models.transformer import Transformer

# Tolerances on logits (max absolute difference).
FP32_TOLERANCE = 1e-4
# fp16 keeps ~3 significant digits; logits here reach ~20 in magnitude.
FP16_TOLERANCE = 0.1
# A graph is also allowed twice what float32 rounding costs PyTorch itself on the parity prompts
# (its float32 logits against a float64 run fed the same tokens), where that is larger: a model
# can be ill-conditioned enough that no float32 graph meets FP32_TOLERANCE against PyTorch
# (the one-recipe NoPE: PyTorch float32 is 1.2e-4 from float64, the other schemes about 1e-5).
ROUNDING_FACTOR = 2.0


def tolerance(variant: str) -> float:
    """The logit tolerance of a graph variant: set by its dtype, serving graphs alike."""
    return FP32_TOLERANCE if variant_dtype(variant) == "float32" else FP16_TOLERANCE


PARITY_PROMPTS = [
    b"def fibonacci(n):\n    ",
    b"import os\n",
    b'class Config:\n    """Settings."""\n\n    def __init__(self',
]


@dataclass
class ParityReport:
    name: str
    dtype: str
    prefill_max_abs: float
    decode_max_abs: float
    cached_vs_full_max_abs: float
    greedy_equal: bool
    steps: int
    reference_rounding: float = 0.0  # PyTorch's own float32 rounding on these prompts (TorchReference)

    @property
    def max_abs(self) -> float:
        return max(self.prefill_max_abs, self.decode_max_abs)

    def limit(self, tolerance: float) -> float:
        """`tolerance`, or ROUNDING_FACTOR x PyTorch's own float32 rounding where that is larger."""
        return max(tolerance, ROUNDING_FACTOR * self.reference_rounding)

    def passed(self, tolerance: float) -> bool:
        limit = self.limit(tolerance)
        return self.max_abs <= limit and self.cached_vs_full_max_abs <= limit and self.greedy_equal


def default_prompts(bos_token_id: int) -> list[list[int]]:
    return [[bos_token_id, *prompt] for prompt in PARITY_PROMPTS]


@dataclass
class TorchReference:
    """PyTorch's side of a parity check, computed once per model and replayed against each graph:
    the left-padded prefill, then `steps` greedy tokens (PyTorch's own choice) and their logits."""

    prompts: list[list[int]]
    ids: np.ndarray
    mask: np.ndarray
    positions: np.ndarray
    prefill_logits: np.ndarray  # (B, P, V)
    tokens: list[np.ndarray]  # per step (B, 1)
    step_logits: list[np.ndarray]  # per step (B, 1, V)
    rounding: float = 0.0  # max |float32 - float64| of PyTorch's logits, the same run in float64

    @property
    def steps(self) -> int:
        return len(self.tokens)


@torch.no_grad()
def torch_reference(model: Transformer, prompts: list[list[int]], pad_token_id: int, steps: int = 32) -> TorchReference:
    """Run PyTorch (float32) once: prefill, then `steps` cached greedy steps; then the same run in
    float64, fed the same tokens, for how much float32 rounding costs this model (`rounding`)."""
    model = model.float().eval()
    ids, mask, positions = left_pad_batch(prompts, pad_token_id)
    run = _CachedRun(model, ids, mask, positions)
    reference = TorchReference(prompts, ids, mask, positions, run.logits, [], [])
    for _ in range(steps):
        next_ids = run.logits[:, -1].argmax(-1).astype(np.int64)[:, None]  # (B, 1)
        reference.tokens.append(next_ids)
        reference.step_logits.append(run.feed(next_ids))
    reference.rounding = float64_distance(copy.deepcopy(model).double(), reference)
    return reference


class _CachedRun:
    """A PyTorch model's prefill of a left-padded batch, then one cached step per `feed`."""

    def __init__(self, model: Transformer, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> None:
        self.model, self.mask, self.positions = model, mask, positions
        logits, self.past = model(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(positions))
        self.logits: np.ndarray = logits.numpy()

    def feed(self, next_ids: np.ndarray) -> np.ndarray:
        """One token per row (B, 1) -> its logits (B, 1, V)."""
        self.mask = np.concatenate([self.mask, np.ones_like(next_ids)], axis=1)
        self.positions = self.positions[:, -1:] + 1
        logits, self.past = self.model(
            torch.from_numpy(next_ids), torch.from_numpy(self.mask), torch.from_numpy(self.positions), self.past
        )
        self.logits = logits.numpy()
        return self.logits


@torch.no_grad()
def float64_distance(model: Transformer, reference: TorchReference) -> float:
    """Max |reference - `model`'s logits| over the prefill's real positions and every step, `model`
    (the reference's, in float64) fed the reference's tokens."""
    run = _CachedRun(model, reference.ids, reference.mask, reference.positions)
    worst = float(np.abs(run.logits - reference.prefill_logits)[reference.mask.astype(bool)].max())
    for next_ids, expected in zip(reference.tokens, reference.step_logits, strict=True):
        worst = max(worst, float(np.abs(run.feed(next_ids) - expected).max()))
    return worst


def check_parity(
    model: Transformer | TorchReference, runtime: OnnxCausalLM, prompts: list[list[int]], steps: int = 32
) -> ParityReport:
    """Batched left-padded prefill, then `steps` cached decode steps fed the same tokens.

    PyTorch runs in float32 as the reference (pass a `TorchReference` to reuse one across graphs);
    the ONNX graph may be float16 or a serving graph (whose new K/V the runtime appends to the past).
    """
    reference = (
        model if isinstance(model, TorchReference) else torch_reference(model, prompts, runtime.pad_token_id, steps)
    )
    ids, mask, positions = reference.ids, reference.mask, reference.positions
    onnx_logits, onnx_past = runtime.forward(ids, mask, positions, runtime.empty_past(len(reference.prompts)))
    real = mask.astype(bool)
    prefill = float(np.abs(onnx_logits.astype(np.float32) - reference.prefill_logits)[real].max())

    decode, cached_steps = 0.0, []
    for next_ids, torch_logits in zip(reference.tokens, reference.step_logits, strict=True):
        mask = np.concatenate([mask, np.ones_like(next_ids)], axis=1)
        positions = positions[:, -1:] + 1
        onnx_logits, onnx_past = runtime.forward(next_ids, mask, positions, onnx_past)
        decode = max(decode, float(np.abs(onnx_logits.astype(np.float32) - torch_logits).max()))
        cached_steps.append(onnx_logits[:, -1].astype(np.float32))

    # The same sequences recomputed from scratch in one ONNX call.
    full_ids = np.concatenate([ids, *reference.tokens], axis=1)
    full_positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    full_logits, _ = runtime.forward(full_ids, mask, full_positions, runtime.empty_past(len(reference.prompts)))
    # Decode step k fed the token at index P + k, so its logits sit there in the full pass.
    recomputed = full_logits[:, ids.shape[1] :].astype(np.float32)  # (B, steps, V)
    cached = np.stack(cached_steps, axis=1)  # (B, steps, V)
    cached_vs_full = float(np.abs(cached - recomputed).max())
    greedy_equal = bool((cached.argmax(-1) == recomputed.argmax(-1)).all())
    return ParityReport(
        runtime.manifest.name, runtime.dtype, prefill, decode, cached_vs_full, greedy_equal, reference.steps,
        reference.rounding,
    )  # fmt: skip


@torch.no_grad()
def check_int8_graph(model: Transformer, runtime: OnnxCausalLM, prompts: list[list[int]]) -> float:
    """The serving-int8 graph against PyTorch fed the same dequantized cache: each prompt's cache,
    quantized (contract.kv_int8), then its next token. Returns the max absolute logit difference
    (within FP32_TOLERANCE: the graph only dequantizes; what int8 costs is measured elsewhere)."""
    assert runtime.dtype == SERVING_INT8
    model = model.float().eval()
    n_layers, worst = model.config.n_layers, 0.0
    for ids in prompts:
        _, present = model(torch.tensor([ids[:-1]]))
        quantized = [quantize_numpy(t.numpy()) for pair in present for t in pair]
        past = [torch.from_numpy(q.astype(np.float32) * s) for q, s in quantized]
        mask = np.ones((1, len(ids)), dtype=np.int64)
        position = np.array([[len(ids) - 1]], dtype=np.int64)
        token = np.array([[ids[-1]]], dtype=np.int64)
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(n_layers)]
        expected, _ = model(torch.from_numpy(token), torch.from_numpy(mask), torch.from_numpy(position), pairs)
        feeds = dict(zip(input_names(n_layers, int8=True), [token, mask, position], strict=False))
        names = input_names(n_layers, int8=True)[3:]
        feeds.update(zip(names, [q for q, _ in quantized] + [s for _, s in quantized], strict=True))
        logits, *_ = runtime.session.run([LOGITS, *new_kv_names(n_layers)], feeds)
        worst = max(worst, float(np.abs(logits - expected.numpy()).max()))
    return worst


@dataclass
class FusedReport:
    """serving-fused against PyTorch: decode steps of rows of different lengths in one batch."""

    max_abs: float
    greedy_equal: bool
    steps: int

    def passed(self, tolerance: float = FP32_TOLERANCE) -> bool:
        return self.max_abs <= tolerance and self.greedy_equal


@torch.no_grad()
def _greedy(
    model: Transformer, prompts: list[list[int]], steps: int
) -> tuple[list[np.ndarray], list[list[int]], list[np.ndarray]]:
    """Each prompt alone through PyTorch float32: its prompt cache (2L, heads, P, hd), then `steps`
    greedy tokens and the logits after each (steps, vocab)."""
    model = model.float().eval()
    caches, tokens, logits = [], [], []
    for ids in prompts:
        out, past = model(torch.tensor([ids]))
        caches.append(torch.cat([t for pair in past for t in pair]).numpy())
        fed, seen = [], []
        for _ in range(steps):
            fed.append(int(out[0, -1].argmax()))
            out, past = model(torch.tensor([[fed[-1]]]), past_key_values=past)
            seen.append(out[0, -1].numpy())
        tokens.append(fed)
        logits.append(np.stack(seen))
    return caches, tokens, logits


@torch.no_grad()
def check_fused_graph(
    model: Transformer, folder: Path, prompts: list[list[int]], steps: int = 32, threads: int = 0
) -> FusedReport:
    """Each prompt alone through PyTorch (prefill, then `steps` greedy steps); the fused graph decodes
    all of them at once from PyTorch's prompt caches, left-aligned in one buffer as the engine keeps
    them, fed PyTorch's tokens. Greedy: the fused graph's argmax equals PyTorch's at every step."""
    caches, tokens, logits = _greedy(model, prompts, steps)
    decoder = FusedDecoder(folder, len(prompts), max(map(len, prompts)) + steps, threads)
    for row, cache in enumerate(caches):
        decoder.write(row, cache)
    worst, greedy = 0.0, True
    expected_tokens, expected_logits = np.asarray(tokens), np.stack(logits)  # (B, steps), (B, steps, V)
    for k in range(steps):
        got = decoder.step(expected_tokens[:, k])
        worst = max(worst, float(np.abs(got - expected_logits[:, k]).max()))
        greedy = greedy and bool((got.argmax(-1) == expected_logits[:, k].argmax(-1)).all())
    return FusedReport(worst, greedy, steps)


# The fused int8 graph against the PyTorch reference that quantizes the same way: ONNX Runtime's and
# torch's float32 K/V differ in the last bits, so a value now and then rounds to the neighbouring int8
# step and moves later logits by up to ~1e-2 (tests/service/engine/kv/test_int8_cache.py); held to this.
INT8_CHANNEL_TOLERANCE = 0.05


@torch.no_grad()
def check_fused_int8_graph(
    model: Transformer, folder: Path, prompts: list[list[int]], steps: int = 32, threads: int = 0
) -> float:
    """The serving-fused-int8 graph decoding every prompt at once from its quantized prompt cache,
    fed PyTorch's float32 greedy tokens, against models.streaming under the `int8` policy with the
    manifest's scales (prompt in float32, then each token through the int8 cache). Returns the largest
    absolute logit difference."""
    caches, fed, _ = _greedy(model, prompts, steps)
    decoder = FusedDecoder(folder, len(prompts), max(map(len, prompts)) + steps, threads, int8=True)
    for row, cache in enumerate(caches):
        decoder.write(row, cache)
    scales, policy = decoder.scales, parse_cache_policy("int8")
    expected = [
        stream_logits(model, ids + tokens, policy, prompt_tokens=len(ids), int8_channel_scales=scales)[len(ids) :]
        for ids, tokens in zip(prompts, fed, strict=True)
    ]  # (steps, vocab) each: after each fed token
    worst, tokens = 0.0, np.asarray(fed)
    for k in range(steps):
        got = decoder.step(tokens[:, k])
        worst = max(worst, max(float(np.abs(got[row] - e[k].numpy()).max()) for row, e in enumerate(expected)))
    return worst


@torch.no_grad()
def check_prefill_graph(model: Transformer, folder: Path, prompts: list[list[int]], chunk: int = 7) -> float:
    """The fused prompt graph (prefill-fused) against PyTorch run on each prompt alone, every position's
    logits: all prompts in one right-padded call, and each prompt in chunks of `chunk` tokens fed the
    cache the graph returned for the chunks before. Returns the largest absolute difference."""
    model = model.float().eval()
    expected = [model(torch.tensor([ids]))[0][0].numpy() for ids in prompts]
    graph = PromptGraph(folder)
    ids, mask, positions = right_pad_batch(prompts, TOKENIZER.pad_token_id)
    logits, _ = graph.run(ids, mask, positions, graph.empty_past(len(prompts)))
    worst = max(float(np.abs(logits[row, : len(p)] - expected[row]).max()) for row, p in enumerate(prompts))
    for prompt, reference in zip(prompts, expected, strict=True):
        past = graph.empty_past(1)
        for start in range(0, len(prompt), chunk):
            piece = np.asarray([prompt[start : start + chunk]], dtype=np.int64)
            end = start + piece.shape[1]
            positions = np.arange(start, end, dtype=np.int64)[None]
            logits, past = graph.run(piece, np.ones((1, end), dtype=np.int64), positions, past)
            worst = max(worst, float(np.abs(logits[0] - reference[start:end]).max()))
    return worst
