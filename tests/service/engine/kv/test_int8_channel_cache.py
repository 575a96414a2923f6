"""The unbounded int8 cache read inside the attention kernel (contract/kv_int8.py's channel format,
the serving-fused-int8 graph): the number format against ONNX Runtime's own kernel, the store's
int8-channel rows (real bytes, writes, moves), the export's graph and scales, and the runner against
the PyTorch reference that quantizes the same way (models/streaming.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from contract.cache_policy import parse_cache_policy
from contract.graph import past_names
from contract.kv_int8 import quantize_channels
from contract.manifest import SERVING_FUSED_INT8, Manifest
from models.checkpoints import WEIGHTS_DIR
from models.streaming import stream_logprobs
from models.tokenizer import TOKENIZER
from models.transformer import Transformer
from service.engine.kv import INT8, INT8_CHANNEL, KVLayout, KVStore, TorchArrays
from service.engine.worker.runner import ModelRunner, StoreConfig

SCALES = np.random.default_rng(1).uniform(0.01, 0.05, size=(2, 2, 1, 8)).astype(np.float32)
LAYOUT = KVLayout(n_layers=1, n_heads=2, head_dim=8, dtype="float32", channel_scales=SCALES)


def kv(length: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(LAYOUT.tensors, LAYOUT.n_heads, length, LAYOUT.head_dim)).astype(np.float32) * 3


def test_the_channel_format_quantizes_as_the_kernel_does() -> None:
    """One GroupQueryAttention node with an int8 cache and per-channel scales writes the new token's
    K/V: the same int8 values as quantize_channels, ties to even, clipped to [-128, 127]."""
    heads, dim, past = 1, 8, 4
    f, i8 = TensorProto.FLOAT, TensorProto.INT8
    inputs = [
        *(helper.make_tensor_value_info(n, f, [1, 1, heads * dim]) for n in "qkv"),
        *(helper.make_tensor_value_info(n, i8, [1, heads, past, dim]) for n in ("pk", "pv")),
        helper.make_tensor_value_info("sl", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("tl", TensorProto.INT32, []),
        *(helper.make_tensor_value_info(n, f, [heads, 1, dim]) for n in ("ks", "vs")),
    ]
    node = helper.make_node(
        "GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sl", "tl", "", "", "", "", "", "ks", "vs"],
        ["o", "present_k", "present_v"], domain="com.microsoft", num_heads=heads, kv_num_heads=heads,
        k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8,
    )  # fmt: skip
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in (("o", f), ("present_k", i8), ("present_v", i8))]
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs), opset_imports=opsets, ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    scales = np.array([0.5, 1, 1, 1, 1, 1, 2, 0.01], dtype=np.float32).reshape(heads, 1, dim)
    new = np.array([-100.0, -128.4, -127.6, -127.5, 0.5, 1.5, 254.9, 300.0], dtype=np.float32).reshape(1, 1, dim)
    zeros = np.zeros((1, heads, past, dim), dtype=np.int8)
    _, key, _ = session.run(None, {
        "q": np.zeros_like(new), "k": new, "v": new, "pk": zeros, "pv": zeros, "sl": np.array([0], np.int32),
        "tl": np.array(1, np.int32), "ks": scales, "vs": scales,
    })  # fmt: skip
    expected = quantize_channels(new.reshape(heads, 1, dim), scales)[:, 0]
    assert np.array_equal(key[0, :, 0], expected)
    assert list(expected[0]) == [-128, -128, -128, -128, 0, 2, 127, 127]


def test_an_unbounded_int8_row_is_a_channel_row_of_a_quarter_of_the_bytes() -> None:
    store = KVStore(LAYOUT, 1 << 20, 16, 256)
    assert store.reserve("f", 10) and store.reserve("c", 10, parse_cache_policy("int8"))
    assert store.reserve("b", 10, parse_cache_policy("window:16+int8"))
    float_class, channel, per_token = store.classes[64], store.kinds[INT8_CHANNEL][64], store.kinds[INT8][64]
    assert channel.kind == INT8_CHANNEL and channel.arrays == [channel.cache] and channel.cache.dtype == np.int8
    assert LAYOUT.storage(INT8_CHANNEL).token_bytes * 4 == LAYOUT.token_bytes
    assert channel.nbytes == channel.cache.nbytes  # no scales travel with the rows
    assert store.physical_bytes == float_class.nbytes + channel.nbytes + per_token.nbytes
    assert KVLayout(1, 2, 8, "float32").kind_of(parse_cache_policy("int8")) == INT8  # no channel scales: per-token rows


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_channel_rows_quantize_writes_and_move_as_they_are(backend: str) -> None:
    arrays = TorchArrays("cpu") if backend == "torch" else None
    store = KVStore(LAYOUT, 1 << 20, 16, 256, arrays)
    host = (lambda a: a.numpy()) if arrays else (lambda a: a)
    upload = (lambda a: torch.from_numpy(a)) if arrays else (lambda a: a)
    prompt = kv(63)
    assert store.reserve("a", 64, parse_cache_policy("int8"))
    store.write("a", upload(prompt), 63)
    klass = store.kinds[INT8_CHANNEL][64]
    stored = host(klass.cache[:, 0, :, :63]).copy()
    assert np.array_equal(stored, quantize_channels(prompt, SCALES))
    assert stored.min() == -128 or stored.max() == 127  # values beyond the calibrated range are clipped
    assert store.reserve("a", 65)  # outgrew its row: moved with its int8 values as they are
    assert np.array_equal(host(store.kinds[INT8_CHANNEL][80].cache[:, 0, :, :63]), stored)


# ------------------------------------------------------------------------ the export and the runner


def test_the_export_carries_the_fused_int8_graph_and_its_scales(repository: Path) -> None:
    manifest = Manifest.load(repository / "rope")
    manifest.verify(SERVING_FUSED_INT8)
    scales = manifest.int8_channel_scales
    assert scales is not None and scales.shape == (2 * manifest.n_layers, manifest.n_heads, 1, manifest.head_dim)
    assert (scales > 0).all()
    graph = onnx.load(str(manifest.onnx_path(SERVING_FUSED_INT8))).graph
    types = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    assert {types[name] for name in past_names(manifest.n_layers)} == {TensorProto.INT8}
    kernels = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    assert len(kernels) == manifest.n_layers
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    assert np.array_equal(initializers[kernels[0].input[12]], scales[0])  # layer 0's K scales
    assert np.array_equal(initializers[kernels[0].input[13]], scales[1])


@pytest.mark.parametrize("scheme", ["alibi", "rope", "sinusoidal"])
def test_runner_scores_int8_in_the_kernel_as_the_reference_does(repository: Path, scheme: str) -> None:
    """Every token after the first through an int8-channel row and the fused int8 graph; the reference
    quantizes with the manifest's scales. Rounding ties aside (tests/service/engine/kv/test_int8_cache.py), the
    same numbers; and bits per byte within 1% of float32's."""
    manifest = Manifest.load(repository / scheme)
    runner = ModelRunner(manifest, StoreConfig(64 << 20, 16, 1024), threads=1)
    assert runner.layout.kind_of(parse_cache_policy("int8")) == INT8_CHANNEL
    ids = TOKENIZER.encode(Path(__file__).read_text())[:300]
    ours = runner.score(ids, parse_cache_policy("int8")).logprobs
    torch.set_num_threads(1)
    theirs = stream_logprobs(
        Transformer.load(WEIGHTS_DIR / scheme), ids, parse_cache_policy("int8"),
        int8_channel_scales=manifest.int8_channel_scales,
    )  # fmt: skip
    difference = np.abs(ours - theirs)
    assert np.mean(difference <= 1e-3) >= 0.75 and difference.max() < 0.05, np.sort(difference)[-10:]
    assert abs(ours.mean() / theirs.mean() - 1) <= 1e-3
    full = runner.score(ids, parse_cache_policy("full")).logprobs
    assert abs(ours.mean() / full.mean() - 1) < 0.01


def test_the_explicit_attention_mode_keeps_per_token_int8_rows(repository: Path) -> None:
    runner = ModelRunner(Manifest.load(repository / "rope"), StoreConfig(64 << 20, 16, 1024), threads=1,
                         attention="explicit")  # fmt: skip
    assert runner.layout.kind_of(parse_cache_policy("int8")) == INT8 and INT8_CHANNEL not in runner.graphs
