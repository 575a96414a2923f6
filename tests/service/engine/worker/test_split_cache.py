"""A hybrid's rows served with per-group caches (service/engine/kv/local.py): the fused graphs read the
local layers' window columns apart, and the served logits are PyTorch's, past the window, through
chunked prompts, shifts of the local columns, prefix-cache hits and speculative blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from contract.manifest import Manifest
from models.checkpoints import WEIGHTS_DIR
from models.tokenizer import TOKENIZER
from models.transformer import Transformer
from service.engine.kv import SlidingWindowSpec, SplitKV
from service.engine.kv.prefix import block_hashes
from service.engine.prompts.prompt import PromptRun
from service.engine.worker.runner import ModelRunner, StoreConfig
from tests.service.engine.prompt_calls import chunked

HYBRIDS = ("rnope-swa", "rope-swa")
TEXT = (
    "def load(path):\n    with open(path) as handle:\n        return [line.strip() for line in handle]\n\n"
    "class Cache(object):\n    def __init__(self, size):\n        self.size = size\n        self.items = {}\n\n"
)


TAIL = "import sys\nfor line in sys.stdin:\n    print(line)\n"


def prompt_of(tokens: int) -> list[int]:
    return TOKENIZER.encode(TEXT * (tokens // len(TEXT) + 1))[:tokens]


def runner_for(repository: Path, model: str, attention: str = "auto") -> ModelRunner:
    manifest = Manifest.load(repository / model)
    if manifest.local_cache is None:
        pytest.skip(f"{model}: an export from before per-group caches")
    return ModelRunner(manifest, StoreConfig(256 << 20, 16, 4096), "cpu", 1, "numpy", attention=attention)


@torch.no_grad()
def pytorch_logits(model: str, tokens: list[int]) -> np.ndarray:
    """Every position's logits of one PyTorch forward over the whole text (no cache)."""
    return Transformer.load(WEIGHTS_DIR / model).float().eval()(torch.tensor([tokens]))[0][0].numpy()


def greedy(runner: ModelRunner, rid: str, first: np.ndarray, steps: int) -> tuple[list[int], list[np.ndarray]]:
    """`steps` greedy tokens of a joined row, and the logits each was chosen from."""
    tokens, seen = [int(first.argmax())], [first]
    for _ in range(steps - 1):
        assert runner.store.reserve(rid, runner.store.length(rid) + 1)
        logits = runner.decode({rid: tokens[-1]})[rid]
        seen.append(logits)
        tokens.append(int(logits.argmax()))
    return tokens, seen


def test_hybrids_split_their_rows_where_the_fused_graphs_serve(repository: Path) -> None:
    runner = runner_for(repository, "rope-swa")
    local = runner.layout.local
    assert isinstance(local, SlidingWindowSpec) and local.layers == (0, 1, 2) and local.window == 64
    assert runner.layout.token_bytes * 4 == runner_for(repository, "rope-swa", "explicit").layout.token_bytes


@pytest.mark.parametrize("length", [300, 1000])
@pytest.mark.parametrize("model", HYBRIDS)
def test_greedy_tokens_and_logits_equal_pytorch_past_the_window(repository: Path, model: str, length: int) -> None:
    """A prompt in chunks of 128 (the local layers' buffer: window - 1 + 128 columns), then 200 steps:
    the local columns fill and shift back to the window, and every step's logits are PyTorch's."""
    runner = runner_for(repository, model)
    prompt = prompt_of(length)
    computed = chunked(runner, "r", prompt, chunk_tokens=128)
    assert computed is not None and isinstance(computed.cache, SplitKV)
    assert runner.layout.local is not None and computed.cache.local_kv.shape[2] <= runner.layout.local.width
    assert runner.store.reserve("r", length + 1)
    runner.join([computed])
    tokens, seen = greedy(runner, "r", computed.logits, 200)
    expected = pytorch_logits(model, prompt + tokens)[length - 1 :]
    np.testing.assert_allclose(np.stack(seen), expected[:200], atol=2e-3)
    assert tokens == [int(step.argmax()) for step in expected[:200]]


