"""ONNX Runtime execution for one model: the only module that touches real K/V tensors.

The running sequences form one decode batch, left-padded to a common length and masked. Two
ways to keep its cache, chosen by where the model runs:

- in place (CPU, `model.serving.onnx`): the engine owns one array holding every layer's K
  and V, (2 x layers, B, heads, capacity, head_dim), grown in chunks; the graph reads each
  layer's slice as it is (unused slots masked) and returns only the new tokens' K/V, which
  the engine writes into the next free column with one copy. Nothing proportional to the
  context is copied per step.
- on the device (CUDA, `model.onnx` / `model.fp16.onnx`): IO binding feeds each step's
  `present.*` outputs straight back as `past_key_values.*`, so the cache never leaves GPU
  memory; the graph's Concat runs at device bandwidth.

Prompts run in a second ONNX Runtime session (the prefill worker's, in its own thread) and
touch no batch state; their caches join the batch on the engine thread. The batch is re-packed
on the host only when its membership changes (a sequence joins or leaves).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
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


def default_threads() -> int:
    """Intra-op threads of the decode session: half the cores (the prefill session gets them all,
    at a lower priority, see PrefillWorker)."""
    return max(1, (os.cpu_count() or 2) // 2)


@dataclass
class RunnerTimings:
    """Seconds spent in decode graph calls and in host-side cache handling (writes, re-packs)."""

    graph: float = 0.0
    cache: float = 0.0


@dataclass
class PrefilledPrompt:
    """A computed prompt, ready to join the batch: last-position logits and its K/V per layer."""

    request_id: str
    logits: np.ndarray  # (vocab,)
    cache: list[np.ndarray]  # (1, heads, length, head_dim) per layer and kind, host memory


class ModelRunner:
    def __init__(
        self,
        manifest: Manifest,
        device: str = "auto",
        threads: int = 0,
        growth_tokens: int = 32,
        in_place: bool = True,
        open_prefill_session: bool = True,
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
        self.threads = threads or default_threads()
        self.prefill_threads = threads or os.cpu_count() or 1
        self.session = self._session(self.threads, arena=True)  # the decode batch (engine thread)
        # Prompts and scoring (prefill worker, gRPC threads); the worker opens its own on its thread.
        self.prefill_session: ort.InferenceSession | None = None
        if open_prefill_session:
            self.open_prefill_session()

        self.device_type = "cuda" if self.on_gpu else "cpu"
        self.n_layers = manifest.n_layers
        kinds = [f"{i}.{kind}" for i in range(self.n_layers) for kind in ("key", "value")]
        self.past_names = [f"past_key_values.{k}" for k in kinds]
        self.output_names = ["logits"] + [f"{'new_key_values' if self.in_place else 'present'}.{k}" for k in kinds]
        self.pad_token_id = int(manifest.tokenizer["pad_token_id"])  # type: ignore[call-overload]
        self.growth_tokens = growth_tokens
        # The decode batch. mask: (B, capacity + 1) in place (the last column is the token fed
        # this step, always 1), (B, filled) otherwise; 0 marks padding and unused slots.
        self.rows: list[str] = []
        self.mask = np.zeros((0, 1), dtype=np.int64)
        self.positions = np.zeros((0, 1), dtype=np.int64)  # (B, 1): the next position per row
        self.filled = 0  # columns in use (in place: the rest up to capacity are free slots)
        # In place: every layer's K and V in one array, (2 x layers, B, nh, capacity, hs), so a
        # step's new column (and a join or a leave) is one copy; the graph reads its per-layer views.
        self.cache = self._empty_cache()
        self.device_past: list[np.ndarray | ort.OrtValue] = []  # present -> past: (B, nh, P, hs) per layer
        self.timings = RunnerTimings()
        self._binding: ort.IOBinding | None = None  # the in-place decode call, bound (see _bound_step)
        self._bound_rows = 0
        self._ids = np.zeros((0, 1), dtype=np.int64)
        self._logits = np.zeros((0, 1, 0), dtype=np.float32)
        self._new_kv = np.zeros((0,), dtype=NP_DTYPES[self.dtype])  # (2 x layers, B, nh, 1, hs), bound outputs
        # Chaos testing only: a prompt containing these bytes makes its prefill call fail.
        marker = os.environ.get("POSENC_FAULT_INJECTION_MARKER")
        self._fault_marker = marker.encode() if marker else None

    def open_prefill_session(self) -> None:
        """(Re)create the prompt session from the calling thread: ONNX Runtime's pool threads
        inherit that thread's OS priority."""
        self.prefill_session = self._session(self.prefill_threads, arena=False)

    def _session(self, threads: int, arena: bool) -> ort.InferenceSession:
        """`arena=False` for prompts: their intermediates grow with batch x length^2, and an arena
        would hold its all-time peak resident (a 10-minute soak grew 21% that way); without one they
        go back to the OS after each call, for 1.6x the prefill time of a 2048-token prompt."""
        options = ort.SessionOptions()
        options.enable_cpu_mem_arena = arena
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        # Spinning intra-op threads would take the cores the other session, the engine and the
        # gRPC threads need between calls (measured: +30% single-stream tokens/s without it).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        path = self.manifest.onnx_path(self.variant)
        return ort.InferenceSession(str(path), options, providers=self.providers)

    # ------------------------------------------------------------------ graph calls

    def _run(
        self,
        session: ort.InferenceSession,
        input_ids: np.ndarray,
        mask: np.ndarray,
        positions: np.ndarray,
        past: list[np.ndarray | ort.OrtValue],
    ) -> tuple[np.ndarray, list[np.ndarray | ort.OrtValue]]:
        """One graph call. On the CPU inputs and outputs are numpy arrays (ONNX Runtime reads
        contiguous inputs in place); on the GPU the K/V stay device OrtValues (IO binding)."""
        check_positions(positions, self.manifest.max_positions)
        if not self.on_gpu:
            feeds: dict[str, np.ndarray] = {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}
            feeds.update(zip(self.past_names, past, strict=True))  # type: ignore[arg-type]
            logits, *kv = session.run(self.output_names, feeds)
            return logits, kv
        binding = session.io_binding()
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
        session.run_with_iobinding(binding)
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

    # ------------------------------------------------------------------ prefill (any thread)

    def _check_fault(self, prompts: list[list[int]]) -> None:
        if self._fault_marker and any(self._fault_marker in bytes(t for t in ids if t < 256) for ids in prompts):
            raise RuntimeError("injected fault (POSENC_FAULT_INJECTION_MARKER)")

    def prefill_batch(self, prompts: dict[str, list[int]]) -> list[PrefilledPrompt]:
        """Whole prompts in one left-padded call; each row's cache comes back without padding."""
        self._check_fault(list(prompts.values()))
        ids, mask, positions = left_pad_batch(list(prompts.values()), self.pad_token_id)
        logits, kv = self._run(self.prefill_session, ids, mask, positions, self._empty(len(prompts)))  # type: ignore[arg-type]
        arrays = [self._host(v) for v in kv]
        width = ids.shape[1]
        return [
            PrefilledPrompt(rid, logits[row, -1], [a[row : row + 1, :, width - len(p) :] for a in arrays])
            for row, (rid, p) in enumerate(prompts.items())
        ]

    def prefill_chunks(
        self, request_id: str, token_ids: list[int], chunk_tokens: int
    ) -> Iterator[PrefilledPrompt | None]:
        """A long prompt in chunks of `chunk_tokens` (bounding the score tensors), each chunk
        attending to the cache of the ones before. Yields None after every chunk but the last,
        so the caller can interleave other work or give up between chunks."""
        self._check_fault([token_ids])
        past = self._empty(1)
        for start in range(0, len(token_ids), chunk_tokens):
            chunk = token_ids[start : start + chunk_tokens]
            end = start + len(chunk)
            ids = np.asarray([chunk], dtype=np.int64)
            mask = np.ones((1, end), dtype=np.int64)
            positions = np.arange(start, end, dtype=np.int64)[None]
            logits, kv = self._run(self.prefill_session, ids, mask, positions, past)  # type: ignore[arg-type]
            arrays = [self._host(v) for v in kv]
            if self.in_place:  # new tokens only: extend the cache
                arrays = [np.concatenate([old, new], axis=2) for old, new in zip(past, arrays, strict=True)]
            past = arrays
            yield PrefilledPrompt(request_id, logits[0, -1], past) if end == len(token_ids) else None

    def prefill_chunked(
        self, request_id: str, token_ids: list[int], chunk_tokens: int, aborted: Callable[[], bool] = lambda: False
    ) -> PrefilledPrompt | None:
        """All chunks of a prompt at once; None if `aborted()` turns true in between."""
        for result in self.prefill_chunks(request_id, token_ids, chunk_tokens):
            if result is not None:
                return result
            if aborted():
                return None
        raise ValueError("prefill_chunked: empty prompt")

    # ------------------------------------------------------------------ decode (engine thread)

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        """One step for every row of the batch; tokens (B,) in `rows` order -> logits (B, vocab)."""
        batch = len(self.rows)
        if not batch:
            return np.zeros((0, 0), dtype=np.float32)
        started = time.perf_counter()
        if self.in_place:
            if self.filled == self.mask.shape[1] - 1:  # no free column: grow
                self._rebuild(self.filled)
            binding = self._bound_step(batch)
            self._ids[:, 0] = tokens
            check_positions(self.positions[:batch], self.manifest.max_positions)
            self.session.run_with_iobinding(binding)
            after_graph = time.perf_counter()
            column = self.filled
            self.cache[:, :batch, :, column] = self._new_kv[:, :, :, 0]
            self.mask[:batch, column] = 1
            self.filled += 1
            self.timings.cache += time.perf_counter() - after_graph
            logits = self._logits.copy()  # the bound array is overwritten next step
        else:
            ids = tokens.reshape(-1, 1).astype(np.int64, copy=False)
            mask = np.concatenate([self.mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
            logits, self.device_past = self._run(self.session, ids, mask, self.positions, self.device_past)  # type: ignore[arg-type]
            after_graph = time.perf_counter()
            self.mask = mask
            self.filled += 1
        self.timings.graph += after_graph - started
        self.positions[:batch] += 1
        return logits[:, -1]

    def _bound_step(self, batch: int) -> ort.IOBinding:
        """The decode call's inputs and outputs bound once to host arrays we own (the leading
        `batch` rows of the buffers, mask and positions; preallocated outputs), so a step is one
        `run_with_iobinding` with no per-step conversions. Re-made when the batch or buffers change."""
        if self._binding is not None and self._bound_rows == batch:
            return self._binding
        binding = self.session.io_binding()

        def bind(name: str, array: np.ndarray, output: bool = False) -> None:
            assert array.flags.c_contiguous, name
            bind_fn = binding.bind_output if output else binding.bind_input
            bind_fn(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

        self._ids = np.zeros((batch, 1), dtype=np.int64)
        bind("input_ids", self._ids)
        bind("attention_mask", self.mask[:batch])
        bind("position_ids", self.positions[:batch])
        for name, layer in zip(self.past_names, self.cache, strict=True):
            bind(name, layer[:batch])
        self._logits = np.zeros((batch, 1, self.manifest.vocab_size), dtype=np.float32)
        bind("logits", self._logits, output=True)
        heads, head_dim = self.manifest.n_heads, self.manifest.head_dim
        self._new_kv = np.zeros((len(self.past_names), batch, heads, 1, head_dim), dtype=NP_DTYPES[self.dtype])
        for name, array in zip(self.output_names[1:], self._new_kv, strict=True):
            bind(name, array, output=True)
        self._binding, self._bound_rows = binding, batch
        return binding

    # ------------------------------------------------------------------ batch membership

    def join(self, prompts: list[PrefilledPrompt]) -> None:
        """Add prefilled rows, right-aligned at the batch's filled length.

        In place, a newcomer is written into a spare row of the buffers (O(its own cache));
        the buffers are re-allocated only when rows or columns run out or the newcomer is
        longer than the batch so far.
        """
        if not prompts:
            return
        if not self.in_place:
            self._join_concatenated(prompts)
            return
        started = time.perf_counter()
        longest = max(p.cache[0].shape[2] for p in prompts)
        batch = len(self.rows)
        if batch + len(prompts) > self.cache.shape[1] or longest > self.filled:
            self._rebuild(max(self.filled, longest), extra_rows=len(prompts))
        end = self.filled
        for row, prompt in enumerate(prompts, start=batch):
            length = prompt.cache[0].shape[2]
            for buffer, layer in zip(self.cache, prompt.cache, strict=True):
                buffer[row, :, end - length : end] = layer[0]
            self.mask[row, :-1] = 0
            self.mask[row, end - length : end] = 1
            self.positions[row] = length
        self.rows = self.rows + [p.request_id for p in prompts]
        self.timings.cache += time.perf_counter() - started

    def remove(self, request_ids: set[str]) -> None:
        """Drop finished, cancelled or preempted sequences from the batch.

        In place, the last row moves into each hole (O(one row)); columns of padding left in
        every row are trimmed, and spare rows released, only once they are a large share.
        """
        holes = [i for i, row in enumerate(self.rows) if row in request_ids]
        if not holes:
            return
        if not self.in_place:
            self._remove_concatenated(set(holes))
            return
        started = time.perf_counter()
        for hole in reversed(holes):  # descending: a moved row never lands in a later hole
            last = len(self.rows) - 1
            if hole != last:
                self.cache[:, hole] = self.cache[:, last]
                self.mask[hole] = self.mask[last]
                self.positions[hole] = self.positions[last]
                self.rows[hole] = self.rows[last]
            self.rows.pop()
        batch = len(self.rows)
        if not batch:
            self._reset()
        else:
            first_real = int(np.argmax(self.mask[:batch, : self.filled].any(axis=0)))
            if first_real > max(self.growth_tokens, self.filled // 2) or self.cache.shape[1] > 2 * batch + 8:
                self._rebuild(self.filled - first_real)
        self.timings.cache += time.perf_counter() - started

    def _rebuild(self, length: int, extra_rows: int = 0) -> None:
        """Re-allocate the in-place buffers with the active rows right-aligned at `length`
        columns (dropping leading columns if shorter), room for `extra_rows` more rows and
        headroom to grow (a quarter more rows; an eighth more columns, at least `growth_tokens`).

        Spare columns are read by every step, while a re-allocation copies the whole cache (one
        copy of the single array: 1.6 ms at batch 16 and 150 tokens, against 4.2 ms with one
        array per layer). From 100 to 612 tokens, batch 1 and 16, `growth_tokens` from 16 to 128
        made no measurable difference."""
        batch = len(self.rows)
        rows = batch + extra_rows
        columns = length + max(self.growth_tokens, length // 8)
        columns = -(-columns // self.growth_tokens) * self.growth_tokens
        keep = min(length, self.filled)
        heads, head_dim = self.manifest.n_heads, self.manifest.head_dim
        dtype = NP_DTYPES[self.dtype]
        capacity_rows = rows + max(1, rows // 4)
        cache = np.zeros((len(self.past_names), capacity_rows, heads, columns, head_dim), dtype=dtype)
        mask = np.zeros((capacity_rows, columns + 1), dtype=np.int64)
        mask[:, -1] = 1
        positions = np.zeros((capacity_rows, 1), dtype=np.int64)
        if batch:
            cache[:, :batch, :, length - keep : length] = self.cache[:, :batch, :, self.filled - keep : self.filled]
            mask[:batch, length - keep : length] = self.mask[:batch, self.filled - keep : self.filled]
            positions[:batch] = self.positions[:batch]
        self.cache = cache
        self.mask, self.positions, self.filled = mask, positions, length
        self._binding = None

    def _empty_cache(self) -> np.ndarray:
        shape = (len(self.past_names), 0, self.manifest.n_heads, 0, self.manifest.head_dim)
        return np.zeros(shape, dtype=NP_DTYPES[self.dtype])

    def _reset(self) -> None:
        self._binding = None
        self.rows, self.filled, self.device_past = [], 0, []
        self.cache = self._empty_cache()
        self.mask, self.positions = np.zeros((0, 1), dtype=np.int64), np.zeros((0, 1), dtype=np.int64)

    # The present -> past layout (CUDA, or for comparison): the cache is re-packed on changes.

    def _join_concatenated(self, prompts: list[PrefilledPrompt]) -> None:
        started = time.perf_counter()
        length = max([self.filled] + [p.cache[0].shape[2] for p in prompts])

        def pad(a: np.ndarray, axis: int) -> np.ndarray:
            widths = [(0, 0)] * a.ndim
            widths[axis] = (length - a.shape[axis], 0)
            return np.pad(a, widths)

        parts = [[pad(a, 2) for a in p.cache] for p in prompts]
        masks = [pad(np.ones((1, p.cache[0].shape[2]), dtype=np.int64), 1) for p in prompts]
        if self.rows:
            parts.insert(0, [pad(self._host(v), 2) for v in self.device_past])
            masks.insert(0, pad(self.mask, 1))
        self.rows = self.rows + [p.request_id for p in prompts]
        self._store_concatenated([np.concatenate(layer, axis=0) for layer in zip(*parts, strict=True)], masks)
        self.timings.cache += time.perf_counter() - started

    def _remove_concatenated(self, holes: set[int]) -> None:
        started = time.perf_counter()
        keep = [i for i in range(len(self.rows)) if i not in holes]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._reset()
            return
        mask = self.mask[keep]
        first_real = int(np.argmax(mask.any(axis=0)))  # columns of padding in every row go
        cache = [self._host(v)[keep][:, :, first_real:] for v in self.device_past]
        self._store_concatenated(cache, [mask[:, first_real:]])
        self.timings.cache += time.perf_counter() - started

    def _store_concatenated(self, cache: list[np.ndarray], masks: list[np.ndarray]) -> None:
        self.mask = np.ascontiguousarray(np.concatenate(masks, axis=0))
        self.filled = self.mask.shape[1]
        self.positions = self.mask.sum(axis=1, keepdims=True)  # real tokens so far = the next position
        self.device_past = self._to_device(cache)

    @property
    def cache_slots(self) -> int:
        """Token slots the batch cache physically occupies (allocated rows x columns)."""
        if not self.rows:
            return 0
        if self.in_place:
            return self.cache.shape[1] * self.cache.shape[3]
        return len(self.rows) * self.filled

    # ------------------------------------------------------------------ scoring (any thread)

    def score(self, token_ids: list[int]) -> np.ndarray:
        """Teacher-forced log-probabilities of token_ids[1:] (one call, outside the batch)."""
        ids = np.asarray([token_ids[:-1]], dtype=np.int64)
        mask = np.ones_like(ids)
        positions = np.arange(ids.shape[1], dtype=np.int64)[None]
        logits, _ = self._run(self.prefill_session, ids, mask, positions, self._empty(1))  # type: ignore[arg-type]
        return target_logprobs(logits[0], token_ids[1:])
