"""ONNX Runtime sessions whose graph calls are bound to the KV store's backend arrays by data pointer.

The arrays are numpy on the CPU and torch tensors on CUDA (or on the CPU, to run the GPU path's code
in CI). `ModelSession` is one ONNX Runtime session and its IO binding. A model decodes through one
serving graph per storage kind of its rows (`cache_graphs`), and full float rows through the fused
graph where it is exported and allowed (`fused_graph`); prompts through the fused prompt graph where
it is exported and allowed (`prompt_graph`). `GraphBinder` knows how the graphs are fed:
the token inputs, the past cache arrays of a class (`CacheGraph`) and freshly allocated outputs for
the logits and the new tokens' K/V, or, for the fused graph, the cache arrays bound as past and
present alike.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

from contract.graph import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOCAL_ATTENTION_MASK,
    LOGITS,
    POSITION_IDS,
    cache_input_names,
    layer_kv_names,
    new_kv_names,
    present_names,
)
from contract.manifest import (
    NP_DTYPES,
    PREFILL_FUSED,
    PREFILL_UP_PROJECTED,
    FusedAttention,
    LocalCache,
    Manifest,
    serving_variant,
)
from service.engine.kv import INT8, INT8_CHANNEL, Array, Backend, KVLayout, serving_layout
from service.engine.kv.spec import fused_float
from service.engine.worker import denormals
from service.engine.worker.denormals import flush_denormals_on_this_thread

ORT_DTYPES = {**NP_DTYPES, "int64": np.int64, "int8": np.int8}
# How decode attends: the fused graph where exported and the rows allow it, only it (refusing a
# model without it), or always the explicit serving graph.
ATTENTION_MODES = ("auto", "fused", "explicit")


@functools.cache
def ort_element_type(dtype: object) -> type:
    """The element type ONNX Runtime binds for a numpy or torch dtype, keyed by the dtype itself:
    str() of a numpy dtype is slow next to a cache lookup, and a decode call binds every cache array."""
    return ORT_DTYPES[str(dtype).removeprefix("torch.")]


def choose_providers(device: str) -> list[str]:
    """`auto` takes CUDA when this onnxruntime build has it, else CPU."""
    available = ort.get_available_providers()
    if device == "cuda" and "CUDAExecutionProvider" not in available:
        raise RuntimeError(f"--device cuda: this onnxruntime has no CUDA provider (has {', '.join(available)})")
    if device in ("cuda", "auto") and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


# Run options that shrink the CPU arena at the end of the call (its regions no tensor uses are freed).
_RELEASE_ARENA = ort.RunOptions()
_RELEASE_ARENA.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")


def default_threads() -> int:
    """Intra-op threads of the decode session: half the cores (the prefill session gets them all,
    at a lower priority, see PrefillWorker)."""
    return max(1, (os.cpu_count() or 2) // 2)


class ModelSession:
    """One ONNX Runtime session whose calls are bound to backend arrays by pointer."""

    def __init__(self, path: str, providers: list[str], threads: int, arena: bool, backend: Backend) -> None:
        options = ort.SessionOptions()
        # arena=False for the row-streaming prompt calls: their intermediates grow with batch x
        # length^2 and an arena would hold their all-time peak resident. The prefill worker's session
        # keeps one and is released when idle (PromptSessions.release).
        options.enable_cpu_mem_arena = arena
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        # Spinning intra-op threads would take the cores the other session, the engine and the
        # gRPC threads need between calls, which costs single-stream tokens/s.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # On the pool threads; the calling threads set their own (service.engine.worker.denormals).
        if denormals.enabled():
            options.add_session_config_entry("session.set_denormal_as_zero", "1")
        self.session = ort.InferenceSession(path, options, providers=providers)
        self.backend = backend
        # onnxruntime's Python IOBinding resolves the device by name on every bind (a decode call
        # binds every cache array, re-made whenever a class's membership changes) and
        # run_with_iobinding checks for WebGPU graph capture on every call: their C bindings
        # (onnxruntime==1.31.1, pinned) take the device resolved once, so re-making a class's
        # call costs far less (with `ort_element_type`).
        self._device = OrtDevice.make(backend.device_type, backend.device_id)._get_c_device()
        self._run = self.session._sess.run_with_iobinding

    def bind(self, inputs: dict[str, Array], outputs: dict[str, Array]) -> ort.IOBinding:
        binding = self.session.io_binding()
        self.rebind(binding, inputs, outputs)
        return binding

    def rebind(self, binding: ort.IOBinding, inputs: dict[str, Array], outputs: dict[str, Array]) -> None:
        """Bind these names of an existing binding anew (a shape or pointer that changed); the rest
        stay bound as they were."""
        raw, device, pointer = binding._iobinding, self._device, self.backend.pointer
        for names, bind_fn in ((inputs, raw.bind_input), (outputs, raw.bind_output)):
            for name, array in names.items():
                bind_fn(name, device, ort_element_type(array.dtype), list(array.shape), pointer(array))

    def run(self, binding: ort.IOBinding, release_arena: bool = False) -> None:
        """One call; `release_arena`: free the arena's unused regions after it."""
        flush_denormals_on_this_thread()
        self.backend.synchronize()
        self._run(binding._iobinding, _RELEASE_ARENA if release_arena else None)


