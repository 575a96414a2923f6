"""Weight-only int8 / int4 forms (export/weight_only.py): every graph rewritten with MatMulNBits, a
manifest the service accepts, logits near the float32 model's; on a copy of the tiny rope model."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx

from contract.manifest import Manifest
from export.weight_only import derive_weight_only, logit_differences
from service.api import generation_pb2 as pb
from service.process import ServerProcess


def test_int4_rewrites_every_graph_and_is_served_near_float32(repository: Path, tmp_path: Path) -> None:
    source = tmp_path / "rope"
    shutil.copytree(repository / "rope", source)
    folder = derive_weight_only(source, 4)
    manifest = Manifest.load(folder)
    manifest.verify_all()
    assert (manifest.name, manifest.data["weight_only"]["bits"]) == ("rope-int4", 4)
    for variant in manifest.data["variants"]:
        graph = onnx.load(str(manifest.onnx_path(variant)), load_external_data=False).graph
        weights = {init.name for init in graph.initializer}
        assert any(node.op_type == "MatMulNBits" for node in graph.node), variant
        assert not [n.name for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights], variant
        size, before = manifest.onnx_path(variant).stat().st_size, (source / manifest.variant(variant)["file"]).stat()
        assert size < 0.5 * before.st_size, variant
    largest, mean, scale = logit_differences(source, folder, windows=1, context=64)
    assert 0 < mean < largest < 2.0 and mean < 0.1 * scale
    server = ServerProcess(tmp_path, "--models", "rope-int4").wait_serving()
    try:
        request = pb.GenerateRequest(model="rope-int4", prompt="def main():\n", max_new_tokens=8, ignore_eos=True)
        assert server.stub.Generate(request, timeout=60).usage.completion_tokens == 8
    finally:
        server.stop()
