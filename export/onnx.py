"""torch -> ONNX with past/present KV, one graph for prefill and decode.

Input and output names follow Hugging Face Optimum and onnxruntime-genai; they are defined
once in `contract.graph`, which the service reads too. Batch, sequence and past length are
dynamic.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import onnx
import torch
from torch import Tensor, nn

from contract.graph import input_names, output_names
from export.manifest import layer_cache_spec
from models.transformer import Transformer

logger = logging.getLogger(__name__)

OPSET = 18
# The prompt graph's (prefill-up-projected): the first opset with `Attention`, one node for PyTorch's
# fused attention where opset 18 spells out its matrix products, mask and softmax (0.9 s against
# 1.25 s for a 4,000-token mla prompt on one core here).
PROMPT_OPSET = 23

# torch's exporter logs "torchvision is not installed. Skipping torchvision::<op>" at WARNING for
# each torchvision op in its registry on every export (16 lines per scheme, about 90 for the
# repository). These models use no torchvision op and torchvision is no dependency, so that one
# message is dropped where it is logged; every other record of that logger still shows.
TORCH_REGISTRATION_LOGGER = "torch.onnx._internal.exporter._registration"


class _WithoutTorchvisionNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("torchvision is not installed")


logging.getLogger(TORCH_REGISTRATION_LOGGER).addFilter(_WithoutTorchvisionNotice())


class FlatKeyValueModel(nn.Module):
    """The model with the cache as flat positional tensors, as ONNX graphs take it."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model
        self.per_layer = layer_cache_spec(model.config).per_layer  # K and V, or latent attention's one entry

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, *past: Tensor
    ) -> tuple[Tensor, ...]:
        n = self.per_layer
        layers = [tuple(past[n * i : n * i + n]) for i in range(len(past) // n)]
        logits, presents = self.model(input_ids, attention_mask, position_ids, layers)
        return (logits, *(t for layer in presents for t in layer))


def attend_in_place_int8(
    q: Tensor, k: Tensor, v: Tensor, past: tuple[Tensor, ...], score_bias: Tensor, scale: float
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """`attend_in_place` over an int8 past (keys, values, key scales, value scales): a per-token
    scale is taken out of the products, q . (s k) = s (q . k) and w (s v) = (w s) v, so the int8
    cache is only cast, and the scales multiply the (T, past) scores and weights, not the cache."""
    keys, values, key_scales, value_scales = past
    past_len = keys.shape[2]
    past_scores = (q @ keys.to(q.dtype).transpose(-2, -1)) * key_scales.transpose(-2, -1)  # (B, nh, T, past)
    scores = torch.cat((past_scores, q @ k.transpose(-2, -1)), dim=-1)
    weights = torch.softmax(scores * scale + score_bias, dim=-1)
    past_weights = weights[..., :past_len] * value_scales.transpose(-2, -1)
    y = past_weights @ values.to(q.dtype) + weights[..., past_len:] @ v
    return y, (k, v)


class Int8KeyValueModel(nn.Module):
    """The serving model fed an int8 cache: int8 past K/V then their float32 per-token scales
    (contract.graph.input_names(int8=True)), read by the same layers through
    `attend_in_place_int8`; outputs as the float32 serving graph's."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model
        for block in model.blocks:
            block.attn.attend = attend_in_place_int8

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, *cache: Tensor
    ) -> tuple[Tensor, ...]:
        half = len(cache) // 2
        values, scales = cache[:half], cache[half:]
        # Per layer (keys, values, key scales, value scales): the layers' `past`, read as is.
        layers = [(values[2 * i], values[2 * i + 1], scales[2 * i], scales[2 * i + 1]) for i in range(half // 2)]
        logits, presents = self.model(input_ids, attention_mask, position_ids, layers)  # type: ignore[arg-type]
        return (logits, *(t for pair in presents for t in pair))


def example_inputs(model: Transformer, batch: int = 2, seq: int = 5, past: int = 3) -> tuple[Tensor, ...]:
    """Sizes > 1 everywhere so the exporter keeps every axis symbolic."""
    config = model.config
    dtype = model.token_embedding.weight.dtype
    spec = layer_cache_spec(config)
    # Distinct tensors per cache input: torch.export merges inputs that alias one tensor.
    past_kv = [
        torch.zeros(batch, spec.heads, past, spec.width, dtype=dtype) for _ in range(spec.per_layer * config.n_layers)
    ]
    return (
        torch.randint(0, 256, (batch, seq), dtype=torch.int64),
        torch.ones(batch, past + seq, dtype=torch.int64),
        torch.arange(past, past + seq, dtype=torch.int64).repeat(batch, 1),
        *past_kv,
    )


def int8_example_inputs(model: Transformer, batch: int = 2, seq: int = 5, past: int = 3) -> tuple[Tensor, ...]:
    """The int8 graph's: int8 past K/V and float32 scales (batch, heads, past, 1)."""
    ids, mask, positions, *past_kv = example_inputs(model, batch, seq, past)
    quantized = [torch.randint(-127, 128, t.shape, dtype=torch.int8) for t in past_kv]
    scales = [torch.rand(batch, model.config.n_heads, past, 1) for _ in past_kv]
    return (ids, mask, positions, *quantized, *scales)


def export_onnx(
    model: Transformer,
    path: Path,
    dtype: torch.dtype = torch.float32,
    new_only: bool = False,
    int8: bool = False,
    prompts: bool = False,
) -> onnx.ModelProto:
    """Export with the maintained (dynamo / torch.export) exporter into one self-contained file.

    `new_only` writes the serving graph: it reads the past from the engine's buffer in place
    and returns only the new tokens' K/V, so no cache is copied inside the graph. `int8` writes
    the int8 cache's serving graph (float32, new only; `Int8KeyValueModel`). `prompts` writes the
    serving graph in the form prompts want (prefill-up-projected, latent attention only) at opset
    PROMPT_OPSET, where PyTorch's fused attention becomes one ONNX `Attention` node a layer.
    """
    model = model.to(torch.float32 if int8 else dtype).eval()
    if new_only or int8 or prompts:
        model.return_new_key_values_only()
    if prompts:
        model.serve_prompts_in_place()
    n_layers, spec = model.config.n_layers, layer_cache_spec(model.config)
    if int8 and not spec.key_value:
        raise ValueError(f"{model.config.scheme}: its {spec.kind} cache has no int8 graph")
    args = int8_example_inputs(model) if int8 else example_inputs(model)
    wrapper = Int8KeyValueModel(model) if int8 else FlatKeyValueModel(model)
    batch, sequence, past, total = "batch", "sequence", "past_sequence", "total_sequence"
    kv_shape = {0: batch, 2: past}
    dynamic_shapes = (
        {0: batch, 1: sequence},
        {0: batch, 1: total},
        {0: batch, 1: sequence},
        tuple([kv_shape] * ((4 if int8 else spec.per_layer) * n_layers)),  # the *past varargs arrive as one tuple
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            wrapper,
            args,
            dynamo=True,
            input_names=input_names(n_layers, int8, spec.entries),
            output_names=output_names(n_layers, new_only or int8 or prompts, spec.entries),
            dynamic_shapes=dynamic_shapes,
            opset_version=PROMPT_OPSET if prompts else OPSET,
            optimize=True,
            verbose=False,
        )
    assert program is not None
    program.save(str(path), external_data=False)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    return proto
