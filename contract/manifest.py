"""The manifest that travels with every exported model: names, limits, graph files and hashes.

Export writes it (`export.manifest.build_manifest`); the service reads it through `Manifest`
and never branches on the scheme. It also carries the tokenizer, so any client tokenizes
exactly as in training.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract.kv_spec import LayerCacheSpec
from contract.names import SeedModel

MANIFEST = "manifest.json"
GENAI_CONFIG = "genai_config.json"
DTYPE_BYTES = {"float32": 4, "float16": 2}
NP_DTYPES = {"float32": np.float32, "float16": np.float16}
# Variant names of the in-place serving graphs (the plain graphs are named by their dtype).
SERVING = "serving-float32"
SERVING_FP16 = "serving-float16"
# The in-place serving graph of the int8 cache (contract.kv_int8): int8 past plus float32 scales in,
# float32 activations and outputs, like SERVING.
SERVING_INT8 = "serving-int8"
INT8_SCALE_BYTES = 4  # one float32 scale per token, head and K or V
# The fused decode graph (export/fused.py): one GroupQueryAttention per layer, float32, writing each
# new token's K/V into the cache buffer itself; `Manifest.fused_attention` says how it is fed.
SERVING_FUSED = "serving-fused"
# The fused prompt graph (export/fused.py, `fused_graph(prompt=True)`): one GroupQueryAttention per layer
# over S new tokens per row, float32; how it is fed: contract.graph (PREFILL_FUSED's paragraph).
PREFILL_FUSED = "prefill-fused"
# The fused decode graph of the int8 cache (export/fused.py, `fused_graph(int8_scales=...)`): the
# kernel reads int8 K/V with fixed per-channel scales (contract.kv_int8's channel format, the scales in
# the manifest's `int8_channel_scales`) and writes each new token's K/V quantized into the buffer.
SERVING_FUSED_INT8 = "serving-fused-int8"
# The prompt graph of an attention whose prompts want another form than its decode steps (latent
# attention: keys and values up-projected from the cached latents, one fused Attention node a layer,
# models/latent.py): the in-place serving graph's contract (contract.graph), float32.
PREFILL_UP_PROJECTED = "prefill-up-projected"
_SERVING_PREFIX = "serving-"
# A manifest without any of these is refused (manifest.json may carry more).
REQUIRED_KEYS = (
    "name", "scheme", "n_layers", "n_heads", "head_dim", "d_model", "vocab_size", "max_positions",
    "train_context", "dtype", "opset", "sha256", "variants", "tokenizer",
)  # fmt: skip


def serving_variant(dtype: str) -> str:
    """The in-place serving graph's variant name for a storage dtype ("float32" -> SERVING)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return _SERVING_PREFIX + dtype


def variant_dtype(variant: str) -> str:
    """The storage dtype of a variant's cache and activations ("serving-float16" -> "float16")."""
    if variant in (SERVING_FUSED, PREFILL_FUSED, SERVING_FUSED_INT8, PREFILL_UP_PROJECTED):
        return "float32"
    dtype = variant.removeprefix(_SERVING_PREFIX)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{variant!r} is not a graph variant (float32, float16 or serving-<dtype>)")
    return dtype


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in blocks (graphs can be large)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ManifestError(ValueError):
    """A model folder whose manifest or ONNX file cannot be trusted."""


@dataclass(frozen=True)
class CacheEviction:
    """A scheme's positions once a cache policy evicts tokens (see contract.cache_policy).

    `positions`: "cache" (distances within the cache) or "original" (absolute, kept).
    `rotary_inv_freq`: for RoPE, whose cached keys carry their rotation: the inverse frequencies
    with which sink keys are moved to sit right before the window (None for other schemes).
    """

    positions: str
    rotary_inv_freq: np.ndarray | None = None

    @property
    def feeds_original_positions(self) -> bool:
        """Query positions count from the sequence start: absolute schemes, and RoPE, whose window
        keys keep their rotation (only differences matter) while its sinks are moved."""
        return self.positions == "original" or self.rotary_inv_freq is not None


# SegmentReuse modes: what a text's K/V computed on its own from position 0 needs at another offset.
REUSE_AS_IS = "as_is"  # nothing: keys carry no position (ALiBi, T5 bias, NoPE)
REUSE_ROTATE = "rotate"  # its keys turned by the offset (RoPE)
REUSE_RECOMPUTE = "recompute"  # impossible (absolute positions enter every layer's input): computed in place


@dataclass(frozen=True)
class SegmentReuse:
    """A scheme's declaration for reusable prompt segments (manifest key `segment_reuse`): `mode` one of
    the REUSE_* modes, and for `rotate` the inverse frequencies keys are turned with (no attention factor)
    and the layers whose keys carry a rotation (None: every layer; a hybrid's NoPE layer is left as is)."""

    mode: str
    rotary_inv_freq: np.ndarray | None = None
    rotated_layers: tuple[int, ...] | None = None

    def rotated_key_rows(self, n_layers: int, per_layer: int = 2) -> list[int]:
        """Indices of the rotated layers' keys in a (per_layer x layers, ...) cache array (K, V of layer
        0, ...; latent attention: one entry a layer, per_layer 1)."""
        layers = range(n_layers) if self.rotated_layers is None else self.rotated_layers
        return [per_layer * layer for layer in layers]


