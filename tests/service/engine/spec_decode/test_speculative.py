"""Speculative decoding: the same tokens as without it (greedy and seeded sampling), the sampled
distribution unchanged, the store exact after rejected guesses under every cache policy, no leak
after cancellations, and its settings' limits. In-process engines and runners on the exported
graphs, and the real server for the gRPC field and the cancellation storm."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from contract.cache_policy import parse_cache_policy
from contract.manifest import Manifest
from models.tokenizer import TOKENIZER
from service.api import generation_pb2 as pb
from service.engine.engine import Engine
from service.engine.kv import INT8_CHANNEL
from service.engine.messages import EngineConfig, GenerateInput
from service.engine.request import Request, SamplingParams
from service.engine.spec_decode.draft import MIN_GUESSES, PAUSE_STEPS, DraftState, draft_room
from service.engine.spec_decode.ngram import NgramProposer
from service.engine.spec_decode.proposer import make_proposer
from service.engine.spec_decode.speculator import accepted_prefix
from service.engine.worker.runner import ModelRunner, StoreConfig
from service.metrics import ServiceMetrics
from service.process import ServerProcess, wait_for
from service.server_config import parse_config
from tests.service.engine.prompt_calls import chunked

SCHEMES = ["alibi", "learned", "none", "relative", "rope", "sinusoidal"]
POLICIES = ["full", "window:64", "sinks:4+window:60+int8", "int8"]
# Code that repeats itself: the n-gram proposer finds its lines again (and a short prompt lets the
# bounded policies' windows fill while the request runs, so they verify blocks and then stop).
PROMPT = "for i in x:\n    f(i)\nfor j in x:\n    f(j)\n"


def test_ngram_proposer_guesses_what_followed_the_latest_earlier_occurrence() -> None:
    proposer = NgramProposer(min_n=2, max_n=4)
    history = bytearray(b"abcdXabcdYabc")
    assert bytes(proposer.propose(history, 3)) == b"dYa"  # "abc" last seen before the end at 5: "dYa" follows
    assert proposer.propose(bytearray(b"abcdefg"), 3) == []  # no suffix occurred before
    assert bytes(proposer.propose(bytearray(b"xyxyxy"), 8)) == b"xyxyxyxy"  # the period found runs on
    assert bytes(proposer.propose(bytearray(b"ab    "), 3)) == b"   "  # a run of spaces goes on
    assert bytes(proposer.propose(bytearray(b"abcab"), 4)) == b"cabc"  # "ab" seen at 0: "c" then "ab" again
    state = DraftState()
    state.sync([ord("c")], [TOKENIZER.bos_token_id, ord("a"), ord("b")])
    assert bytes(state.history) == b"\x00abc"
    state.sync([ord("c"), ord("d")], [TOKENIZER.bos_token_id, ord("a"), ord("b")])
    assert bytes(state.history) == b"\x00abcd"
    for _ in range(12):  # guesses never kept: drafting pauses
        state.record(4, 0)
    assert state.paused > 0


def test_the_back_off_sizes_blocks_by_how_they_fared_and_pauses_where_guessing_does_not_pay() -> None:
    """A block kept whole doubles the next (to 16), one cut short halves it (to MIN_GUESSES); a run of
    verifications that cost more plain steps than they gave pauses guessing, and a paused request
    reserves no room for guesses, until the pause ends."""
    request = Request("r", "m", [256, 97], SamplingParams(max_new_tokens=100, speculative_tokens=16), 257)
    draft = request.draft
    assert draft is not None and draft.cap == 16 and request.lookahead == 16
    assert not draft.record(16, 12)  # cut short: 8 next, and 13 tokens for about 3.5 steps' cost pays
    assert (draft.cap, draft.paused, request.lookahead) == (8, 0, 8)
    assert draft.record(8, 8)  # kept whole: 16 next, more room than before
    assert draft.cap == 16
    assert not draft.record(16, 0)  # 1 token for about 3.5 steps: halved, the earlier gains still count
    assert (draft.cap, draft.paused) == (8, 0)
    misses = 1
    while not draft.paused:  # more of the same: the running gain falls below zero
        draft.record(draft.cap, 0)
        misses += 1
    assert misses <= 4 and draft.paused == PAUSE_STEPS and draft.cap == MIN_GUESSES and request.lookahead == 0
    assert [draft.tick() for _ in range(PAUSE_STEPS)] == [False] * (PAUSE_STEPS - 1) + [True]
    assert request.lookahead == MIN_GUESSES
    draft.record(4, 0)
    assert draft.paused == 2 * PAUSE_STEPS  # each pause twice the last
    plain = Request("p", "m", [256, 97], SamplingParams(max_new_tokens=100), 257)
    assert plain.draft is None and plain.lookahead == 0


def test_the_proposer_is_chosen_by_name_and_a_wrong_name_is_refused_naming_the_flag() -> None:
    config = EngineConfig(speculative_method="ngram", ngram_prompt_lookup_min=2, ngram_prompt_lookup_max=5)
    proposer = make_proposer(config)
    assert proposer == NgramProposer(min_n=2, max_n=5)
    with pytest.raises(ValueError, match="--speculative-method: 'draft' is not one of ngram"):
        make_proposer(EngineConfig(speculative_method="draft"))
    assert parse_config(["--speculative-method", "ngram"]).engine.speculative_method == "ngram"
    with pytest.raises(SystemExit):
        parse_config(["--speculative-method", "draft"])


def test_draft_room_keeps_a_bounded_block_inside_its_window_and_the_output_inside_max_new_tokens() -> None:
    window = parse_cache_policy("window:64", 4096)
    full = parse_cache_policy("full", 4096)
    assert draft_room(full, 100, remaining=50, wanted=8) == 8
    assert draft_room(full, 100, remaining=5, wanted=8) == 4  # 4 guesses + the bonus token = 5
    assert draft_room(window, 60, remaining=50, wanted=8) == 4  # 59 cached + a block of 5 = 64
    assert draft_room(window, 64, remaining=50, wanted=8) == 0  # full window: one token a step


def test_a_request_keeps_its_guesses_up_to_the_first_wrong_one_and_that_token() -> None:
    request = Request("r", "m", [256, 97], SamplingParams(max_new_tokens=10), eos_token_id=257)
    request.output_ids = [98]
    assert accepted_prefix(request, [98, 1, 2, 3], [1, 2, 9, 4]) == 3  # 1, 2 kept, then 9 (not 3)
    assert accepted_prefix(request, [98, 1, 2], [1, 2, 5]) == 3  # all guesses and the bonus
    assert accepted_prefix(request, [98, 257, 2], [257, 2, 5]) == 1  # an EOS it may end at ends the step
    request.output_ids = [98] * 8
    assert accepted_prefix(request, [98, 1, 2, 3], [1, 2, 3, 4]) == 2  # max_new_tokens=10 reached


@pytest.fixture(scope="module")
def engines(repository: Path) -> Iterator[dict[str, Engine]]:
    """The default engine (fused decode for full float rows, int8-channel rows) and an explicit one
    (per-token int8 rows, which verify blocks too)."""
    made = {
        attention: Engine.from_repository(
            repository, EngineConfig(threads=1, attention=attention), ServiceMetrics(CollectorRegistry())
        )
        for attention in ("auto", "explicit")
    }
    for engine in made.values():
        engine.start()
    yield made
    for engine in made.values():
        engine.stop(5)


def generate(engine: Engine, model: str, k: int, policy: str, new: int, **params: object) -> Request:
    raw = GenerateInput(model=model, prompt=PROMPT, max_new_tokens=new, ignore_eos=True, cache_policy=policy,
                        speculative_tokens=k, **params)  # type: ignore[arg-type]  # fmt: skip
    request = engine.submit(raw)
    assert request.done.wait(120), "request did not finish"
    assert request.error is None, request.error
    return request


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", SCHEMES)
def test_greedy_output_is_identical_with_and_without_speculation(
    engines: dict[str, Engine], model: str, policy: str
) -> None:
    """Token for token, every scheme under every policy; the guesses were verified (and some kept)
    where the row's graph takes blocks: full and per-token int8 rows, bounded ones until their
    window fills."""
    new = 120 if model == "learned" else 160
    for attention, engine in engines.items():
        plain = generate(engine, model, 0, policy, new)
        speculative = generate(engine, model, 8, policy, new)
        assert speculative.output_ids == plain.output_ids, (attention, policy)
        assert speculative.draft is not None
        if policy == "int8" and attention == "auto":  # int8-channel rows: the fused graph, one token a step
            assert speculative.draft.proposed == 0
        elif policy in ("full", "int8"):  # (a bounded row guesses only until its window fills: maybe never)
            assert speculative.draft.accepted > 0, (attention, speculative.draft)


def test_seeded_sampling_is_reproducible_and_the_same_as_without_speculation(engines: dict[str, Engine]) -> None:
    engine = engines["auto"]
    kwargs = {"temperature": 0.8, "top_k": 40, "seed": 11}
    first = generate(engine, "relative", 8, "full", 120, **kwargs)
    again = generate(engine, "relative", 8, "full", 120, **kwargs)
    plain = generate(engine, "relative", 0, "full", 120, **kwargs)
    assert first.output_ids == again.output_ids == plain.output_ids
    assert first.draft is not None and first.draft.accepted > 0


def test_sampled_tokens_follow_the_models_distribution_with_speculation(engines: dict[str, Engine]) -> None:
    """Chi-square over 400 seeds at temperature 1.5 (a broad distribution): the second token, which
    each request's first step verified against a guess, counted over the seeds whose first token was
    the commonest, against the model's own distribution after that token (from Score's logits)."""
    engine, seeds, temperature = engines["auto"], 1000, 1.5
    prompt = PROMPT + "for k in x:\n    f("
    drawn = []
    for seed in range(seeds):
        raw = GenerateInput(model="alibi", prompt=prompt, max_new_tokens=3, ignore_eos=True, temperature=temperature,
                            seed=seed, speculative_tokens=4)  # fmt: skip
        request = engine.submit(raw)
        assert request.done.wait(60)
        assert request.draft is not None
        drawn.append((request.output_ids[0], request.output_ids[1], request.draft.proposed))
    # After "f(i" or "f(j" the proposer finds the line again: the second token is verified against a guess.
    first = max((ord("i"), ord("j")), key=lambda token: sum(t0 == token for t0, _, _ in drawn))
    assert all(proposed > 0 for t0, _, proposed in drawn if t0 == first)
    observed = Counter(t1 for t0, t1, _ in drawn if t0 == first)
    total = sum(observed.values())
    assert total >= 80
    model = engine.model("alibi")
    vocab = model.manifest.vocab_size
    scored = model.runner.score([*model.inputs.tokenize(prompt), first, 0], top=vocab)
    assert scored.top_ids is not None and scored.top_logprobs is not None
    logprobs = np.empty(vocab)
    logprobs[scored.top_ids[-1]] = scored.top_logprobs[-1]
    expected = np.exp(logprobs / temperature - (logprobs / temperature).max())
    expected /= expected.sum()
    statistic, bins = chi_square(observed, expected, total)
    assert statistic < chi_square_critical(bins - 1), (statistic, bins, observed.most_common(5))


def chi_square(observed: Counter[int], expected: np.ndarray, total: int) -> tuple[float, int]:
    """Pearson's statistic over tokens expected at least 5 times, the rest pooled into one bin."""
    big = [token for token in range(len(expected)) if expected[token] * total >= 5]
    pooled_expected = total - sum(expected[t] * total for t in big)
    pooled_observed = total - sum(observed[t] for t in big)
    statistic = sum((observed[t] - expected[t] * total) ** 2 / (expected[t] * total) for t in big)
    bins = len(big)
    if pooled_expected >= 1:
        statistic += (pooled_observed - pooled_expected) ** 2 / pooled_expected
        bins += 1
    return float(statistic), bins


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.999 (z = 3.09), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("attention", ["auto", "explicit"])
@pytest.mark.parametrize("policy", POLICIES)
def test_after_rejected_guesses_the_store_equals_a_plain_runs_at_the_same_token(
    repository: Path, policy: str, attention: str
) -> None:
    """Two runners decode the same greedy sequence, one a token a step, one verifying guesses (its
    last steps guess no further than the plain run went): at the same token their rows hold the same
    K/V, lengths, masks and positions, the same held and physical bytes, and the same eviction state."""
    manifest = Manifest.load(repository / "rope")
    cache_policy = parse_cache_policy(policy, 4096)
    runners = [ModelRunner(manifest, StoreConfig(32 << 20, 16, 4096), threads=1, attention=attention) for _ in "ab"]
    ids = TOKENIZER.encode(PROMPT)
    new, k = 150, 8
    (plain_output, _), (output, verified) = [
        decode(runner, ids, cache_policy, new, guesses) for runner, guesses in zip(runners, (0, k), strict=True)
    ]
    assert output == plain_output
    if runners[1].store.kind_of["r"] == INT8_CHANNEL:  # the fused int8 graph takes one token a step
        assert verified == 0
    else:
        assert verified > 0 and (cache_policy.bounded or verified > 20)  # rejected guesses among them
    rows = []
    for runner in runners:
        store = runner.store
        (klass,) = [c for c in store.batches() if c.members]
        length = int(klass.lengths[0])
        rows.append((klass, length, store))
    (plain, length, plain_store), (spec, spec_length, spec_store) = rows
    assert spec_length == length
    row = (slice(None), 0, slice(None), slice(None, length))
    if spec.kind == INT8_CHANNEL:  # codes under the model's fixed scales: nothing reads them as float
        assert np.abs(spec.arrays[0][row].astype(int) - plain.arrays[0][row].astype(int)).max() <= 1
    else:  # int8: a code may differ by one step (float noise before it)
        np.testing.assert_allclose(
            spec.storage.read(row), plain.storage.read(row), atol=0.1 if cache_policy.int8 else 1e-4
        )
    assert (
        np.array_equal(spec.mask[0, :length], plain.mask[0, :length])
        and spec.mask[0, length : spec.capacity].sum() == 0
    )
    assert spec.positions[0, 0] == plain.positions[0, 0]
    assert spec.policies[0].evicted == plain.policies[0].evicted
    # Full float rows of the default engine verify through the fused prompt graph, in place.
    in_place = bool(runners[1].verifier._in_place_calls)
    assert in_place == (attention == "auto" and policy == "full"), (attention, policy)
    assert spec.kind == plain.kind
    # Bytes: what each holds is its tokens in whole blocks; the speculative one had room for its guesses.
    token_bytes = plain_store.layout.storage(plain.kind).token_bytes
    assert 0 <= spec_store.tokens["r"] - plain_store.tokens["r"] <= k
    assert spec.nbytes == spec.capacity * token_bytes * spec.rows


