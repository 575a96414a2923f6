"""The fused serving graph (variant serving-fused): one GroupQueryAttention kernel per layer.

Written directly from the PyTorch weights with `onnx.helper`, as onnxruntime-genai's model builder
writes its graphs (onnxruntime_genai/models/builders/base.py, `make_group_query_attention`), instead
of tracing: the explicit serving graph spends dozens of nodes per layer on attention, this one
spends one `com.microsoft.GroupQueryAttention` node (flash / memory-efficient kernels on CUDA).

Contract (decode only, one token per row; `contract.manifest.FusedAttention`):

- inputs as the in-place serving graph's: input_ids (B, 1), attention_mask (B, C + 1),
  position_ids (B, 1), past_key_values.{i}.key|value (B, heads, C, head_dim): the store's rows,
  left-aligned (a row's tokens at columns [0, length)), so length = sum(attention_mask) - 1;
- outputs logits (B, 1, vocab) and present.{i}.key|value, which the caller binds to the very
  buffers it feeds as past (GroupQueryAttention's share-buffer mode): the kernel writes the new
  token's K/V into column `length` of each row itself, and the caller must not append it again.
- a hybrid's windowed layers (contract.manifest.LocalCache) read a past of their own width (a row's
  local columns, service/engine/kv/local.py), whose lengths come from `local_attention_mask`
  (B, local past + 1) as the others' come from attention_mask.

The positional scheme enters through one small unit per scheme (`FUSED_POSITIONS`), the way
`models.positional` isolates them: an input embedding (sinusoidal, learned), an attention bias
fed to the kernel's attention_bias input (relative, alibi: (B, heads, 1, T) for T = the longest
row + 1, indexed by absolute key position), or the kernel's own rotary (rope, `do_rotary`, cos and
sin computed in the graph for each row's position, so no length limit is baked in).

What it cannot express, so those rows keep the explicit serving graph: bounded cache policies
(window / sinks shift a row by one token in place and re-index positions, moving rope's sinks;
the kernel's `sliding_window_cache` evicts in blocks, keeps no sinks and indexes the bias by
absolute position) and the bounded policies' int8 cache (per-token scales; the kernel quantizes
per tensor or per channel).

With `int8_scales`, the graph is serving-fused-int8: the unbounded int8 cache in contract/kv_int8.py's
channel format. The past and present K/V are int8, each layer's fixed scales are initializers fed to
the kernel's k_scale / v_scale (`k_quant_type` / `v_quant_type` PER_CHANNEL, 8 bits), and the kernel
quantizes the new token's K/V into the buffer and dequantizes inside attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from contract.graph import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOCAL_ATTENTION_MASK,
    LOGITS,
    POSITION_IDS,
    past_names,
    present_names,
)
from models.config import ModelConfig
from models.positional import alibi_slopes, relative_position_bucket, rope_inverse_frequencies
from models.transformer import Transformer

OPSET = 18
CONTRIB_OPSET = 1
IR_VERSION = 10  # what ONNX Runtime 1.31 loads; onnx.helper would stamp a newer one
ZERO, ONE = "zero_i64", "one_i64"  # int64 scalars every step needs


@dataclass
class GraphBuilder:
    """Nodes and initializers with unique names: what `onnx.helper` needs, and nothing else."""

    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    _count: int = 0

    def const(self, name: str, value: np.ndarray | torch.Tensor) -> str:
        array = value.detach().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        self.initializers.append(numpy_helper.from_array(np.array(array, order="C"), name))
        return name

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs: object) -> str | list[str]:
        self._count += 1
        names = [f"{op_type.lower()}_{self._count}_{k}" for k in range(outputs)]
        self.nodes.append(
            helper.make_node(op_type, list(inputs), names, name=f"{op_type}_{self._count}", domain=domain, **attrs)
        )
        return names[0] if outputs == 1 else names

    def one(self, op_type: str, *inputs: str, **attrs: object) -> str:
        """A single-output node's output name."""
        out = self.op(op_type, *inputs, **attrs)
        assert isinstance(out, str)
        return out


