"""The runner and its KV store against ONNX Runtime alone, on both array backends."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from contract.cache_policy import parse_cache_policy
from contract.graph import target_logprobs
from contract.manifest import PREFILL_FUSED, Manifest
from export.runtime import OnnxCausalLM
from models.tokenizer import TOKENIZER
from service.engine.prompts.prompt import PrefilledPrompt, PromptRun
from service.engine.worker.runner import ModelRunner, StoreConfig
from tests.service.engine.prompt_calls import batch, chunked

PROMPTS = {
    "a": TOKENIZER.encode("def f(x):\n"),
    "b": TOKENIZER.encode('class Parser(object):\n    """Parse things."""\n' * 2),
    "c": TOKENIZER.encode("import os\n"),
}


def lone_logits(repository: Path, model: str, prompt: list[int], steps: int) -> list[np.ndarray]:
    """Per-step logits of a lone greedy run (step 0 = after the prompt)."""
    _, logits = OnnxCausalLM(repository / model).greedy([prompt], steps)
    return [step[0] for step in logits]


def runner_for(repository: Path, model: str, backend: str = "numpy", attention: str = "auto") -> ModelRunner:
    store = StoreConfig(64 << 20, 16, 1024)
    return ModelRunner(Manifest.load(repository / model), store, "cpu", 1, backend, attention=attention)


# "torch" is the CUDA path's code (torch tensors bound by data pointer) run on the CPU.
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("model", ["alibi", "relative", "rope"])
def test_sequences_joining_moving_and_leaving_match_lone_runs(repository: Path, model: str, backend: str) -> None:
    runner = runner_for(repository, model, backend)
    store = runner.store
    expected = {rid: lone_logits(repository, model, prompt, 80) for rid, prompt in PROMPTS.items()}
    seen: dict[str, list[np.ndarray]] = {rid: [] for rid in PROMPTS}
    tokens: dict[str, int] = {}

    def record(results: dict[str, np.ndarray]) -> None:
        for rid, logits in results.items():
            seen[rid].append(logits)
            tokens[rid] = int(np.argmax(expected[rid][len(seen[rid]) - 1]))  # follow the lone run's path

    def joined(prompts: list[PrefilledPrompt]) -> None:
        for prompt in prompts:
            assert store.reserve(prompt.request_id, prompt.length + 1)
        runner.join(prompts)
        record({p.request_id: p.logits for p in prompts})

    def step() -> None:
        for rid in store.members():  # a full row moves to the next capacity class here
            assert store.reserve(rid, store.length(rid) + 1)
        record(runner.decode({rid: tokens[rid] for rid in store.members()}))

    joined(batch(runner, {"a": PROMPTS["a"]}))
    for _ in range(30):
        step()
    # "b" is computed in chunks, then "b" and "c" join together, into other classes than "a".
    b = chunked(runner, "b", PROMPTS["b"], chunk_tokens=20)
    assert b is not None
    step()
    joined([b, *batch(runner, {"c": PROMPTS["c"]})])
    assert len(list(store.batches())) == 2  # two graph calls per step from here
    for _ in range(30):
        step()
    store.free("a")
    for _ in range(15):
        step()
    assert sorted(store.members()) == ["b", "c"]
    for rid, logits in seen.items():
        assert len(logits) > 40
        for step_index, value in enumerate(logits):
            np.testing.assert_allclose(value, expected[rid][step_index], atol=1e-4, err_msg=f"{rid} step {step_index}")
    store.free("b")
    store.free("c")
    assert store.members() == [] and store.physical_bytes == 0


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_plan_held_across_steps_decodes_as_the_dict_path(repository: Path, backend: str) -> None:
    """The steady batch keeps one DecodePlan while the store holds still: its steps, over two
    classes and in the caller's order (not the store's), give each sequence the logits that
    stepping by id (a fresh plan each step) gives it."""
    held, fresh = runner_for(repository, "alibi", backend), runner_for(repository, "alibi", backend)
    for runner in (held, fresh):
        b = chunked(runner, "b", PROMPTS["b"], chunk_tokens=20)
        assert b is not None
        prompts = [b, *batch(runner, {"a": PROMPTS["a"], "c": PROMPTS["c"]})]
        for prompt in prompts:
            assert runner.store.reserve(prompt.request_id, prompt.length + 8)  # room for 8 steps
        runner.join(prompts)
    assert len(list(held.store.batches())) == 2
    ids = ["c", "b", "a"]
    plan = held.plan_decode(ids)
    tokens = [10, 20, 30]
    for _ in range(8):
        mine = np.array(held.decode_planned(plan, tokens))
        theirs = fresh.decode(dict(zip(ids, tokens, strict=True)))
        for row, sequence in enumerate(ids):
            np.testing.assert_allclose(mine[row], theirs[sequence], atol=1e-6, err_msg=sequence)
        tokens = [int(token) for token in mine.argmax(axis=1)]
    with pytest.raises(ValueError, match="every member of the store"):
        held.plan_decode(["a", "b"])


def test_torch_path_gives_the_numpy_path_s_greedy_tokens(repository: Path) -> None:
    """The GPU code path on the CPU: same greedy tokens, logits within 1e-4, for a batch that moves."""
    results = {}
    for backend in ("numpy", "torch"):
        runner = runner_for(repository, "alibi", backend)
        prompts = batch(runner, PROMPTS)
        for prompt in prompts:
            runner.store.reserve(prompt.request_id, prompt.length + 1)
        runner.join(prompts)
        tokens = {p.request_id: int(p.logits.argmax()) for p in prompts}
        trace: list[tuple[dict[str, int], dict[str, np.ndarray]]] = []
        for _ in range(70):
            for rid in runner.store.members():
                runner.store.reserve(rid, runner.store.length(rid) + 1)
            logits = runner.decode(tokens)
            tokens = {rid: int(value.argmax()) for rid, value in logits.items()}
            trace.append((tokens, logits))
        results[backend] = trace
    for (tokens, logits), (torch_tokens, torch_logits) in zip(results["numpy"], results["torch"], strict=True):
        assert tokens == torch_tokens
        for rid in logits:
            np.testing.assert_allclose(logits[rid], torch_logits[rid], atol=1e-4)


def test_batched_prompts_match_lone_prompts(repository: Path) -> None:
    """Left padding of a batched prefill is cut off: each row's cache is its lone cache."""
    runner = runner_for(repository, "rope")
    together = batch(runner, PROMPTS)
    for prompt in together:
        alone = batch(runner, {prompt.request_id: PROMPTS[prompt.request_id]})[0]
        assert prompt.cache.shape == alone.cache.shape == (8, 4, len(PROMPTS[prompt.request_id]), 32)
        np.testing.assert_allclose(prompt.logits, alone.logits, atol=1e-4)
        np.testing.assert_allclose(prompt.cache, alone.cache, atol=1e-4)


