"""ONNX Runtime execution for one model: the only module that touches real K/V tensors.

The running sequences form one decode batch, left-padded to a common length and masked. Two
ways to keep its cache, chosen by where the model runs:

- in place (CPU, `model.serving.onnx`): the engine owns one buffer per layer,
  (B, heads, capacity, head_dim), grown in chunks; the graph reads it as it is (unused slots
  masked) and returns only the new tokens' K/V, which the engine writes into the next free
  column. Nothing proportional to the context is copied per step.
- on the device (CUDA, `model.onnx` / `model.fp16.onnx`): IO binding feeds each step's
  `present.*` outputs straight back as `past_key_values.*`, so the cache never leaves GPU
  memory; the graph's Concat runs at device bandwidth.

The batch is re-packed on the host only when its membership changes (a sequence joins after
prefill or leaves).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from export.manifest import SERVING, Manifest
from export.runtime import NP_DTYPES, left_pad_batch, target_logprobs
from models.limits import check_positions

logger = logging.getLogger(__name__)


def choose_providers(device: str) -> list[str]:
    """`auto` takes CUDA when this onnxruntime build has it, else CPU."""
    available = ort.get_available_providers()
    if device == "cuda" and "CUDAExecutionProvider" not in available:
        raise RuntimeError(f"--device cuda: this onnxruntime has no CUDA provider (has {', '.join(available)})")
    if device in ("cuda", "auto") and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


@dataclass
class RunnerTimings:
    """Seconds spent in graph calls and in host-side cache handling (writes, re-packs)."""

    graph: float = 0.0
    cache: float = 0.0


@dataclass
class PrefillChunk:
    """Prompt tokens [start, start + len(token_ids)) of one request."""

    request_id: str
    token_ids: list[int]
    start: int
    is_last: bool


class ModelRunner:
    def __init__(
        self, manifest: Manifest, device: str = "auto", threads: int = 0, growth_tokens: int = 64, in_place: bool = True
    ) -> None:
        """`in_place=False` forces the present -> past graph on the CPU too (for comparison)."""
        self.manifest = manifest
        self.providers = choose_providers(device)
        self.on_gpu = self.providers[0] == "CUDAExecutionProvider"
        variants: dict[str, object] = manifest.data["variants"]  # type: ignore[assignment]
        if self.on_gpu:
            self.variant = "float16" if "float16" in variants else "float32"
        else:
            self.variant = SERVING if in_place and SERVING in variants else "float32"
        self.in_place = self.variant == SERVING
        self.dtype = self.variant.removeprefix("serving-")
        manifest.verify_all()
        path = manifest.onnx_path(self.variant)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads or max(1, os.cpu_count() or 1)
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        # Spinning intra-op threads would take the cores the engine and gRPC threads need
        # between steps (measured: +30% single-stream tokens/s through gRPC without it).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(path), options, providers=self.providers)
        self.device_type = "cuda" if self.on_gpu else "cpu"
        self.n_layers = manifest.n_layers
        kinds = [f"{i}.{kind}" for i in range(self.n_layers) for kind in ("key", "value")]
        self.past_names = [f"past_key_values.{k}" for k in kinds]
        self.output_names = ["logits"] + [f"{'new_key_values' if self.in_place else 'present'}.{k}" for k in kinds]
        self.pad_token_id = int(manifest.tokenizer["pad_token_id"])  # type: ignore[call-overload]
        self.growth_tokens = growth_tokens
        # The decode batch: row order, mask (B, P) with 0 for padding and unused slots, cache.
        self.rows: list[str] = []
        self.mask = np.zeros((0, 0), dtype=np.int64)
        self.filled = 0  # columns in use (in place: the rest up to capacity are free slots)
        self.buffers: list[np.ndarray] = []  # in place: (B, nh, capacity, hs) per layer
        self.device_past: list[np.ndarray | ort.OrtValue] = []  # present -> past: (B, nh, P, hs) per layer
        # Caches of prompts prefilled in several chunks, until they join the batch.
        self._partial: dict[str, list[np.ndarray]] = {}
        self.timings = RunnerTimings()
        # Chaos testing only: a prompt containing these bytes makes its prefill call fail.
        marker = os.environ.get("POSENC_FAULT_INJECTION_MARKER")
        self._fault_marker = marker.encode() if marker else None

    # ------------------------------------------------------------------ graph calls

    def _run(
        self, input_ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: list[np.ndarray | ort.OrtValue]
    ) -> tuple[np.ndarray, list[np.ndarray | ort.OrtValue]]:
        """One graph call. On the CPU inputs and outputs are numpy arrays (ONNX Runtime reads
        contiguous inputs in place); on the GPU the K/V stay device OrtValues (IO binding)."""
        check_positions(positions, self.manifest.max_positions)
        started = time.perf_counter()
        if not self.on_gpu:
            feeds: dict[str, np.ndarray] = {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}
            feeds.update(zip(self.past_names, past, strict=True))  # type: ignore[arg-type]
            logits, *kv = self.session.run(self.output_names, feeds)
            self.timings.graph += time.perf_counter() - started
            return logits, kv
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(mask, dtype=np.int64))
        binding.bind_cpu_input("position_ids", np.ascontiguousarray(positions, dtype=np.int64))
        for name, value in zip(self.past_names, past, strict=True):
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, value)
            else:
                binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")
        for name in self.output_names[1:]:
            binding.bind_output(name, self.device_type)
        self.session.run_with_iobinding(binding)
        self.timings.graph += time.perf_counter() - started
        logits, *kv_values = binding.get_outputs()
        return logits.numpy().astype(np.float32), kv_values

    def _empty(self, batch: int) -> list[np.ndarray]:
        shape = (batch, self.manifest.n_heads, 0, self.manifest.head_dim)
        return [np.zeros(shape, dtype=NP_DTYPES[self.dtype]) for _ in self.past_names]

    def _to_device(self, arrays: list[np.ndarray]) -> list[np.ndarray | ort.OrtValue]:
        if not self.on_gpu:
            return [np.ascontiguousarray(a) for a in arrays]
        return [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), self.device_type, 0) for a in arrays]

    @staticmethod
    def _host(value: np.ndarray | ort.OrtValue) -> np.ndarray:
        return value if isinstance(value, np.ndarray) else value.numpy()

    def _host_cache(self) -> list[np.ndarray]:
        """The batch cache's filled columns as host arrays (B, nh, filled, hs)."""
        if self.in_place:
            return [b[:, :, : self.filled] for b in self.buffers]
        return [self._host(value) for value in self.device_past]

    # ------------------------------------------------------------------ prefill

    def prefill(self, chunks: list[PrefillChunk]) -> tuple[dict[str, np.ndarray], dict[str, Exception]]:
        """Run prompt chunks: (last-position logits of every prompt that completed, failures).

        Whole prompts are batched into one left-padded call; if that call fails, each runs
        alone so a failure stays with the prompt that caused it. A prompt split into chunks
        runs alone with its own growing cache. Completed prompts join the decode batch.
        """
        results: dict[str, np.ndarray] = {}
        failures: dict[str, Exception] = {}
        whole = [c for c in chunks if c.start == 0 and c.is_last]
        if whole:
            try:
                self._prefill_whole(whole, results)
            except Exception as batch_error:
                if len(whole) == 1:
                    failures[whole[0].request_id] = batch_error
                for chunk in whole if len(whole) > 1 else ():
                    try:
                        self._prefill_whole([chunk], results)
                    except Exception as error:
                        failures[chunk.request_id] = error
        for chunk in (c for c in chunks if not (c.start == 0 and c.is_last)):
            try:
                self._prefill_chunk(chunk, results)
            except Exception as error:
                self._partial.pop(chunk.request_id, None)
                failures[chunk.request_id] = error
        return results, failures

    def _check_fault(self, chunks: list[PrefillChunk]) -> None:
        if self._fault_marker and any(self._fault_marker in bytes(t for t in c.token_ids if t < 256) for c in chunks):
            raise RuntimeError("injected fault (POSENC_FAULT_INJECTION_MARKER)")

    def _prefill_whole(self, whole: list[PrefillChunk], results: dict[str, np.ndarray]) -> None:
        self._check_fault(whole)
        ids, mask, positions = left_pad_batch([c.token_ids for c in whole], self.pad_token_id)
        logits, kv = self._run(ids, mask, positions, self._empty(len(whole)))  # type: ignore[arg-type]
        self._join([c.request_id for c in whole], [self._host(v) for v in kv], mask)
        for row, chunk in enumerate(whole):
            results[chunk.request_id] = logits[row, -1]

    def _prefill_chunk(self, chunk: PrefillChunk, results: dict[str, np.ndarray]) -> None:
        self._check_fault([chunk])
        past = self._partial.pop(chunk.request_id, None) or self._empty(1)
        length = past[0].shape[2]
        assert length == chunk.start, (length, chunk.start)
        total = length + len(chunk.token_ids)
        ids = np.asarray([chunk.token_ids], dtype=np.int64)
        mask = np.ones((1, total), dtype=np.int64)
        positions = np.arange(length, total, dtype=np.int64)[None]
        logits, kv = self._run(ids, mask, positions, past)  # type: ignore[arg-type]
        arrays = [self._host(v) for v in kv]
        if self.in_place:  # new tokens only: extend the partial cache
            arrays = [np.concatenate([old, new], axis=2) for old, new in zip(past, arrays, strict=True)]
        if chunk.is_last:
            self._join([chunk.request_id], arrays, mask)
            results[chunk.request_id] = logits[0, -1]
        else:
            self._partial[chunk.request_id] = arrays

    # ------------------------------------------------------------------ decode

    def decode(self, next_tokens: dict[str, int]) -> dict[str, np.ndarray]:
        """One step for every row of the batch; `next_tokens` has one token per row."""
        if not self.rows:
            return {}
        batch = len(self.rows)
        ids = np.asarray([[next_tokens[r]] for r in self.rows], dtype=np.int64)  # (B, 1)
        positions = self.mask.sum(axis=1, keepdims=True)  # real tokens so far = the new position
        if self.in_place:
            if self.filled == self.mask.shape[1]:
                self._repack(self._host_cache(), self.mask, self.filled + 1)
            mask = np.concatenate([self.mask, np.ones((batch, 1), dtype=np.int64)], axis=1)  # (B, capacity + 1)
            logits, new = self._run(ids, mask, positions, self.buffers)  # type: ignore[arg-type]
            started = time.perf_counter()
            for buffer, value in zip(self.buffers, new, strict=True):
                buffer[:, :, self.filled] = self._host(value)[:, :, 0]
            self.mask[:, self.filled] = 1
            self.filled += 1
            self.timings.cache += time.perf_counter() - started
        else:
            mask = np.concatenate([self.mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
            logits, self.device_past = self._run(ids, mask, positions, self.device_past)  # type: ignore[arg-type]
            self.mask = mask
            self.filled += 1
        return {row: logits[i, -1] for i, row in enumerate(self.rows)}

    # ------------------------------------------------------------------ batch membership

    def _join(self, request_ids: list[str], arrays: list[np.ndarray], mask: np.ndarray) -> None:
        """Add prefilled rows; old and new caches are right-aligned at a common length."""
        if not self.rows:
            self.rows = list(request_ids)
            self._repack(arrays, mask, mask.shape[1] + 1)
            return
        old_cache, old_mask = self._host_cache(), self.mask[:, : self.filled]
        length = max(self.filled, mask.shape[1])

        def pad(a: np.ndarray, axis: int) -> np.ndarray:
            widths = [(0, 0)] * a.ndim
            widths[axis] = (length - a.shape[axis], 0)
            return np.pad(a, widths)

        cache = [np.concatenate([pad(o, 2), pad(n, 2)], axis=0) for o, n in zip(old_cache, arrays, strict=True)]
        self.rows = self.rows + list(request_ids)
        self._repack(cache, np.concatenate([pad(old_mask, 1), pad(mask, 1)], axis=0), length + 1)

    def _repack(self, cache: list[np.ndarray], mask: np.ndarray, needed: int) -> None:
        """Store (B, nh, L, hs) caches with mask (B, L) as the batch, room for `needed` columns."""
        started = time.perf_counter()
        try:
            self._store(cache, mask, needed)
        finally:
            self.timings.cache += time.perf_counter() - started

    def _store(self, cache: list[np.ndarray], mask: np.ndarray, needed: int) -> None:
        length = mask.shape[1]
        self.filled = length
        if not self.in_place:
            self.mask = np.ascontiguousarray(mask)
            self.device_past = self._to_device(cache)
            return
        capacity = -(-needed // self.growth_tokens) * self.growth_tokens
        batch = mask.shape[0]
        self.mask = np.zeros((batch, capacity), dtype=np.int64)
        self.mask[:, :length] = mask
        self.buffers = []
        for layer in cache:
            buffer = np.zeros((batch, layer.shape[1], capacity, layer.shape[3]), dtype=layer.dtype)
            buffer[:, :, :length] = layer
            self.buffers.append(buffer)

    def remove(self, request_ids: set[str]) -> None:
        """Drop finished or cancelled sequences (and any partial prefill) from the batch."""
        for request_id in request_ids:
            self._partial.pop(request_id, None)
        keep = [i for i, row in enumerate(self.rows) if row not in request_ids]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.mask, self.filled, self.buffers, self.device_past = np.zeros((0, 0), dtype=np.int64), 0, [], []
            return
        mask = self.mask[keep, : self.filled]
        first_real = int(np.argmax(mask.any(axis=0)))  # columns of padding in every row go
        cache = [layer[keep][:, :, first_real:] for layer in self._host_cache()]
        self._repack(cache, mask[:, first_real:], self.filled - first_real + 1)

    @property
    def cache_slots(self) -> int:
        """Token slots the batch cache physically occupies (rows x capacity)."""
        return int(self.mask.size)

    # ------------------------------------------------------------------ scoring

    def score(self, token_ids: list[int]) -> np.ndarray:
        """Teacher-forced log-probabilities of token_ids[1:] (one call, outside the batch)."""
        ids = np.asarray([token_ids[:-1]], dtype=np.int64)
        mask = np.ones_like(ids)
        positions = np.arange(ids.shape[1], dtype=np.int64)[None]
        logits, _ = self._run(ids, mask, positions, self._empty(1))  # type: ignore[arg-type]
        return target_logprobs(logits[0], token_ids[1:])