@dataclass(frozen=True)
class StepInputs:
    """What every scheme unit may read, computed once per step."""

    position_ids: str  # (B, S) int64: the positions of each row's new tokens
    total: str  # () int64: T = the longest row + 1, the kernel's total_sequence_length
    prompt: bool = False  # the prompt graph: each row's S positions are consecutive

    def key_positions(self, g: GraphBuilder) -> str:
        """(T,) int64: absolute key positions 0 .. T-1 (a row's token i sits at column i)."""
        return g.one("Range", ZERO, self.total, ONE)

    def distances(self, g: GraphBuilder) -> str:
        """(B, S, T) int64: query position - key position, for each query row and key column."""
        queries = g.one("Unsqueeze", self.position_ids, g.const("axis_last_q", np.array([-1])))  # (B, S, 1)
        return g.one("Sub", queries, self.key_positions(g))

    def diagonal_distances(self, g: GraphBuilder) -> tuple[str, str]:
        """For the prompt graph, whose rows' positions are consecutive (q0, q0 + 1, ...): a bias that
        depends only on query - key is constant along each diagonal of the (S, T) matrix, so it is
        determined by S + T values. Returns (B, L) int64 distances d, L = S + T, and the name of L:
        column k < T holds q0 - k (key k seen from the first query), column k >= T holds q0 + L - k
        (the first query seen from the keys before it, i.e. later queries). `toeplitz` lays the
        values out as the (B, heads, S, T) matrix."""
        queries = g.one("Squeeze", g.one("Shape", self.position_ids, start=1, end=2), ZERO_1D)  # S
        length = g.one("Add", self.total, queries)  # L = S + T
        columns = g.one("Range", ZERO, length, ONE)  # (L,)
        wrapped = g.one("Cast", g.one("GreaterOrEqual", columns, self.total), to=TensorProto.INT64)
        offset = g.one("Sub", g.one("Mul", wrapped, length), columns)  # L * (k >= T) - k
        first = g.one("Slice", self.position_ids, ZERO_1D, ONE_1D, ONE_1D)  # (B, 1): q0
        return g.one("Add", first, offset), length

    def toeplitz(self, g: GraphBuilder, values: str, length: str) -> str:
        """(B, heads, S, T) from (B, heads, L) values over `diagonal_distances`: row i, column j is
        values[(j - i) mod L]. Tiled S times and read with a row stride of L - 1, each row starts one
        value earlier than the row above: three copies of about S x L values, where gathering a value
        per entry (and transposing it) took 3x as long (docs/measurements.md)."""
        queries = g.one("Squeeze", g.one("Shape", self.position_ids, start=1, end=2), ZERO_1D)  # S
        repeats = g.one("Concat", ONE_1D, ONE_1D, g.one("Unsqueeze", queries, ZERO_1D), axis=0)
        tiled = g.one("Tile", values, repeats)  # (B, H, S * L)
        stride = g.one("Sub", length, ONE)
        used = g.one("Unsqueeze", g.one("Mul", queries, stride), ZERO_1D)
        flat = g.one("Slice", tiled, ZERO_1D, used, g.const("axis_last_1d", np.array([-1])))  # (B, H, S * (L - 1))
        shape = g.one("Concat", ZERO_1D, ZERO_1D, g.const("minus_one_1d", np.array([-1])),
                      g.one("Unsqueeze", stride, ZERO_1D), axis=0)  # fmt: skip
        rows = g.one("Reshape", flat, shape)  # (B, H, S, L - 1): row i starts at values[-i mod L]
        return g.one("Slice", rows, ZERO_1D, g.one("Unsqueeze", self.total, ZERO_1D), "axis_last_1d")


class FusedPositions:
    """A scheme in the fused graph. The default is NoPE: the causal mask alone carries order."""

    def __init__(self, model: Transformer) -> None:
        self.model, self.config = model, model.config

    def input_embedding(self, g: GraphBuilder, step: StepInputs) -> str | None:
        """(B, 1, d) added to the token embedding, or None."""
        return None

    def attention_bias(self, g: GraphBuilder, step: StepInputs) -> str | None:
        """(B|1, heads, 1, T) added to the scaled scores inside the kernel, or None."""
        return None

    def rotary(self, g: GraphBuilder, step: StepInputs) -> tuple[str, str, str] | None:
        """The kernel's rotary inputs (cos cache, sin cache, position_ids), or None: no rotation."""
        return None

    def prompt_rotary(self, g: GraphBuilder, step: StepInputs) -> tuple[str, str, str] | None:
        """`rotary` for S new tokens per row (the prompt graph), or None: no rotation."""
        return None

    def layer_attention(self, g: GraphBuilder, step: StepInputs) -> list[LayerAttention]:
        """Every layer alike, over the whole past; hybrids split the layers into groups."""
        rotary = self.prompt_rotary(g, step) if step.prompt else self.rotary(g, step)
        return [LayerAttention(tuple(range(self.config.n_layers)), rotary, self.attention_bias(g, step))]