@pytest.mark.parametrize("model", HYBRIDS)
def test_a_prefix_hit_needs_only_the_local_window_before_it(repository: Path, model: str) -> None:
    """The prompt's blocks are kept (global K/V, and the local K/V of the last blocks); a repeat hits
    all its full blocks and computes only its tail, with the window before it: the whole prompt's logits."""
    runner = runner_for(repository, model)
    store, prompt = runner.store, prompt_of(700)
    whole = chunked(runner, "w", prompt, chunk_tokens=256)
    assert whole is not None
    extra = ("m", "full")
    hashes = block_hashes(prompt, 16, extra)
    assert store.cache_prompt(prompt, hashes, extra, whole.cache, "full") == len(hashes)
    past = store.cached_past(prompt, hashes, extra, len(prompt) - 1)
    assert past is not None and past.tokens == 688 and past.local_tokens == 63
    *_, [hit] = runner.prefill([PromptRun("h", prompt, past)], 256)
    assert hit is not None
    np.testing.assert_allclose(hit.logits, whole.logits, atol=1e-4)
    np.testing.assert_allclose(np.asarray(hit.cache.global_kv), np.asarray(whole.cache.global_kv), atol=1e-4)


@pytest.mark.parametrize("model", HYBRIDS)
def test_a_prefix_hit_whose_window_was_not_kept_recomputes_only_the_window(repository: Path, model: str) -> None:
    """A prompt that shares the first 500 tokens of a cached 1,000-token one: the cache kept the local K/V
    of that prompt's last blocks only, so the hit (496 tokens) takes the global K/V and recomputes the
    local window from the 189 tokens before it; the rest of the prompt then equals a fresh prefill."""
    runner = runner_for(repository, model)
    store, cached = runner.store, prompt_of(1000)
    extra = ("m", "full")
    first = chunked(runner, "c", cached, chunk_tokens=256)
    assert first is not None
    store.cache_prompt(cached, block_hashes(cached, 16, extra), extra, first.cache, "full")
    other = cached[:500] + TOKENIZER.encode(TAIL * 6)[1:]
    past = store.cached_past(other, block_hashes(other, 16, extra), extra, len(other) - 1)
    assert past is not None and past.tokens == 496 and past.repair == 189
    *_, [hit] = runner.prefill([PromptRun("h", other, past)], 128)
    fresh = chunked(runner, "f", other, chunk_tokens=128)
    assert hit is not None and fresh is not None
    np.testing.assert_allclose(hit.logits, fresh.logits, atol=1e-4)
    np.testing.assert_allclose(np.asarray(hit.cache.global_kv), np.asarray(fresh.cache.global_kv), atol=1e-4)
    window = np.asarray(hit.cache.local_kv)[:, :, -63:], np.asarray(fresh.cache.local_kv)[:, :, -63:]
    np.testing.assert_allclose(*window, atol=1e-4)  # what the next token's local layers attend to