@pytest.mark.parametrize("attention", ["auto", "explicit"])
def test_logits_continued_after_a_computed_prompt_are_the_scored_text_s(repository: Path, attention: str) -> None:
    """`continue_logits` in chunks after a prompt's K/V: the log-probabilities and greedy tokens that
    scoring the whole text in one call gives from there on."""
    runner = runner_for(repository, "rope", attention=attention)
    text = PROMPTS["b"]
    computed = chunked(runner, "p", text[:20], chunk_tokens=20)
    assert computed is not None
    rest = runner.continue_logits(text, 20, computed.cache[:, None], chunk_tokens=8)
    scored = runner.score(text)
    np.testing.assert_allclose(target_logprobs(rest[:-1], text[21:]), scored.logprobs[20:], atol=1e-4)
    assert rest[:-1].argmax(-1).tolist() == scored.greedy[20:].tolist()


def test_aborted_chunked_prefill_returns_nothing(repository: Path) -> None:
    runner = runner_for(repository, "alibi")
    calls = iter([False, True])
    assert chunked(runner, "x", PROMPTS["b"], chunk_tokens=8, aborted=lambda: next(calls)) is None


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("model", ["sinusoidal", "learned", "relative", "rope", "alibi", "none"])
def test_fused_decode_equals_explicit_decode(repository: Path, model: str, backend: str) -> None:
    """The fused graph (its kernel writes the new K/V into the rows itself) against the explicit
    serving graph on the same rows: rows of three lengths that grow across capacity classes, logits
    within 1e-4 and the same greedy tokens at every step."""
    runs = {}
    for attention in ("fused", "explicit"):
        runner = runner_for(repository, model, backend, attention)
        prompts = batch(runner, PROMPTS)
        for prompt in prompts:
            runner.store.reserve(prompt.request_id, prompt.length + 1)
        runner.join(prompts)
        tokens = {p.request_id: int(p.logits.argmax()) for p in prompts}
        trace = []
        for _ in range(60):
            for rid in runner.store.members():  # full rows move to the next class here
                runner.store.reserve(rid, runner.store.length(rid) + 1)
            logits = runner.decode(tokens)
            tokens = {rid: int(value.argmax()) for rid, value in logits.items()}
            trace.append((tokens, logits))
        calls = list(runner.calls.by_class.values())
        assert calls and all((call.new_kv is None) == (attention == "fused") for call in calls)
        runs[attention] = trace
    for step, ((tokens, logits), (tokens_x, logits_x)) in enumerate(zip(runs["fused"], runs["explicit"], strict=True)):
        assert tokens == tokens_x, step
        for rid in logits:
            np.testing.assert_allclose(logits[rid], logits_x[rid], atol=1e-4, err_msg=f"{rid} step {step}")