class SinusoidalInput(FusedPositions):
    """`models.positional.sinusoid` in graph ops: interleaved sin/cos, divided by sqrt(d)."""

    def input_embedding(self, g: GraphBuilder, step: StepInputs) -> str:
        dim = self.config.d_model
        even = torch.arange(0, dim, 2, dtype=torch.float32)
        inv_freq = g.const("sinusoid_inv_freq", torch.pow(10000.0, -even / dim))  # (d/2,)
        position = g.one("Cast", step.position_ids, to=TensorProto.FLOAT)  # (B, 1)
        angle = g.one("Mul", g.one("Unsqueeze", position, g.const("axis_last", np.array([-1]))), inv_freq)
        pair = [g.one("Unsqueeze", g.one(fn, angle), "axis_last") for fn in ("Sin", "Cos")]  # (B, 1, d/2, 1)
        code = g.one("Reshape", g.one("Concat", *pair, axis=-1), g.const("shape_b1d", np.array([0, 0, dim])))
        return g.one("Div", code, g.const("sqrt_d_model", np.array(math.sqrt(dim), dtype=np.float32)))


class LearnedInput(FusedPositions):
    """The trained table, gathered at the row's position (the admission keeps it below max_positions)."""

    def input_embedding(self, g: GraphBuilder, step: StepInputs) -> str:
        table = self.model.positional.table.weight  # type: ignore[union-attr]
        return g.one("Gather", g.const("position_table", table), step.position_ids)


class RelativeBias(FusedPositions):
    """T5 buckets as a table over distances 0 .. max_distance (every larger distance shares the
    last bucket), so the graph gathers the bias itself instead of recomputing logarithms."""

    def attention_bias(self, g: GraphBuilder, step: StepInputs) -> str:
        config = self.config
        distances = torch.arange(config.relative_max_distance + 1)
        buckets = relative_position_bucket(
            -distances, bidirectional=False, num_buckets=config.relative_num_buckets,
            max_distance=config.relative_max_distance,
        )  # fmt: skip
        table = self.model.positional.bias.weight[buckets].T  # type: ignore[union-attr]  # (H, max_distance+1)
        top = g.const("max_distance", np.array(config.relative_max_distance))
        by_distance = g.const("relative_bias_by_distance", table)
        if step.prompt:  # S + T values laid out along the diagonals, not S x T gathered
            distances, length = step.diagonal_distances(g)
            values = g.one("Gather", by_distance, g.one("Clip", distances, ZERO, top), axis=1)  # (H, B, L)
            return step.toeplitz(g, g.one("Transpose", values, perm=[1, 0, 2]), length)
        distance = g.one("Clip", step.distances(g), ZERO, top)  # (B, S, T)
        bias = g.one("Gather", by_distance, distance, axis=1)  # (H, B, S, T)
        return g.one("Transpose", bias, perm=[1, 0, 2, 3])


class AlibiBias(FusedPositions):
    """-slope * (query - key) per head, as `AlibiBias.attention_bias`."""

    def attention_bias(self, g: GraphBuilder, step: StepInputs) -> str:
        # slope * key - slope * query: the (B, H, S, T) bias is written once, by one broadcasting Sub.
        slopes = g.const("alibi_slopes", torch.from_numpy(alibi_slopes(self.config.n_heads)).view(1, -1, 1, 1))
        keys = g.one("Mul", slopes, g.one("Cast", step.key_positions(g), to=TensorProto.FLOAT))  # (1, H, 1, T)
        queries = g.one("Unsqueeze", step.position_ids, g.const("axes_1_3", np.array([1, 3])))  # (B, 1, S, 1)
        queries = g.one("Mul", slopes, g.one("Cast", queries, to=TensorProto.FLOAT))  # (B, H, S, 1)
        return g.one("Sub", keys, queries)  # (B, H, S, T)


