"""Further training seeds of a scheme (issue 55): found in the weights, exported beside the served
models as `<scheme>@seed<N>`, served only when named, and named through every front door (gRPC,
HTTP, /metrics labels) like any model."""

from __future__ import annotations

from pathlib import Path

import httpx

from contract.manifest import Manifest
from contract.names import SeedModel, seed_model_name
from export.__main__ import parse_args
from export.repository import GRAPH_FILES, ExportOptions, export_progress, model_variants, plan
from export.sources import extra_seeds
from service.api import generation_pb2 as pb
from service.process import ServerProcess
from tests.standins import linked_weights


def test_a_seed_model_name_splits_into_scheme_and_seed() -> None:
    assert seed_model_name("rope", 2) == "rope@seed2"
    assert SeedModel.parse("rope@seed2") == SeedModel("rope", 2)
    assert SeedModel.parse("rnope-swa@seed13") == SeedModel("rnope-swa", 13)
    assert SeedModel.parse("rope") == SeedModel("rope", None)
    assert SeedModel.parse("rope-ntk-x4") == SeedModel("rope-ntk-x4", None)
    assert SeedModel.parse("rope@seedx") == SeedModel("rope@seedx", None)


def test_seed_folders_are_found_for_the_schemes_asked_only(tmp_path: Path) -> None:
    weights = linked_weights(tmp_path, ("alibi", "rope"))
    for seed, scheme in ((3, "rope"), (2, "alibi"), (2, "rope"), (3, "none")):
        folder = weights / f"seed{seed}" / scheme
        folder.mkdir(parents=True)
        (folder / "model.safetensors").touch()
    (weights / "seed4" / "rope").mkdir(parents=True)  # a run still training: no weights yet
    (weights / "seeds" / "rope").mkdir(parents=True)
    found = extra_seeds(weights, ("rope", "alibi"))
    assert [spec.name for spec in found] == ["rope@seed2", "alibi@seed2", "rope@seed3"]
    assert found[0].weights == weights / "seed2" / "rope" and found[0].scheme == "rope"
    options = ExportOptions(weights=weights, schemes=("alibi", "rope"), extra_seeds=True)
    assert [spec.name for spec in model_variants(options)] == [
        "alibi", "rope", "alibi@seed2", "rope@seed2", "rope@seed3"
    ]  # fmt: skip
    assert [spec.name for spec in model_variants(ExportOptions(weights=weights))] == [
        "rope", "alibi"
    ]  # by default the served seeds only, in SCHEMES order: the schemes with weights  # fmt: skip
    only = ExportOptions(weights=weights, schemes=("alibi", "rope"), names=("rope@seed3",), extra_seeds=True)
    assert [spec.name for spec in model_variants(only)] == ["rope@seed3"]


def test_a_seed_exports_beside_the_served_model_with_its_seed_recorded(seeded_repository: Path) -> None:
    served, seeded = Manifest.load(seeded_repository / "alibi"), Manifest.load(seeded_repository / "alibi@seed2")
    seeded.verify_all()
    assert (seeded.name, seeded.scheme, seeded.training_seed) == ("alibi@seed2", "alibi", 2)
    assert (served.training_seed, served.is_extra_seed, served.served_by_default) == (1234, False, True)
    assert seeded.is_extra_seed and not seeded.served_by_default and not seeded.is_scaling_variant
    assert seeded.variant("float32")["sha256"] != served.variant("float32")["sha256"]


def test_a_seed_is_served_only_when_named_and_named_everywhere(seeded_repository: Path) -> None:
    default = ServerProcess(seeded_repository).wait_serving()
    try:
        assert [m.name for m in default.stub.ListModels(pb.ListModelsRequest(), timeout=10).models] == ["alibi"]
        assert "not serving further training seeds alibi@seed2" in default.output()
    finally:
        default.stop()
    named = ServerProcess(seeded_repository, "--models", "alibi", "alibi@seed2").wait_serving()
    try:
        assert [m.name for m in named.stub.ListModels(pb.ListModelsRequest(), timeout=10).models] == [
            "alibi", "alibi@seed2"
        ]  # fmt: skip
        scores = {
            model: named.stub.Score(pb.ScoreRequest(model=model, text="def main():\n    return 0\n"), timeout=60)
            for model in ("alibi", "alibi@seed2")
        }
        assert scores["alibi"].total_logprob != scores["alibi@seed2"].total_logprob  # another checkpoint
        request = pb.GenerateRequest(model="alibi@seed2", prompt="def main():\n", max_new_tokens=4)
        assert named.stub.Generate(request, timeout=60).usage.completion_tokens == 4
        body = {"model": "alibi@seed2", "prompt": "import os\n", "max_tokens": 8, "temperature": 0}
        response = httpx.post(f"{named.http_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["model"] == "alibi@seed2"
        models = httpx.get(f"{named.http_url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["alibi", "alibi@seed2"]
        assert named.metric("posenc_requests_total", model="alibi@seed2", scheme="alibi", method="Generate",
                            code="OK") == 1  # fmt: skip
    finally:
        named.stop()


def test_the_export_command_exports_further_seeds_only_when_asked() -> None:
    """A first run exports one model a scheme (the demo and `compare --quick` use no other);
    `--seeds` adds every further seed, and `compare` exports the seeds it scores itself."""
    assert parse_args([]).extra_seeds is False
    assert parse_args(["--seeds"]).extra_seeds is True
    assert parse_args(["--no-extra-seeds"]).extra_seeds is False


def test_the_export_says_what_it_does_and_its_bar_counts_graphs(tmp_path: Path) -> None:
    """The bar moves as each graph file lands, not once per model (which took minutes here)."""
    weights = linked_weights(tmp_path, ("alibi", "rope"))
    options = ExportOptions(weights=weights, out=tmp_path / "out", graphs=("serving-float32",), workers=2)
    assert plan(options).startswith("exporting 2 models (rope, alibi) in 2 processes: 2 graphs each")
    progress = export_progress(options.out, dict.fromkeys(["rope", "alibi"], options.graph_variants()), verify=True)
    with progress.bar:
        assert progress.bar.total == 2 * 2 + 2
        (options.out / "rope").mkdir(parents=True)
        (options.out / "rope" / GRAPH_FILES["float32"]).touch()
        progress.refresh()
        assert progress.bar.n == 1
        progress.check()
        assert progress.bar.n == 2
