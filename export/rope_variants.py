"""Rope scaling variants derived from the exported base rope graphs, without tracing again.

A linear, NTK or YaRN variant computes exactly what the base graph computes except for two
constants: the inverse frequencies that multiply the positions, and YaRN's attention factor, which
multiplies cos and sin (`models.positional.rope_angles`). Tracing a model costs seconds per graph;
rewriting those constants in the saved graph costs milliseconds, so every variant of every graph
the base has (float32, serving, float16, int8) is derived this way. tests/export/test_rope_variants.py
holds each derived graph to a traced one and to PyTorch.
"""

from __future__ import annotations

import copy
from collections import deque
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from contract.manifest import GENAI_CONFIG, MANIFEST, Manifest
from export.manifest import build_manifest, genai_config, write_json
from models.config import ModelConfig, RopeScaling
from models.positional import rope_inverse_frequencies

# What copies over from the base manifest unchanged (besides what build_manifest recomputes).
_BASE_EXTRAS = ("parameters", "training", "int8_channel_scales")  # the scales: the base model's calibration
_ROTATIONS = ("Cos", "Sin")


class RopeRewriteError(ValueError):
    """A base graph in which the rotary constants cannot be found unambiguously."""


def rotary_constants(config: ModelConfig) -> tuple[np.ndarray, float]:
    """(inverse frequencies [head_dim/2] float32, attention factor) of the config's rope variant."""
    inv_freq, factor = rope_inverse_frequencies(
        config.head_dim, config.rope_base, config.rope_scaling, config.rope_rotary_dims
    )
    return inv_freq.numpy().astype(np.float32), float(factor)


def _unique_name(graph: onnx.GraphProto, stem: str) -> str:
    taken = {i.name for i in graph.initializer} | {o for n in graph.node for o in n.output}
    taken |= {i.name for i in graph.input}
    name, k = stem, 0
    while name in taken:
        k += 1
        name = f"{stem}_{k}"
    return name


def _frequency_initializer(graph: onnx.GraphProto, base_inv_freq: np.ndarray) -> onnx.TensorProto:
    """The one initializer holding the base inverse frequencies (matched by value: names are the exporter's)."""
    matches = [
        init
        for init in graph.initializer
        if tuple(init.dims) == base_inv_freq.shape
        and init.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
        and np.array_equal(numpy_helper.to_array(init).astype(np.float32), base_inv_freq)
    ]
    if len(matches) != 1:
        raise RopeRewriteError(f"expected one initializer equal to the base inverse frequencies, found {len(matches)}")
    return matches[0]


def _rotation_nodes(graph: onnx.GraphProto, source: str) -> list[onnx.NodeProto]:
    """Cos and Sin nodes fed (through any ops) by `source`: where the angles become cos and sin."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    found, seen, queue = [], {source}, deque([source])
    while queue:
        for node in consumers.get(queue.popleft(), []):
            if node.op_type in _ROTATIONS:
                found.append(node)
                continue
            for out in node.output:
                if out not in seen:
                    seen.add(out)
                    queue.append(out)
    if sorted({n.op_type for n in found}) != sorted(_ROTATIONS):
        raise RopeRewriteError(f"the inverse frequencies reach {[n.op_type for n in found]}, not one Cos and one Sin")
    return found


def _factor_constant(graph: onnx.GraphProto, factor: float, dtype: int, stem: str) -> str:
    """A new scalar initializer holding `factor` in `dtype`; returns its name."""
    name = _unique_name(graph, stem)
    graph.initializer.append(
        numpy_helper.from_array(np.array(factor, dtype=helper.tensor_dtype_to_np_dtype(dtype)), name)
    )
    return name


def _set_factor(graph: onnx.GraphProto, node: onnx.NodeProto, base_factor: float, factor: float, dtype: int) -> None:
    """Make `node` (Cos or Sin) come out multiplied by `factor` instead of `base_factor`.

    A base without a factor (1.0) gets a Mul inserted after the node, whose consumers then read the
    product under the old name; a base with one has that Mul's scalar replaced.
    """
    output = node.output[0]
    constant = _factor_constant(graph, factor, dtype, f"{output}_attention_factor")
    if base_factor == 1.0:
        raw = _unique_name(graph, f"{output}_unscaled")
        node.output[0] = raw
        index = list(graph.node).index(node)
        graph.node.insert(index + 1, helper.make_node("Mul", [raw, constant], [output], name=f"{output}_scale"))
        return
    initializers = {i.name: i for i in graph.initializer}
    for consumer in graph.node:
        if consumer.op_type != "Mul" or output not in consumer.input:
            continue
        for k, name in enumerate(consumer.input):
            if name in initializers and np.allclose(numpy_helper.to_array(initializers[name]), base_factor):
                consumer.input[k] = constant
                return
    raise RopeRewriteError(f"no Mul by the base attention factor {base_factor} after {node.op_type}")


def derive_graph(proto: onnx.ModelProto, base: ModelConfig, target: ModelConfig) -> onnx.ModelProto:
    """A copy of a base rope graph with `target`'s inverse frequencies and attention factor.

    Frequencies of unrotated pairs (partial rotary) are zero in base and target alike; a target
    that would rotate other pairs than the base is refused.
    """
    base_inv_freq, base_factor = rotary_constants(base)
    inv_freq, factor = rotary_constants(target)
    if not np.array_equal(inv_freq == 0, base_inv_freq == 0):
        raise RopeRewriteError("base and target rotate different pairs (rope_rotary_dims differ)")
    derived = onnx.ModelProto()
    derived.CopyFrom(proto)
    graph = derived.graph
    frequencies = _frequency_initializer(graph, base_inv_freq)
    dtype = frequencies.data_type
    frequencies.CopyFrom(
        numpy_helper.from_array(inv_freq.astype(helper.tensor_dtype_to_np_dtype(dtype)), frequencies.name)
    )
    if factor != base_factor:
        for node in _rotation_nodes(graph, frequencies.name):
            _set_factor(graph, node, base_factor, factor, dtype)
    return derived


def derive_rope_variant(
    base_folder: Path, out_folder: Path, name: str, base: ModelConfig, scaling: RopeScaling, variants: tuple[str, ...]
) -> dict[str, Path]:
    """Write `name` (base's config with `scaling`) from the base model's graphs; returns its graphs.

    `variants` must all be in the base manifest, whose hashes are checked before anything is read.
    """
    manifest = Manifest.load(base_folder)
    missing = [v for v in variants if v not in manifest.data["variants"]]  # type: ignore[operator]
    if missing:
        raise SystemExit(
            f"{base_folder / MANIFEST}: the base rope model has no {', '.join(missing)} graph to derive {name} from; "
            "export rope again with those graphs"
        )
    target = copy.deepcopy(base)
    target.rope_scaling = RopeScaling(scaling.kind, scaling.factor, base.train_context)
    out_folder.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for variant in variants:
        source = manifest.verify(variant)
        derived = derive_graph(onnx.load(str(source)), base, target)
        onnx.checker.check_model(derived, full_check=True)
        paths[variant] = out_folder / source.name
        onnx.save(derived, str(paths[variant]))
    data = manifest.data
    extra = {key: data[key] for key in _BASE_EXTRAS if key in data}
    extra["derived_from"] = {"model": manifest.name, "sha256": manifest.variant("float32")["sha256"]}
    document = build_manifest(name, target, paths, int(data["opset"]), dict(data["versions"]), extra)  # type: ignore[call-overload,arg-type]
    write_json(out_folder / MANIFEST, document)
    write_json(out_folder / GENAI_CONFIG, genai_config(target, paths["float32"].name))
    return paths
