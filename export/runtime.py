"""A plain ONNX Runtime wrapper for one exported model: the offline reference loop.

Used by parity checks, evaluation and tests as "ONNX Runtime alone"; the serving engine has
its own runner. The in-place serving graphs run here too (their new K/V is appended to the
past outside the graph), so their parity is checked the same way. Positions beyond a bounded
model's table are refused here, before ONNX Runtime would silently index out of range.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from contract.graph import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOCAL_ATTENTION_MASK,
    LOGITS,
    POSITION_IDS,
    left_pad_batch,
    output_names,
    past_names,
    present_names,
    target_logprobs,
)
from contract.kv_int8 import quantize_channels
from contract.manifest import (
    NP_DTYPES,
    PREFILL_FUSED,
    PREFILL_UP_PROJECTED,
    SERVING,
    SERVING_FP16,
    SERVING_FUSED,
    SERVING_FUSED_INT8,
    Manifest,
    variant_dtype,
)
from models.limits import check_positions

Past = list[np.ndarray]  # per layer: key, value, key, value, ...


def session_options(threads: int = 0) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return options


class OnnxCausalLM:
    def __init__(
        self, folder: Path, dtype: str = "float32", providers: list[str] | None = None, threads: int = 0
    ) -> None:
        self.manifest = Manifest.load(folder)
        self.dtype = dtype  # the variant: float32, float16, serving-float32, serving-float16 or prefill-up-projected
        self.in_place = dtype in (SERVING, SERVING_FP16, PREFILL_UP_PROJECTED)
        path = self.manifest.verify(dtype)
        self.session = ort.InferenceSession(
            str(path), session_options(threads), providers=providers or ["CPUExecutionProvider"]
        )
        self.pad_token_id = int(self.manifest.tokenizer["pad_token_id"])  # type: ignore[call-overload]

    def empty_past(self, batch: int) -> Past:
        spec = self.manifest.kv_spec
        dtype = NP_DTYPES[variant_dtype(self.dtype)]
        return [np.zeros((batch, spec.heads, 0, spec.width), dtype=dtype) for _ in self._past_names]

    @property
    def _past_names(self) -> list[str]:
        return past_names(self.manifest.n_layers, self.manifest.kv_spec.entries)

    def forward(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: Past
    ) -> tuple[np.ndarray, Past]:
        """One graph call; returns logits (B, T, vocab) and the present K/V (past + new)."""
        check_positions(position_ids, self.manifest.max_positions)
        feeds = {INPUT_IDS: input_ids, ATTENTION_MASK: attention_mask, POSITION_IDS: position_ids}
        feeds.update(zip(self._past_names, past, strict=True))
        outputs = output_names(self.manifest.n_layers, new_only=self.in_place, entries=self.manifest.kv_spec.entries)
        logits, *present = self.session.run(outputs, feeds)
        if self.in_place:  # the serving graph returns only the new tokens' K/V
            present = [np.concatenate((old, new), axis=2) for old, new in zip(past, present, strict=True)]
        return logits, present

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[np.ndarray]]:
        """Batched greedy decoding with the KV cache (no early stop): tokens and per-step logits."""
        ids, mask, positions = left_pad_batch(prompts, self.pad_token_id)
        logits, past = self.forward(ids, mask, positions, self.empty_past(len(prompts)))
        generated: list[list[int]] = [[] for _ in prompts]
        step_logits = [logits[:, -1]]
        for _ in range(max_new_tokens):
            next_ids = step_logits[-1].argmax(-1)
            for row, token in enumerate(next_ids):
                generated[row].append(int(token))
            if len(generated[0]) == max_new_tokens:
                break
            mask = np.concatenate([mask, np.ones((len(prompts), 1), dtype=np.int64)], axis=1)
            positions = positions[:, -1:] + 1
            logits, past = self.forward(next_ids[:, None].astype(np.int64), mask, positions, past)
            step_logits.append(logits[:, -1])
        return generated, step_logits

    def token_logprobs(self, ids: list[int]) -> np.ndarray:
        """Teacher-forced log-probabilities of ids[1:]: one forward over ids[:-1] (positions < len-1)."""
        batch, mask, positions = left_pad_batch([ids[:-1]], self.pad_token_id)
        logits, _ = self.forward(batch, mask, positions, self.empty_past(1))
        return target_logprobs(logits[0], ids[1:])


class FusedDecoder:
    """Decoding through the serving-fused graph as the engine does it: left-aligned rows of one
    buffer of `capacity` columns, bound by pointer to both past and present, so the kernel writes
    each new token's K/V into the row itself (share-buffer) and nothing is appended here. With
    `int8`, the serving-fused-int8 graph over an int8 buffer (contract/kv_int8.py's channel format)."""

    def __init__(self, folder: Path, batch: int, capacity: int, threads: int = 0, int8: bool = False) -> None:
        self.manifest = m = Manifest.load(folder)
        fused = m.fused_attention
        if fused is None:
            raise ValueError(f"{folder}: no {SERVING_FUSED} graph in the manifest")
        self.scales = m.int8_channel_scales if int8 else None
        if int8 and self.scales is None:
            raise ValueError(f"{folder}: no {SERVING_FUSED_INT8} graph and scales in the manifest")
        path = m.verify(SERVING_FUSED_INT8 if int8 else fused.variant)
        self.session = ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])
        dtype = np.int8 if int8 else np.float32
        self.cache = np.zeros((2 * m.n_layers, batch, m.n_heads, capacity, m.head_dim), dtype=dtype)
        self.mask = np.zeros((batch, capacity + 1), dtype=np.int64)
        self.mask[:, capacity] = 1  # the fed token
        self.positions = np.zeros((batch, 1), dtype=np.int64)
        self.ids = np.zeros((batch, 1), dtype=np.int64)
        self.lengths = np.zeros(batch, dtype=np.int64)
        self.logits = np.zeros((batch, 1, m.vocab_size), dtype=np.float32)
        self.binding = self.session.io_binding()
        # A hybrid's local layers read the same full-width rows here: their mask is the rows' own.
        local_mask = ((LOCAL_ATTENTION_MASK, self.mask),) if m.local_cache else ()
        feeds = ((INPUT_IDS, self.ids), (ATTENTION_MASK, self.mask), (POSITION_IDS, self.positions), *local_mask)
        for name, array in feeds:
            self.binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        self.binding.bind_output(LOGITS, "cpu", 0, np.float32, list(self.logits.shape), self.logits.ctypes.data)
        names = zip(past_names(m.n_layers), present_names(m.n_layers), self.cache, strict=True)
        for past, present, array in names:  # array: (B, heads, capacity, head_dim), a contiguous view
            self.binding.bind_input(past, "cpu", 0, dtype, list(array.shape), array.ctypes.data)
            self.binding.bind_output(present, "cpu", 0, dtype, list(array.shape), array.ctypes.data)

    def write(self, row: int, kv: np.ndarray) -> None:
        """A prompt's cache (2 x layers, heads, length, head_dim), float32, becomes row `row`
        (quantized with the manifest's scales for the int8 graph)."""
        length = kv.shape[2]
        self.cache[:, row, :, :length] = kv if self.scales is None else quantize_channels(kv, self.scales)
        self.mask[row, :-1] = 0
        self.mask[row, :length] = 1
        self.lengths[row] = self.positions[row, 0] = length

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per row; returns the logits (B, vocab), a copy."""
        check_positions(self.positions, self.manifest.max_positions)
        self.ids[:, 0] = tokens
        self.session.run_with_iobinding(self.binding)
        self.mask[np.arange(len(self.lengths)), self.lengths] = 1
        self.lengths += 1
        self.positions += 1
        return self.logits[:, 0].copy()


class PromptGraph:
    """The fused prompt graph (prefill-fused) run plainly: S new tokens per row after P past ones, the
    whole cache (past and new) back (contract.graph's PREFILL_FUSED paragraph)."""

    def __init__(self, folder: Path, threads: int = 0) -> None:
        self.manifest = Manifest.load(folder)
        path = self.manifest.verify(PREFILL_FUSED)
        self.session = ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])

    def empty_past(self, batch: int) -> Past:
        m = self.manifest
        return [np.zeros((batch, m.n_heads, 0, m.head_dim), np.float32) for _ in past_names(m.n_layers)]

    def run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: Past) -> tuple[np.ndarray, Past]:
        """(logits (B, S, vocab), present: per layer key, value (B, heads, P + S, head_dim))."""
        check_positions(positions, self.manifest.max_positions)
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: positions}
        if self.manifest.local_cache:  # a hybrid's local layers read the same full-width past here
            feeds[LOCAL_ATTENTION_MASK] = mask
        feeds.update(zip(past_names(self.manifest.n_layers), past, strict=True))
        logits, *present = self.session.run(None, feeds)
        return logits, present