@dataclass(frozen=True)
class LocalPast:
    """A split layout's local columns as a fused graph call takes them (contract.manifest.LocalCache):
    `mask` (B, local past + new), `cache` (2 x local layers, B, heads, N, hd) bound as past (and as
    present, unless `present` is a new array for past and new)."""

    mask: Array
    cache: Array
    present: Array | None = None


@dataclass(frozen=True)
class CacheGraph:
    """The serving graph that reads classes of one storage kind, and how their arrays feed it."""

    variant: str
    dtype: str  # of its activations and outputs (logits, new K/V)
    cache_names: list[list[str]]  # input names per cache array of the class (K/V; INT8: also scales)


def cache_graphs(manifest: Manifest, layout: KVLayout, int8: bool = True) -> dict[str, CacheGraph]:
    """The graph of each storage kind the layout's rows may have (StorageSpec: its variant, activations
    and cache inputs): the float serving graph, serving-int8 when exported (and `int8`), and where the
    layout has channel scales serving-fused-int8 (its rows are bound in place, past and present alike)."""
    kinds = [layout.dtype]
    if manifest.has_int8_cache and int8:
        kinds.append(INT8)
    if layout.channel_scales is not None:
        kinds.append(INT8_CHANNEL)
    graphs = {}
    for kind in kinds:
        rows = layout.storage(kind)
        names = cache_input_names(manifest.n_layers, int8=rows.scaled, entries=layout.entries)
        graphs[kind] = CacheGraph(rows.variant, rows.activations, names)
    return graphs


def int8_channel_scales(manifest: Manifest, dtype: str, attention: str, on_gpu: bool) -> np.ndarray | None:
    """The model's per-channel int8 scales where its unbounded int8 rows are read inside the fused
    kernel: exported, float32 serving on the CPU (the kernel this was measured and tested with; CUDA's
    quantized-cache path is not yet), and `attention` not `explicit` (None: they are INT8 rows)."""
    if not fused_float(dtype) or attention == "explicit" or on_gpu:
        return None
    return manifest.int8_channel_scales


def split_cache(manifest: Manifest, fused: FusedAttention | None, prompt_variant: str | None) -> LocalCache | None:
    """A hybrid's local layers' K/V kept apart, bounded by their window (service/engine/kv/local.py):
    where its export declares it and both fused graphs serve (they are the graphs that read the local
    columns; the traced graphs read every layer at full width, so without them rows stay whole)."""
    local = manifest.local_cache
    if local is None or fused is None or prompt_variant is None:
        return None
    return local if {fused.variant, prompt_variant} <= set(local.variants) else None


@dataclass(frozen=True)
class ServingPlan:
    """How a runner serves a model, settled from its manifest and the flags alone: the runner builds
    from it, and the startup budget check (store_size.check_kv_budget) reads the store's real layout
    from it before any session opens."""

    providers: list[str]
    dtype: str
    fused: FusedAttention | None  # the fused decode graph, where exported and allowed
    prompt_variant: str | None  # the fused prompt graph's variant, likewise
    local_cache: LocalCache | None  # a hybrid's local layers kept apart (split rows)
    channel_scales: np.ndarray | None  # int8-channel rows' fixed scales (int8_channel_scales)
    layout: KVLayout

    @property
    def on_gpu(self) -> bool:
        return self.providers[0] == "CUDAExecutionProvider"


