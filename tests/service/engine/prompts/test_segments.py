"""Reusable prompt segments: placing K/V computed at position 0 at another offset, and the service's
segments end to end (real server on loopback)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from contract.manifest import REUSE_AS_IS, REUSE_RECOMPUTE, REUSE_ROTATE, Manifest
from models.checkpoints import trained_schemes
from models.positional import SCHEMES, build_positional, matched_config
from models.tokenizer import TOKENIZER
from service.api import generation_pb2 as pb
from service.engine.messages import PromptSegment
from service.engine.processing.input_processor import segment_spans
from service.engine.prompts.segments import SegmentAssembly
from service.engine.worker.runner import ModelRunner, StoreConfig
from service.process import ServerProcess

DOCUMENT = "def area(radius):\n    return 3.14159 * radius * radius\n"  # 55 bytes
QUESTION = "\n\n# the function above computes the area of a"


def test_each_scheme_declares_what_reuse_at_another_offset_needs(repository: Path) -> None:
    """The declaration lives with the scheme (models.positional) and reaches the service through the manifest."""
    expected = {"rope": REUSE_ROTATE, "sinusoidal": REUSE_RECOMPUTE, "learned": REUSE_RECOMPUTE}
    expected |= {"rnope-swa": REUSE_ROTATE, "rope-swa": REUSE_ROTATE}  # their local layers' keys are rotated
    expected |= {"mla": REUSE_ROTATE}  # only its decoupled rotated key; the latent carries no position
    for scheme in SCHEMES:
        mode = expected.get(scheme, REUSE_AS_IS)
        assert build_positional(matched_config(scheme)).segment_reuse == mode
        if not (repository / scheme).is_dir():
            continue  # a scheme whose weights are not shipped yet
        reuse = Manifest.load(repository / scheme).segment_reuse
        assert reuse.mode == mode
        assert (reuse.rotary_inv_freq is not None) == (mode == REUSE_ROTATE)


def test_segment_spans_are_token_ranges_after_bos() -> None:
    segments = (PromptSegment("ab"), PromptSegment("cde", True), PromptSegment("é", True), PromptSegment("", True))
    assert segment_spans(segments, add_bos=True) == ((3, 6), (6, 8))  # é is two bytes; empty ones are skipped
    assert segment_spans(segments, add_bos=False) == ((2, 5), (5, 7))


# Both the prompt graph and the rotation compute their angles in float64 (a float32 angle strays in
# proportion to the position: 4e-5 x |key| at 300 when the graph's were float32).
@pytest.mark.parametrize("offset", [1, 37, 64, 300, 1000])
def test_rope_keys_cached_at_zero_and_rotated_to_p_equal_a_fresh_prefill_at_p(repository: Path, offset: int) -> None:
    tolerance = 1e-5
    manifest = Manifest.load(repository / "rope")
    runner = ModelRunner(manifest, StoreConfig(64 << 20, 16, 1024), "cpu", threads=1)
    ids = np.asarray([TOKENIZER.encode(DOCUMENT)[1:]], dtype=np.int64)  # the document alone, no BOS
    length = ids.shape[1]
    mask = np.ones_like(ids)
    _, at_zero = runner._prompt_call(ids, mask, np.arange(length)[None], None, last_only=True)
    _, at_offset = runner._prompt_call(ids, mask, np.arange(offset, offset + length)[None], None, last_only=True)
    placed = SegmentAssembly(runner, manifest.segment_reuse, 512).placed(at_zero[:, 0], offset)
    np.testing.assert_allclose(placed[0::2], at_offset[0::2, 0], rtol=0, atol=tolerance)  # keys, every layer
    np.testing.assert_allclose(placed[1::2], at_offset[1::2, 0], rtol=0, atol=tolerance)  # values: no position
    assert np.abs(at_zero[0::2] - at_offset[0::2]).max() > 1e-2  # the rotation mattered


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(repository).wait_serving()
    yield process
    process.stop()


def segmented(model: str, prefix: str, repair: int = 0) -> pb.GenerateRequest:
    segments = [
        pb.PromptSegment(text=prefix),
        pb.PromptSegment(text=DOCUMENT, reusable=True),
        pb.PromptSegment(text=QUESTION),
    ]
    return pb.GenerateRequest(model=model, segments=segments, max_new_tokens=24, segment_repair_tokens=repair)


@pytest.mark.parametrize("scheme", trained_schemes())  # the served ones (mla: test_latent_serving.py)
def test_a_segment_is_reused_behind_another_prefix_where_the_scheme_allows(server: ServerProcess, scheme: str) -> None:
    info = {m.name: m for m in server.stub.ListModels(pb.ListModelsRequest(), timeout=10).models}[scheme]
    reusable = info.segment_reuse != REUSE_RECOMPUTE
    plain = pb.GenerateRequest(model=scheme, prompt="# first\n" + DOCUMENT + QUESTION, max_new_tokens=24)
    first = server.stub.Generate(segmented(scheme, "# first\n"), timeout=60)
    assert first.usage.prompt_tokens == len("# first\n" + DOCUMENT + QUESTION) + 1
    # Its K/V was computed on its own, then placed: reused from the start, where the scheme allows.
    assert first.usage.reused_prompt_tokens == (len(DOCUMENT) if reusable else 0)
    later = server.stub.Generate(segmented(scheme, "# a longer, different prefix\n"), timeout=60)
    assert later.usage.reused_prompt_tokens == (len(DOCUMENT) if reusable else 0)
    repaired = server.stub.Generate(segmented(scheme, "# first\n", repair=4), timeout=60)
    assert repaired.usage.reused_prompt_tokens == (len(DOCUMENT) - 4 if reusable else 0)
    # Repairing every token recomputes the whole segment in context: the plain prompt's tokens.
    whole = server.stub.Generate(segmented(scheme, "# first\n", repair=len(DOCUMENT)), timeout=60)
    assert whole.usage.reused_prompt_tokens == 0
    assert whole.text == server.stub.Generate(plain, timeout=60).text
    if not reusable:  # computed in place: exactly the plain prompt
        assert first.text == whole.text


def test_prompt_and_segments_together_are_invalid(server: ServerProcess) -> None:
    import grpc

    request = segmented("alibi", "x")
    request.prompt = "y"
    with pytest.raises(grpc.RpcError) as error:
        server.stub.Generate(request, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "segments" in error.value.details()