def test_a_class_with_a_bounded_row_keeps_the_explicit_graph(repository: Path) -> None:
    """A window row cannot be shifted by the fused kernel: its class decodes through the explicit
    graph, a class of full rows beside it through the fused one; both give the lone runs' logits."""
    runner = runner_for(repository, "alibi", attention="fused")
    window = runner.layout.row_eviction(parse_cache_policy("window:64"))
    prompts = batch(runner, {"a": PROMPTS["a"], "c": PROMPTS["c"]})
    runner.store.reserve("a", prompts[0].length + 1)
    runner.store.reserve("c", 65)  # a row of the next class (80 tokens), apart from "a"
    prompts[1].policy = window
    runner.join(prompts)
    expected = {rid: lone_logits(repository, "alibi", PROMPTS[rid], 8) for rid in ("a", "c")}
    tokens = {p.request_id: int(p.logits.argmax()) for p in prompts}
    for step in range(1, 8):
        runner.store.reserve("a", runner.store.length("a") + 1)
        logits = runner.decode(tokens)
        for rid, value in logits.items():
            np.testing.assert_allclose(value, expected[rid][step], atol=1e-4, err_msg=f"{rid} step {step}")
        tokens = {rid: int(np.argmax(expected[rid][step])) for rid in logits}
    fused = {key: call.new_kv is None for key, call in runner.calls.by_class.items()}
    assert sorted(fused.values()) == [False, True], fused