@pytest.mark.parametrize("model", HYBRIDS)
def test_speculative_blocks_keep_what_plain_decoding_keeps(repository: Path, model: str) -> None:
    """Two rows of one class verify blocks in place (one fused prompt call each): right guesses
    and wrong ones; the rows' logits after each commit are plain decoding's, so nothing a rejected
    guess wrote stays in the local columns (they shift back to the window meanwhile)."""
    plain, spec = runner_for(repository, model), runner_for(repository, model)
    prompts = {"a": prompt_of(150), "b": prompt_of(90)}
    expected: dict[str, list[int]] = {}
    for runner in (plain, spec):
        for rid, prompt in prompts.items():
            computed = chunked(runner, rid, prompt, chunk_tokens=128)
            assert computed is not None and runner.store.reserve(rid, len(prompt) + 1)
            runner.join([computed])
            expected[rid] = [int(computed.logits.argmax())]
    for _ in range(120):  # plain: every row's greedy path
        for rid in prompts:
            assert plain.store.reserve(rid, plain.store.length(rid) + 1)
        logits = plain.decode({rid: path[-1] for rid, path in expected.items()})
        for rid, path in expected.items():
            path.append(int(logits[rid].argmax()))
    done = {rid: 0 for rid in prompts}  # tokens of the path each spec row holds
    for round_index in range(30):
        fed = {}
        for rid, path in expected.items():
            guesses = path[done[rid] + 1 : done[rid] + 4]
            if round_index % 2:  # a wrong second guess: only the first is kept
                guesses = [guesses[0], (guesses[1] + 1) % 256, guesses[2]]
            fed[rid] = [path[done[rid]], *guesses]
            assert spec.store.reserve(rid, spec.store.length(rid) + len(fed[rid]))
        ids = list(prompts)
        logits = dict(zip(ids, spec.verifier.verify(ids, [fed[rid] for rid in ids]), strict=True))
        kept = {}
        for rid in ids:
            predicted = logits[rid].argmax(-1)
            accepted = 1
            while accepted < len(fed[rid]) and fed[rid][accepted] == predicted[accepted - 1]:
                accepted += 1
            assert predicted[:accepted].tolist() == expected[rid][done[rid] + 1 : done[rid] + 1 + accepted]
            kept[rid] = accepted
            done[rid] += accepted
        spec.verifier.commit(kept)
    assert min(done.values()) > 60  # past the local columns' width: they shifted


@pytest.mark.parametrize("model", HYBRIDS)
def test_logits_continued_after_a_computed_prompt_are_the_whole_text_s(repository: Path, model: str) -> None:
    """`continue_logits` after a prompt's split K/V (as the reuse study scores an answer after it):
    the logits of the whole text's own chunks, past the local window."""
    runner = runner_for(repository, model)
    text = prompt_of(500)
    computed = chunked(runner, "p", text[:300], chunk_tokens=128)
    assert computed is not None and isinstance(computed.cache, SplitKV)
    past = SplitKV(computed.cache.global_kv[:, None], computed.cache.local_kv[:, None])
    rest = runner.continue_logits(text, 300, past, chunk_tokens=128)
    assert rest.shape == (200, runner.manifest.vocab_size)
    np.testing.assert_allclose(rest, runner.continue_logits(text, 0, None, chunk_tokens=128)[300:], atol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("model", HYBRIDS)
def test_a_long_text_is_scored_in_chunks_as_pytorch_scores_it(repository: Path, model: str) -> None:
    runner = runner_for(repository, model)
    text = prompt_of(1300)
    scored = runner.score(text)
    expected = torch.log_softmax(torch.from_numpy(pytorch_logits(model, text[:-1])).double(), -1).numpy()
    np.testing.assert_allclose(scored.logprobs, expected[np.arange(len(text) - 1), text[1:]], atol=1e-4)
    assert scored.greedy.tolist() == expected.argmax(-1).tolist()


@pytest.mark.parametrize("model", HYBRIDS)
def test_the_explicit_graphs_serve_a_hybrid_with_whole_rows(repository: Path, model: str) -> None:
    """`--attention explicit` (and a GPU) keep whole rows: the traced graphs read every layer at full
    width, the windows in their masks; PyTorch's logits all the same."""
    runner = runner_for(repository, model, "explicit")
    assert not runner.layout.split
    prompt = prompt_of(300)
    computed = chunked(runner, "r", prompt, chunk_tokens=128)
    assert computed is not None and runner.store.reserve("r", len(prompt) + 1)
    runner.join([computed])
    tokens, seen = greedy(runner, "r", computed.logits, 40)
    np.testing.assert_allclose(np.stack(seen), pytorch_logits(model, prompt + tokens)[299:339], atol=2e-3)