class RotaryInKernel(FusedPositions):
    """The kernel rotates q and k (rotate-half layout, `rotary_interleaved=0`) from cos/sin caches.

    The kernel looks a row's angles up at its position_ids and wants a cache of at least T rows;
    a table over all positions 0 .. T-1 would cost T x head_dim/2 cos and sin per step, a large share
    of a decode step at long contexts. So the cache holds one row per batch row, its new token's angles,
    zero-padded to T rows, and the kernel is given each row's index as its position: exact, and
    B x head_dim/2 cos and sin per step. One initializer holds the variant's inverse frequencies and
    feeds one Cos and one Sin, as in the traced graphs, so `export.rope_variants` derives the scaled
    variants from this graph too; partial rotary's unrotated pairs have frequency 0 (cos 1, sin 0)."""

    def rotary(self, g: GraphBuilder, step: StepInputs) -> tuple[str, str, str]:
        cos, sin = self._tables(g, g.one("Cast", step.position_ids, to=TensorProto.FLOAT))  # (B, head_dim/2)
        batch = g.one("Gather", g.one("Shape", step.position_ids), g.const("zero_index", np.array(0)))
        spare = g.one("Sub", g.one("Max", step.total, batch), batch)  # rows up to max(T, B)
        pads = g.one("Concat", *(g.const(f"pad_{k}", np.array([0])) for k in ("row", "column")),
                     g.one("Unsqueeze", spare, g.const("axis_0", np.array([0]))), "pad_column", axis=0)  # fmt: skip
        cos, sin = (g.one("Pad", table, pads) for table in (cos, sin))  # (max(T, B), head_dim/2)
        rows = g.one("Unsqueeze", g.one("Range", ZERO, batch, ONE), g.const("axis_1b", np.array([1])))
        return cos, sin, rows  # rows: (B, 1), each row's index into the cache

    def prompt_rotary(self, g: GraphBuilder, step: StepInputs) -> tuple[str, str, str]:
        """A prompt's rows need the positions of its new tokens, lowest to highest: the caches hold
        their angles at those rows, zero-padded before the lowest and up to max(T, highest + 1)
        rows (the kernel reads each token's own position, or where a caller places tokens further
        on, a segment computed at an offset). A chunk after a long past (a prefix-cache hit's tail)
        then costs S, not T, rows of cos and sin (head_dim/2 each)."""
        low = g.one("ReduceMin", step.position_ids, keepdims=0)  # () int64
        top = g.one("Add", g.one("ReduceMax", step.position_ids, keepdims=0), ONE)
        positions = g.one("Unsqueeze", g.one("Range", low, top, ONE), g.const("axis_1r", np.array([1])))  # (N, 1)
        cos, sin = self._tables(g, positions)  # (N, head_dim/2)
        after = g.one("Sub", g.one("Max", step.total, top), top)
        low_1d, after_1d = (
            g.one("Unsqueeze", edge, g.const(f"axis_0{k}", np.array([0]))) for k, edge in (("l", low), ("a", after))
        )
        zero_column = g.const("prompt_pad_column", np.array([0]))
        pads = g.one("Concat", low_1d, zero_column, after_1d, zero_column, axis=0)  # [low, 0, after, 0]
        cos, sin = (g.one("Pad", table, pads) for table in (cos, sin))  # (max(T, highest + 1), head_dim/2)
        return cos, sin, step.position_ids

    def _tables(self, g: GraphBuilder, positions: str) -> tuple[str, str]:
        """cos and sin of positions (N, 1) float times the inverse frequencies: (N, head_dim/2) each,
        float32, computed in float64 as `models.positional.rope_angles` does (a float32 angle strays
        in proportion to the position; reused segments' keys are moved by exact rotations)."""
        config = self.config
        inv_freq, factor = rope_inverse_frequencies(
            config.head_dim, config.rope_base, config.rope_scaling, config.rope_rotary_dims
        )
        frequencies = g.const("rope_inv_freq", inv_freq.double())
        angles = g.one("Mul", g.one("Cast", positions, to=TensorProto.DOUBLE), frequencies)
        cos, sin = g.one("Cos", angles), g.one("Sin", angles)
        if factor != 1.0:  # YaRN's attention temperature, carried by cos and sin
            scale = g.const("rope_attention_factor", np.array(factor, dtype=np.float64))
            cos, sin = g.one("Mul", cos, scale), g.one("Mul", sin, scale)
        return g.one("Cast", cos, to=TensorProto.FLOAT), g.one("Cast", sin, to=TensorProto.FLOAT)


