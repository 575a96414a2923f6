"""A plain ONNX Runtime wrapper for one exported model: the offline reference loop.

Used by parity checks, evaluation and tests as "ONNX Runtime alone"; the serving engine has
its own runner. Positions beyond a bounded model's table are refused here, before ONNX
Runtime would silently index out of range.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from export.manifest import Manifest
from models.limits import check_positions

NP_DTYPES = {"float32": np.float32, "float16": np.float16}

Past = list[np.ndarray]  # per layer: key, value, key, value, ...


def left_pad_batch(sequences: list[list[int]], pad_token_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, attention_mask, position_ids), each (B, longest), padding on the left."""
    longest = max(len(s) for s in sequences)
    ids = np.full((len(sequences), longest), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(sequences), longest), dtype=np.int64)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, longest - len(seq) :] = seq
            mask[row, longest - len(seq) :] = 1
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return ids, mask, positions


def target_logprobs(logits: np.ndarray, targets: list[int]) -> np.ndarray:
    """log softmax(logits)[i, targets[i]] for logits (T, vocab), in float64."""
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    log_norm = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
    return logits[np.arange(len(targets)), targets] - log_norm


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
        self.dtype = dtype
        path = self.manifest.verify(dtype)
        self.session = ort.InferenceSession(
            str(path), session_options(threads), providers=providers or ["CPUExecutionProvider"]
        )
        self.pad_token_id = int(self.manifest.tokenizer["pad_token_id"])  # type: ignore[call-overload]

    def empty_past(self, batch: int) -> Past:
        shape = (batch, self.manifest.n_heads, 0, self.manifest.head_dim)
        return [np.zeros(shape, dtype=NP_DTYPES[self.dtype]) for _ in range(2 * self.manifest.n_layers)]

    def forward(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: Past
    ) -> tuple[np.ndarray, Past]:
        """One graph call; returns logits (B, T, vocab) and the present K/V."""
        check_positions(position_ids, self.manifest.max_positions)
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        for i in range(self.manifest.n_layers):
            feeds[f"past_key_values.{i}.key"] = past[2 * i]
            feeds[f"past_key_values.{i}.value"] = past[2 * i + 1]
        logits, *present = self.session.run(None, feeds)
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