@dataclass(frozen=True)
class LayerGroupSpec:
    """Layers that attend alike (manifest key `layer_groups`): `window` None for a global group (its
    cache grows with the sequence), else the last `window` tokens a local layer sees (the most its
    cache ever needs); `rotates_keys`: its cached keys carry their rotation."""

    name: str
    layers: tuple[int, ...]
    window: int | None
    rotates_keys: bool


@dataclass(frozen=True)
class LocalCache:
    """A hybrid's fused graphs read its windowed layers' past apart (manifest key `local_cache`): `layers`
    take past_key_values.{i}.* of their own width (a row's local columns) whose lengths come from `mask`
    (B, local past + new), as attention_mask's do for the others; `window`: the tokens each attends to,
    its query's own included; `variants`: the graphs that take them (the traced graphs read every layer
    at full width)."""

    layers: tuple[int, ...]
    window: int
    mask: str
    variants: tuple[str, ...]


@dataclass(frozen=True)
class FusedAttention:
    """How the fused decode graph is fed (manifest key `fused_attention`).

    `variant`: its graph. `dtype`: of its cache. `shares_cache_buffer`: present.{i}.* must be bound
    to the past buffers, and the graph writes the new token's K/V at column `length` of each row (the
    caller appends nothing). `policies`: the cache policies whose rows it can decode (the others keep
    the explicit serving graph). Rows must be left-aligned: length = sum(attention_mask) - 1.
    """

    variant: str
    dtype: str
    op: str
    shares_cache_buffer: bool
    policies: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    """Typed view of manifest.json."""

    path: Path
    data: dict[str, object]

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def name(self) -> str:
        return str(self.data["name"])

    @property
    def scheme(self) -> str:
        return str(self.data["scheme"])

    @property
    def n_layers(self) -> int:
        return int(self.data["n_layers"])  # type: ignore[arg-type]

    @property
    def n_heads(self) -> int:
        return int(self.data["n_heads"])  # type: ignore[arg-type]

    @property
    def head_dim(self) -> int:
        return int(self.data["head_dim"])  # type: ignore[arg-type]

    @property
    def kv_spec(self) -> LayerCacheSpec:
        """What each layer caches per token (contract.kv_spec); an export from before typed specs: K and V."""
        raw = self.data.get("kv_cache")
        if isinstance(raw, dict) and isinstance(raw.get("spec"), dict):
            return LayerCacheSpec.from_json(raw["spec"])
        return LayerCacheSpec.full(self.n_heads, self.head_dim)

    @property
    def vocab_size(self) -> int:
        return int(self.data["vocab_size"])  # type: ignore[arg-type]

    @property
    def max_positions(self) -> int | None:
        value = self.data["max_positions"]
        return None if value is None else int(value)  # type: ignore[arg-type]

    @property
    def train_context(self) -> int:
        return int(self.data["train_context"])  # type: ignore[arg-type]

    @property
    def is_scaling_variant(self) -> bool:
        """A rope model exported with a context-scaling recipe (linear/ntk/yarn): served only when named."""
        return self.data.get("rope_scaling") is not None

    @property
    def is_extra_seed(self) -> bool:
        """A further training seed of its scheme (`rope@seed2`, contract.names): served only when named."""
        return SeedModel.parse(self.name).seed is not None

    @property
    def served_by_default(self) -> bool:
        """Served without being named: the schemes' own models, not scaling variants or further seeds."""
        return not (self.is_scaling_variant or self.is_extra_seed)

    @property
    def random_weights(self) -> bool:
        """Weights drawn at random from a fixed seed (`python -m export --size small`), not trained: its
        latency, memory and capacity are real, its text is noise."""
        return self.data.get("random_weights") is not None

    @property
    def size(self) -> str | None:
        """The named size it was exported at (models/sizes.py; None: the trained weights' own)."""
        size = self.data.get("size")
        return None if size is None else str(size)

    @property
    def training_seed(self) -> int | None:
        """The seed its weights were trained with (None: an export from before it was recorded)."""
        training = self.data.get("training")
        seed = training.get("seed") if isinstance(training, dict) else None
        return None if seed is None else int(seed)

    @property
    def cache_eviction(self) -> CacheEviction | None:
        """How the scheme's positions behave when a cache policy evicts tokens (None: an export from
        before cache policies, which serves `full` only)."""
        raw = self.data.get("cache_eviction")
        if not isinstance(raw, dict):
            return None
        inv_freq = raw.get("rotary_inv_freq")
        return CacheEviction(
            positions=str(raw["positions"]),
            rotary_inv_freq=None if inv_freq is None else np.asarray(inv_freq, dtype=np.float64),
        )

    @property
    def segment_reuse(self) -> SegmentReuse:
        """How a reusable segment's cached K/V is placed at another offset; an export from before
        segments: recompute (its scheme declared nothing)."""
        raw = self.data.get("segment_reuse")
        if not isinstance(raw, dict):
            return SegmentReuse(REUSE_RECOMPUTE)
        inv_freq = raw.get("rotary_inv_freq")
        rotated = raw.get("rotated_layers")
        return SegmentReuse(
            str(raw["mode"]),
            None if inv_freq is None else np.asarray(inv_freq, dtype=np.float64),
            None if rotated is None else tuple(int(layer) for layer in rotated),  # type: ignore[union-attr]
        )

    @property
    def layer_groups(self) -> tuple[LayerGroupSpec, ...]:
        """The model's layer groups; an export from before hybrids: one global group of every layer."""
        raw = self.data.get("layer_groups")
        if not isinstance(raw, list):
            return (LayerGroupSpec("global", tuple(range(self.n_layers)), None, False),)
        return tuple(
            LayerGroupSpec(str(g["name"]), tuple(g["layers"]), g["window"], bool(g["rotates_keys"])) for g in raw
        )

    @property
    def local_cache(self) -> LocalCache | None:
        """How the fused graphs read a hybrid's windowed layers apart; None: as every other layer (an
        export from before per-group caches, or a model without windows)."""
        raw = self.data.get("local_cache")
        if not isinstance(raw, dict):
            return None
        return LocalCache(
            tuple(int(layer) for layer in raw["layers"]), int(raw["window"]), str(raw["mask"]),
            tuple(str(variant) for variant in raw["variants"]),
        )  # fmt: skip

    @property
    def is_hybrid(self) -> bool:
        """Some layers attend within a sliding window (rnope-swa, rope-swa)."""
        return any(group.window is not None for group in self.layer_groups)

    @property
    def fused_attention(self) -> FusedAttention | None:
        """The fused decode graph's contract, or None where the export has none."""
        raw = self.data.get("fused_attention")
        if not isinstance(raw, dict) or raw.get("variant") not in self.data["variants"]:  # type: ignore[operator]
            return None
        return FusedAttention(
            str(raw["variant"]),
            str(raw["dtype"]),
            str(raw["op"]),
            bool(raw["shares_cache_buffer"]),
            tuple(raw["policies"]),
        )

    @property
    def tokenizer(self) -> dict[str, object]:
        return dict(self.data["tokenizer"])  # type: ignore[call-overload]

    def variant(self, dtype: str = "float32") -> dict[str, str]:
        """{'file', 'sha256'} of the graph in `dtype`."""
        variants: dict[str, dict[str, str]] = self.data["variants"]  # type: ignore[assignment]
        if dtype not in variants:
            raise ManifestError(f"{self.path}: no {dtype} variant (have {', '.join(variants)})")
        return variants[dtype]

    def onnx_path(self, dtype: str = "float32") -> Path:
        return self.folder / self.variant(dtype)["file"]

    @property
    def has_int8_cache(self) -> bool:
        """The export has the int8 serving graph (the +int8 cache policies)."""
        return SERVING_INT8 in self.data["variants"]  # type: ignore[operator]

    @property
    def int8_channel_scales(self) -> np.ndarray | None:
        """The fixed per-channel scales of the fused int8 graph's cache, (2 x layers, heads, 1,
        head_dim) float32 (K then V of each layer), or None where the export has no such graph."""
        raw = self.data.get("int8_channel_scales")
        if raw is None or SERVING_FUSED_INT8 not in self.data["variants"]:  # type: ignore[operator]
            return None
        shape = (2 * self.n_layers, self.n_heads, 1, self.head_dim)
        return np.asarray(raw, dtype=np.float32).reshape(shape)

    def kv_bytes_per_token(self, dtype: str = "float32") -> int:
        """Cache bytes one token occupies: K and V, every layer and head (SERVING_INT8: int8 values
        plus one float32 scale per head)."""
        if dtype == SERVING_INT8:
            return 2 * self.n_layers * self.n_heads * (self.head_dim + INT8_SCALE_BYTES)
        return self.n_layers * self.kv_spec.token_floats * DTYPE_BYTES[variant_dtype(dtype)]

    def verify(self, dtype: str = "float32") -> Path:
        """Check the ONNX file against the recorded sha256; raise naming the bad file."""
        path = self.onnx_path(dtype)
        if not path.is_file():
            raise ManifestError(f"{path}: ONNX file named by {self.path} is missing")
        actual = sha256_file(path)
        expected = self.variant(dtype)["sha256"]
        if actual != expected:
            raise ManifestError(f"{path}: sha256 {actual} does not match {expected} recorded in {self.path}")
        return path

    def verify_all(self) -> None:
        """Check every graph the manifest lists (a server refuses to start on any bad file)."""
        for variant in self.data["variants"]:  # type: ignore[union-attr]
            self.verify(variant)

    @classmethod
    def load(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as error:
            raise ManifestError(f"{path}: manifest is missing") from error
        except json.JSONDecodeError as error:
            raise ManifestError(f"{path}: manifest is not valid JSON ({error})") from error
        missing = [key for key in REQUIRED_KEYS if key not in data]
        if missing:
            raise ManifestError(f"{path}: manifest lacks {', '.join(missing)}")
        return cls(path, data)