@dataclass(frozen=True)
class LayerAttention:
    """What one group of layers hands its GroupQueryAttention kernels: rotary inputs, a bias, and
    `local_window_size` (-1: the whole past; W: the last W keys, the query's own included,
    as `models.positional.LayerGroup.window` counts them)."""

    layers: tuple[int, ...]
    rotary: tuple[str, str, str] | None
    bias: str | None
    local_window_size: int = -1
    # A windowed group reads its own past (the row's local columns) with its own lengths: the kernel's
    # seqlens_k and total_sequence_length from LOCAL_ATTENTION_MASK (None: the call's, from attention_mask).
    lengths: tuple[str, str] | None = None


class LocalGlobalHybrid(FusedPositions):
    """`models.positional.LocalGlobalHybrid`: the kernel's rotary and sliding window on the local
    layers, the global unit's (rotary for rope-swa, nothing for rnope-swa) on the global ones.
    The angles are computed once and shared where both groups rotate. The local layers read a past of
    their own (a row's local columns: at most its window and some slack, service/engine/kv/local.py),
    whose lengths come from LOCAL_ATTENTION_MASK: RoPE keys are cached rotated at their true positions
    and the query is rotated at its true position, so where a key sits in the buffer does not matter,
    and the kernel's window by column is the window by token in a left-aligned buffer."""

    def layer_attention(self, g: GraphBuilder, step: StepInputs) -> list[LayerAttention]:
        rope = RotaryInKernel(self.model)
        rotary = rope.prompt_rotary(g, step) if step.prompt else rope.rotary(g, step)
        attention = []
        for group in self.model.positional.layer_groups():
            rotates = group.positional.rotates_keys
            window = -1 if group.window is None else group.window
            lengths = None if group.window is None else _kernel_lengths(g, LOCAL_ATTENTION_MASK, step.prompt)
            attention.append(LayerAttention(group.layers, rotary if rotates else None, None, window, lengths))
        return attention


def _kernel_lengths(g: GraphBuilder, mask: str, prompt: bool) -> tuple[str, str]:
    """GroupQueryAttention's seqlens_k (B,) int32 (each row's total length - 1) and total_sequence_length
    () int32 from a mask (B, past + new): its width for a prompt (rows right-padded), else the longest
    row + 1. Made once per mask name (the graph's nodes are shared by the layers that read it)."""
    lengths = g.one("Sub", g.one("ReduceSum", mask, g.const(f"{mask}_axis_1", np.array([1])), keepdims=0), ONE)
    if prompt:
        total = g.one("Squeeze", g.one("Slice", g.one("Shape", mask), ONE_1D, TWO_1D), ZERO_1D)
    else:
        total = g.one("Add", g.one("ReduceMax", lengths, keepdims=0), ONE)
    return g.one("Cast", lengths, to=TensorProto.INT32), g.one("Cast", total, to=TensorProto.INT32)


# The one mapping of schemes to their fused units (every scheme of models.positional.SCHEMES).
FUSED_POSITIONS: dict[str, type[FusedPositions]] = {
    "sinusoidal": SinusoidalInput,
    "learned": LearnedInput,
    "relative": RelativeBias,
    "rope": RotaryInKernel,
    "alibi": AlibiBias,
    "none": FusedPositions,
    "rnope-swa": LocalGlobalHybrid,
    "rope-swa": LocalGlobalHybrid,
}