def decode(runner: ModelRunner, ids: list[int], policy: object, new: int, guesses: int) -> tuple[list[int], int]:
    """A greedy sequence of `new` tokens through the runner, as the engine drives it (reserve, join,
    then plain steps or verify + commit), never past `new` tokens; and how many guesses it verified."""
    store, proposer = runner.store, NgramProposer()
    runner.prompt_sessions.open()
    store.reserve("r", policy.cached(len(ids) + 1 + guesses), policy)  # type: ignore[attr-defined,arg-type]
    prompt = chunked(runner, "r", ids, 512)
    assert prompt is not None
    prompt.policy = runner.layout.row_eviction(policy)  # type: ignore[arg-type]
    runner.join([prompt])
    output = [int(np.argmax(prompt.logits))]
    verified = 0
    while len(output) < new:
        remaining = new - len(output)
        room = draft_room(policy, len(ids) + len(output), remaining, guesses)  # type: ignore[arg-type]
        room = room if store.kind_of["r"] != INT8_CHANNEL else 0  # the fused int8 graph takes one token
        store.reserve("r", policy.cached(len(ids) + len(output) + room))  # type: ignore[attr-defined]
        history = bytearray(t if t < 256 else 0 for t in [*ids, *output])
        draft = proposer.propose(history, room) if room else []
        if not draft:
            logits = runner.decode({"r": output[-1]})["r"]
            output.append(int(np.argmax(logits)))
            continue
        fed = [output[-1], *draft]
        verified += len(draft)
        (logits,) = runner.verifier.verify(["r"], [fed])
        targets = logits.argmax(axis=1).tolist()
        keep = 1
        while keep < len(fed) and targets[keep - 1] == fed[keep]:
            keep += 1
        runner.verifier.commit({"r": keep})
        output += targets[:keep]
        if not policy.bounded:  # type: ignore[attr-defined]  # the rejected guesses' columns hold nothing
            (klass,) = [c for c in store.batches() if c.members]
            beyond = (slice(None), 0, slice(None), slice(int(klass.lengths[0]), klass.capacity))
            assert all(np.count_nonzero(array[beyond]) == 0 for array in klass.arrays)
    return output, verified


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    flags = ["--speculative-tokens", "8", "--speculative-max-batch", "64", "--max-new-tokens-limit", "2048"]
    process = ServerProcess(repository, "--models", "alibi", "rope", *flags).wait_serving()
    yield process
    process.stop()