def test_attention_mode_is_checked(repository: Path) -> None:
    with pytest.raises(ValueError, match="attention must be one of auto, fused, explicit"):
        runner_for(repository, "alibi", attention="flash")


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("model", ["alibi", "relative", "rope", "sinusoidal"])
def test_the_fused_prompt_graph_equals_the_explicit_one(repository: Path, model: str, backend: str) -> None:
    """prefill-fused (right-padded batches, the whole cache back from each chunk) against the explicit
    serving graph: the same last logits and caches for a batch of prompts and for a chunked prompt."""
    if PREFILL_FUSED not in Manifest.load(repository / model).data["variants"]:  # type: ignore[operator]
        pytest.skip("an export without the fused prompt graph")
    runs = {}
    for attention in ("auto", "explicit"):
        runner = runner_for(repository, model, backend, attention)
        assert (runner.prompt_variant is None) == (attention == "explicit")
        runs[attention] = [*batch(runner, PROMPTS), chunked(runner, "b", PROMPTS["b"], chunk_tokens=20)]
    for fused, explicit in zip(runs["auto"], runs["explicit"], strict=True):
        assert fused.length == explicit.length and fused.request_id == explicit.request_id
        np.testing.assert_allclose(fused.logits, explicit.logits, atol=1e-4)
        np.testing.assert_allclose(np.asarray(fused.cache), np.asarray(explicit.cache), atol=1e-4)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("model", ["alibi", "relative", "rope", "none"])
def test_a_prefix_cache_hit_computed_in_place_equals_the_whole_prompt(
    repository: Path, model: str, backend: str
) -> None:
    """A hit's rest through the fused prompt graph with the cached blocks assembled in place
    (past and present one array: the kernel reads the past where it lies) gives the whole prompt's
    last logits and cache, with the session's arena holding earlier calls' regions and after it
    was released."""
    from service.engine.kv.prefix import CachedPast

    runner = runner_for(repository, model, backend)
    if runner.prompt_variant is None:
        pytest.skip("an export without the fused prompt graph")
    prompt = PROMPTS["b"] * 3
    whole = chunked(runner, "w", prompt, chunk_tokens=512)
    cache = np.asarray(whole.cache)  # (2L, heads, T, hd)
    for release in (False, True):  # with the arena holding the last call's regions, and released
        if release:
            runner.prompt_sessions.release()
        for cached in (16, 64):
            blocks = [runner.backend.upload(cache[:, :, start : start + 16]) for start in range(0, cached, 16)]
            *_, [hit] = runner.prefill([PromptRun("h", prompt, CachedPast(blocks, runner.backend, "float32"))], 512)
            assert hit is not None and hit.length == len(prompt)
            np.testing.assert_allclose(hit.logits, whole.logits, atol=1e-4)
            np.testing.assert_allclose(np.asarray(hit.cache), cache, atol=1e-4)


def test_only_a_process_that_opts_in_flushes_denormals_and_there_every_graph_thread_does(repository: Path) -> None:
    """ALiBi's far scores underflow into denormal floats, whose slow path took most of its attention
    kernel: the engine core (and the bench) opt in, and then every thread that runs a graph sets
    flush-to-zero and denormals-are-zero (MXCSR) for itself. The flags are process state (Hypothesis
    refuses to run without subnormals: CI once failed on it), so a process that only builds runners,
    as this test process does, keeps IEEE behaviour."""
    import subprocess
    import sys
    import textwrap

    from service.engine.worker.denormals import DENORMALS_ARE_ZERO, FLUSH_TO_ZERO, mxcsr

    both = FLUSH_TO_ZERO | DENORMALS_ARE_ZERO
    if mxcsr() is None:
        pytest.skip("MXCSR is read through glibc on x86-64 Linux only")
    batch(runner_for(repository, "alibi"), {"a": PROMPTS["a"]})  # this process: not opted in
    assert mxcsr() & both == 0  # type: ignore[operator]
    script = textwrap.dedent(
        f"""
        import threading
        from pathlib import Path
        from contract.manifest import Manifest
        from service.engine.worker import denormals
        from service.engine.prompts.prompt import PromptRun
        from service.engine.worker.runner import ModelRunner, StoreConfig
        denormals.enable()
        manifest = Manifest.load(Path({str(repository / "alibi")!r}))
        runner = ModelRunner(manifest, StoreConfig(64 << 20, 16, 1024), "cpu", 1)
        seen = []
        def work():
            list(runner.prefill([PromptRun("a", [100, 101, 102])], 3))
            seen.append(denormals.mxcsr())
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        print(seen[0])
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert int(done.stdout.split()[-1]) & both == both