def fused_graph(model: Transformer, prompt: bool = False, int8_scales: np.ndarray | None = None) -> onnx.ModelProto:
    """The serving-fused graph of a float32 model (see the module docstring for its contract), with
    `prompt` the prefill-fused graph (export/prefill.py's contract): S new tokens per row, or with
    `int8_scales` ((2 x layers, heads, 1, head_dim), export/int8_channels.py) serving-fused-int8."""
    assert int8_scales is None or not prompt, "prompts are computed in float32"
    model = model.float().eval()
    config = model.config
    positional = FUSED_POSITIONS[config.scheme](model)
    g = GraphBuilder()
    g.const(ZERO, np.array(0))
    g.const(ONE, np.array(1))
    # Per-call values shared by every layer: each row's total length - 1 (from the mask), T, positions.
    lengths = g.one("Sub", g.one("ReduceSum", ATTENTION_MASK, g.const("axis_1", np.array([1])), keepdims=0), ONE)
    if prompt:  # T = the mask's width: P past columns then S new ones; rows are right-padded
        total = g.one("Squeeze", g.one("Slice", g.one("Shape", ATTENTION_MASK), ONE_1D, TWO_1D), ZERO_1D)
    else:
        total = g.one("Add", g.one("ReduceMax", lengths, keepdims=0), ONE)  # scalar: longest row + 1
    step = StepInputs(POSITION_IDS, total, prompt)
    for name, value in ((ZERO_1D, 0), (ONE_1D, 1), (TWO_1D, 2)):
        g.const(name, np.array([value]))
    attention = positional.layer_attention(g, step)
    seqlens_k = g.one("Cast", lengths, to=TensorProto.INT32)  # (B,)
    _layers(g, model, positional, step, seqlens_k, g.one("Cast", total, to=TensorProto.INT32), attention, int8_scales)
    local = tuple(layer for group in attention if group.lengths is not None for layer in group.layers)
    return _model(g, config, prompt, int8_scales is not None, local)


ZERO_1D, ONE_1D, TWO_1D = "zero_1d", "one_1d", "two_1d"