def test_the_server_flag_and_the_request_field_turn_it_on_and_off_and_count_it(server: ServerProcess) -> None:
    request = pb.GenerateRequest(model="alibi", prompt=PROMPT, max_new_tokens=120, ignore_eos=True)
    on = server.stub.Generate(request, timeout=60)
    before = server.metric("posenc_speculative_accepted_tokens_total", model="alibi")
    assert before > 0 and server.metric("posenc_speculative_proposed_tokens_total", model="alibi") >= before
    assert server.metric("posenc_speculative_accepted_by_position_total", model="alibi", position="1") > 0
    off = server.stub.Generate(pb.GenerateRequest(model="alibi", prompt=PROMPT, max_new_tokens=120, ignore_eos=True,
                                                  speculative_tokens=0), timeout=60)  # fmt: skip
    assert off.text == on.text
    assert server.metric("posenc_speculative_accepted_tokens_total", model="alibi") == before
    with pytest.raises(grpc.RpcError) as error:
        server.stub.Generate(pb.GenerateRequest(model="alibi", prompt="x", speculative_tokens=17), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "speculative_tokens: must be in [0, 16], got 17" in error.value.details()


def test_a_cancellation_storm_with_speculation_leaks_no_block(server: ServerProcess) -> None:
    """40 speculative streams, each cancelled after a few chunks or at once: afterwards no sequence
    holds a byte and nothing runs."""
    streams = []
    for index in range(40):
        request = pb.GenerateRequest(model="rope" if index % 2 else "alibi", prompt=PROMPT * (1 + index % 3),
                                     max_new_tokens=1500, ignore_eos=True)  # fmt: skip
        streams.append(server.stub.GenerateStream(request, timeout=120))
    for index, stream in enumerate(streams):
        for _ in range(index % 4):
            next(stream)
        stream.cancel()
    for model in ("alibi", "rope"):
        assert wait_for(lambda m=model: server.metric("posenc_running_sequences", model=m) == 0, timeout=30)
        assert wait_for(lambda m=model: server.sequence_bytes("posenc_kv_cache_used_bytes", model=m) == 0, timeout=30)