def serving_plan(manifest: Manifest, device: str, attention: str, block_size: int) -> ServingPlan:
    """The plan for serving `manifest` on `device` with `attention` (see ServingPlan)."""
    providers = choose_providers(device)
    on_gpu = providers[0] == "CUDAExecutionProvider"
    variants: dict[str, object] = manifest.data["variants"]  # type: ignore[assignment]
    dtype = "float16" if on_gpu and serving_variant("float16") in variants else "float32"
    fused = fused_graph(manifest, dtype, attention)
    prompt_variant = prompt_graph(manifest, dtype, attention)
    local = split_cache(manifest, fused, prompt_variant)
    # Split rows are float rows the fused graphs read: no int8-channel rows beside them.
    scales = None if local else int8_channel_scales(manifest, dtype, attention, on_gpu)
    layout = serving_layout(manifest, dtype, scales, local, block_size)
    return ServingPlan(providers, dtype, fused, prompt_variant, local, scales, layout)


def fused_graph(manifest: Manifest, dtype: str, attention: str) -> FusedAttention | None:
    """The fused decode graph for full `dtype` rows, where exported and `attention` allows it."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {attention!r}")
    fused = manifest.fused_attention
    usable = fused if fused is not None and fused.dtype == dtype and fused.shares_cache_buffer else None
    if attention == "fused" and usable is None:
        raise ValueError(f"--attention fused: model {manifest.name!r} has no fused {dtype} decode graph")
    return None if attention == "explicit" else usable


def prompt_graph(manifest: Manifest, dtype: str, attention: str) -> str | None:
    """The fused prompt graph's variant for `dtype` prompts, where exported and `attention` allows it
    (it is float32, and `explicit` keeps every call on the explicit serving graph)."""
    exported = PREFILL_FUSED in manifest.data["variants"]  # type: ignore[operator]
    return PREFILL_FUSED if exported and fused_float(dtype) and attention != "explicit" else None


def serving_prompt_graph(manifest: Manifest, dtype: str) -> str:
    """The graph of the serving contract that prompts run through where no fused prompt graph takes
    them: the attention's own prompt form where it has one (latent attention's up-projected
    prefill-up-projected, float32), else the serving graph of `dtype`."""
    up_projected = PREFILL_UP_PROJECTED in manifest.data["variants"]  # type: ignore[operator]
    return PREFILL_UP_PROJECTED if up_projected and fused_float(dtype) else serving_variant(dtype)


class GraphBinder:
    """Binds a model's graph calls to arrays of one backend: the inputs and past caches it is given,
    and new output arrays it allocates."""

    def __init__(self, backend: Backend, layout: KVLayout, vocab_size: int, graphs: dict[str, CacheGraph]) -> None:
        self.backend, self.layout, self.vocab_size, self.graphs = backend, layout, vocab_size, graphs
        self.new_names = new_kv_names(layout.n_layers, layout.entries)
        # The fused graphs' cache names: a split layout's global layers' here, its local layers' apart.
        n, entries = layout.per_layer, layout.entries
        past, present = cache_input_names(layout.n_layers, entries=entries)[0], present_names(layout.n_layers, entries)
        self.fused_cache_names = layer_kv_names(past, layout.global_layers, n)
        self.present_names = layer_kv_names(present, layout.global_layers, n)
        local_layers = layout.local.layers if layout.local else ()
        self.local_cache_names = layer_kv_names(past, local_layers, n)
        self.local_present_names = layer_kv_names(present, local_layers, n)

    def _local(self, inputs: dict[str, Array], outputs: dict[str, Array], local: LocalPast | None) -> None:
        """A split layout's local past (and present: the same buffer, or `local.present`) and mask."""
        if local is None:
            return
        inputs[LOCAL_ATTENTION_MASK] = local.mask
        inputs.update(zip(self.local_cache_names, local.cache, strict=True))
        present = local.cache if local.present is None else local.present
        outputs.update(zip(self.local_present_names, present, strict=True))

    def bind(
        self, session: ModelSession, ids: Array, mask: Array, positions: Array, past: list[Array], kind: str
    ) -> tuple[ort.IOBinding, Array, Array]:
        """A graph call bound to these inputs (`past`: the cache arrays of a `kind` class, each
        (2L, B, heads, P, hd or 1)) and to new output arrays for logits (B, T, vocab) and the new
        tokens' K/V (2L, B, heads, T, hd)."""
        layout, batch, width, graph = self.layout, ids.shape[0], ids.shape[1], self.graphs[kind]
        new_kv = self.backend.zeros((layout.tensors, batch, layout.n_heads, width, layout.head_dim), graph.dtype)
        logits = self.backend.zeros((batch, width, self.vocab_size), graph.dtype)
        inputs = {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: positions}
        for names, array in zip(graph.cache_names, past, strict=True):
            inputs.update(zip(names, array, strict=True))
        outputs = {LOGITS: logits, **dict(zip(self.new_names, new_kv, strict=True))}
        return session.bind(inputs, outputs), logits, new_kv

    def bind_in_place(
        self, session: ModelSession, ids: Array, mask: Array, positions: Array, cache: Array,
        local: LocalPast | None = None,
    ) -> tuple[ort.IOBinding, Array]:  # fmt: skip
        """A fused decode call: `cache` (2L, B, heads, C, hd) bound as past and present alike, so the
        kernel writes the new token's K/V into each row at its length; logits (B, 1, vocab) out.
        `local`: a split layout's local columns, bound the same way."""
        logits = self.backend.zeros((ids.shape[0], 1, self.vocab_size), "float32")
        inputs = {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: positions}
        inputs.update(zip(self.fused_cache_names, cache, strict=True))
        outputs = {LOGITS: logits, **dict(zip(self.present_names, cache, strict=True))}
        self._local(inputs, outputs, local)
        return session.bind(inputs, outputs), logits

    def bind_prompt(
        self, session: ModelSession, ids: Array, mask: Array, positions: Array, past: Array,
        local: LocalPast | None = None,
    ) -> tuple[ort.IOBinding, Array, Array]:  # fmt: skip
        """A fused prompt call (prefill-fused): `past` (2L, B, heads, P, hd) in; new arrays for logits
        (B, S, vocab) and the whole cache, past and new, (2L, B, heads, P + S, hd) out. `local`: a
        split layout's local past and mask, its present (past and new) in `local.present`."""
        layout, (batch, width) = self.layout, ids.shape
        total = past.shape[3] + width
        cache = self.backend.zeros((layout.tensors, batch, layout.n_heads, total, layout.head_dim), "float32")
        logits = self.backend.zeros((batch, width, self.vocab_size), "float32")
        inputs = {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: positions}
        inputs.update(zip(self.fused_cache_names, past, strict=True))
        outputs = {LOGITS: logits, **dict(zip(self.present_names, cache, strict=True))}
        self._local(inputs, outputs, local)
        return session.bind(inputs, outputs), logits, cache

    def bind_prompt_in_place(
        self, session: ModelSession, ids: Array, mask: Array, positions: Array, cache: Array,
        local: LocalPast | None = None,
    ) -> tuple[ort.IOBinding, Array]:  # fmt: skip
        """A fused prompt call whose past and present are one array: `cache` (2L, B, heads, P + S, hd)
        with the past in its first P columns, bound as both, so the kernel reads the past where it
        lies and writes the S new tokens' K/V after it (no second cache array, no copy of the
        past); new logits (B, S, vocab) out. `local`: a split layout's local columns, bound the same way."""
        logits = self.backend.zeros((ids.shape[0], ids.shape[1], self.vocab_size), "float32")
        inputs = {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: positions}
        inputs.update(zip(self.fused_cache_names, cache, strict=True))
        outputs = {LOGITS: logits, **dict(zip(self.present_names, cache, strict=True))}
        self._local(inputs, outputs, local)
        return session.bind(inputs, outputs), logits

    def rebind_prompt(
        self, session: ModelSession, binding: ort.IOBinding, ids: Array, mask: Array, positions: Array, logits: Array,
        local_mask: Array | None = None,
    ) -> None:  # fmt: skip
        """A fused prompt call bound in place (`bind_prompt_in_place`) for another number of new
        tokens or past: its token inputs and logits bound anew, its cache as it was (`local_mask`: a split
        layout's local mask, anew too)."""
        inputs = {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: positions}
        if local_mask is not None:
            inputs[LOCAL_ATTENTION_MASK] = local_mask
        session.rebind(binding, inputs, {LOGITS: logits})

    def set_ids(self, target: Array, values: np.ndarray | list[int]) -> None:
        """Token ids into a bound input array, on its device."""
        if isinstance(target, np.ndarray):
            target[:] = values
        else:
            target.copy_(self.backend.torch.from_numpy(np.asarray(values, dtype=np.int64)))  # type: ignore[union-attr]