def _layers(
    g: GraphBuilder,
    model: Transformer,
    positional: FusedPositions,
    step: StepInputs,
    seqlens_k: str,
    total_i32: str,
    attention: list[LayerAttention],
    int8_scales: np.ndarray | None = None,
) -> None:
    """Embedding, the blocks (one GroupQueryAttention each) and the LM head, writing LOGITS and present.*
    (with `int8_scales`, the kernel reads and writes an int8 cache with those per-channel scales)."""
    config = model.config
    sd = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    of_layer = {layer: group for group in attention for layer in group.layers}
    x = g.one("Gather", g.const("token_embedding", sd["token_embedding.weight"]), INPUT_IDS)  # (B, S, d)
    embedding = positional.input_embedding(g, step)
    if embedding is not None:
        x = g.one("Add", x, embedding)

    def linear(h: str, prefix: str) -> str:
        return g.one("Add", project(h, prefix), g.const(f"{prefix}.bias", sd[f"{prefix}.bias"]))

    def project(h: str, prefix: str) -> str:
        return g.one("MatMul", h, g.const(f"{prefix}.weight_t", sd[f"{prefix}.weight"].T))  # (in, out)

    def norm_weights(prefix: str) -> list[str]:
        return [g.const(f"{prefix}.{part}", sd[f"{prefix}.{part}"]) for part in ("weight", "bias")]

    def add_and_norm(residual: str, h: str, prefix: str, norm: str) -> tuple[str, str]:
        """(layer norm `norm` of residual + h + `prefix`'s bias, that sum): one SkipLayerNormalization
        instead of two Adds and a LayerNormalization (ORT's own fusion misses a sum read twice)."""
        bias = g.const(f"{prefix}.bias", sd[f"{prefix}.bias"])
        normed, _, _, total = g.op(
            "SkipLayerNormalization", h, residual, *norm_weights(norm), bias,
            outputs=4, domain="com.microsoft", epsilon=config.layer_norm_eps,
        )  # fmt: skip
        return normed, total

    past, present = past_names(config.n_layers), present_names(config.n_layers)
    normed = g.one("LayerNormalization", x, *norm_weights("blocks.0.attn_norm"), axis=-1, epsilon=config.layer_norm_eps)
    quantized: dict[str, object] = {}
    if int8_scales is not None:
        quantized = {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": 8}
    for i in range(config.n_layers):
        block = f"blocks.{i}"
        qkv = linear(normed, f"{block}.attn.qkv")  # packed (B, S, 3d)
        layer = of_layer[i]
        cos, sin, rotary_positions = layer.rotary or ("", "", "")
        layer_seqlens, layer_total = layer.lengths or (seqlens_k, total_i32)
        scales = []
        if int8_scales is not None:  # (heads, 1, head_dim) each: K's, then V's
            k_scale, v_scale = int8_scales[2 * i], int8_scales[2 * i + 1]
            scales = ["", g.const(f"{block}.k_scale", k_scale), g.const(f"{block}.v_scale", v_scale)]
        attended, _, _ = g.op(
            "GroupQueryAttention",
            qkv, "", "", past[2 * i], past[2 * i + 1], layer_seqlens, layer_total, cos, sin,
            rotary_positions, layer.bias or "", *scales,
            outputs=3, domain="com.microsoft", num_heads=config.n_heads, kv_num_heads=config.n_heads,
            do_rotary=int(layer.rotary is not None), rotary_interleaved=0, scale=1.0 / math.sqrt(config.head_dim),
            local_window_size=layer.local_window_size, **quantized,
        )  # fmt: skip
        g.nodes[-1].output[1:] = [present[2 * i], present[2 * i + 1]]
        out = f"{block}.attn.out_proj"
        normed, x = add_and_norm(x, project(attended, out), out, f"{block}.mlp_norm")
        hidden = g.one("Gelu", linear(normed, f"{block}.mlp.up"), domain="com.microsoft")
        after = f"blocks.{i + 1}.attn_norm" if i + 1 < config.n_layers else "final_norm"
        normed, x = add_and_norm(x, project(hidden, f"{block}.mlp.down"), f"{block}.mlp.down", after)
    lm_head = g.const("lm_head", sd["token_embedding.weight"].T)
    g.nodes.append(helper.make_node("MatMul", [normed, lm_head], [LOGITS], name="lm_head"))


def _model(
    g: GraphBuilder, config: ModelConfig, prompt: bool = False, int8: bool = False, local: tuple[int, ...] = ()
) -> onnx.ModelProto:
    """The graph's inputs and outputs around its nodes; `local`: the layers that read a past of their
    own (a hybrid's windowed layers), with dimensions and a mask (LOCAL_ATTENTION_MASK) of their own."""
    float_type, cache_type = TensorProto.FLOAT, TensorProto.INT8 if int8 else TensorProto.FLOAT
    width = "sequence" if prompt else 1

    def cache_dims(layer: int, present: bool) -> list[object]:
        prefix = "local_" if layer in local else ""
        length = "total_sequence" if present and prompt else "past_sequence"
        return ["batch", config.n_heads, prefix + length, config.head_dim]

    def caches(names: list[str], present: bool) -> list[onnx.ValueInfoProto]:
        return [
            helper.make_tensor_value_info(name, cache_type, cache_dims(index // 2, present))
            for index, name in enumerate(names)
        ]

    masks = [(ATTENTION_MASK, "total_sequence")] + ([(LOCAL_ATTENTION_MASK, "local_total_sequence")] if local else [])
    inputs = [
        helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, ["batch", width]),
        *(helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", dim]) for name, dim in masks),
        helper.make_tensor_value_info(POSITION_IDS, TensorProto.INT64, ["batch", width]),
        *caches(past_names(config.n_layers), False),
    ]
    outputs = [
        helper.make_tensor_value_info(LOGITS, float_type, ["batch", width, config.vocab_size]),
        *caches(present_names(config.n_layers), True),
    ]
    name = "prefill_fused" if prompt else "serving_fused_int8" if int8 else "serving_fused"
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.initializers)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", CONTRIB_OPSET)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION, producer_name="posenc-serve")


def export_fused(
    model: Transformer, path: Path, prompt: bool = False, int8_scales: np.ndarray | None = None
) -> onnx.ModelProto:
    """Write the serving-fused (with `prompt`, prefill-fused; with `int8_scales`, serving-fused-int8)
    graph of `model` (float32 activations, one file)."""
    proto = fused_graph(model, prompt, int8_scales)
    onnx.checker.check_model(proto, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(path))
    return proto
