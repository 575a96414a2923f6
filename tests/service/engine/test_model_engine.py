"""ModelEngine's loop on a fake runner over a real KV store (onnxruntime-genai's "lowest layer that
proves the behaviour"): no ONNX Runtime, no server. The fake model keeps each token's id as its K/V
(one layer, one head, one dimension) and reads its next token off the row it is given, checking the
row holds exactly the tokens fed so far: a dropped, repeated or rejected-guess token in the store
breaks the chain. Its text mostly cycles through "abcdefgh" (which the n-gram proposer guesses) with
stretches where a "z" comes in at random positions (where guesses fail and the back-off pauses)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from contract.manifest import Manifest
from service.engine.kv import CapacityClass, KVLayout, KVStore
from service.engine.messages import EngineConfig, GenerateInput, RequestStatus
from service.engine.model_engine import ModelEngine
from service.engine.prompts.prompt import PrefilledPrompt, PromptRun
from service.engine.request import Request
from service.metrics import ServiceMetrics

VOCAB, BOS, EOS = 259, 256, 257
CYCLE = tuple(b"abcdefgh")
LAYOUT = KVLayout(n_layers=1, n_heads=1, head_dim=1, dtype="float32")


def next_token(history: list[int]) -> int:
    """The fake model: after `history`, the letter of the cycle after its last one, except in every
    300 tokens' stretch [100, 200), where a "z" comes in at positions drawn at random (2 in 5)."""
    n = len(history)
    if 100 <= n % 300 < 200 and random.Random(n).random() < 0.4:
        return ord("z")
    last = next((token for token in reversed(history) if token in CYCLE), None)
    return CYCLE[(CYCLE.index(last) + 1) % len(CYCLE)] if last is not None else CYCLE[0]


def logits_after(history: list[int]) -> np.ndarray:
    row = np.zeros(VOCAB, dtype=np.float32)
    row[next_token(history)] = 10.0
    return row


def kv_of(tokens: list[int]) -> np.ndarray:
    """Tokens as K/V, (tensors, heads, n, head_dim): each token's id, as K and as V."""
    return np.broadcast_to(np.asarray(tokens, dtype=np.float32)[None, None, :, None], (2, 1, len(tokens), 1)).copy()


class FakeVerifier:
    """The block verifier's calls (spec/verifier.py) on the fake model: every row's fed tokens must fit
    the row its store reserved, and only the kept ones are written (`commit`)."""

    def __init__(self, runner: FakeRunner) -> None:
        self.runner, self.pending, self.calls = runner, {}, 0

    def verify(self, ids: list[str], fed: list[list[int]]) -> list[np.ndarray]:
        self.calls += 1
        self.pending = {}
        out = []
        for sequence, tokens in zip(ids, fed, strict=True):
            klass, row = self.runner.row_of(sequence)
            history = self.runner.history(klass, row)
            assert len(history) + len(tokens) <= klass.capacity, "a block fed past the row's room"
            out.append(np.stack([logits_after(history + tokens[: j + 1]) for j in range(len(tokens))]))
            self.pending[sequence] = tokens
        return out

    def commit(self, kept: dict[str, int]) -> None:
        for sequence, tokens in self.pending.items():
            klass, row = self.runner.row_of(sequence)
            klass.append_tokens(row, kv_of(tokens[: kept[sequence]]))
        self.pending = {}


class FakePromptSessions:
    """No sessions to open or release, and no tail lane (tails go to the prefill worker)."""

    def open(self) -> None: ...
    def release(self) -> None: ...
    def open_tail(self) -> bool:
        return False


class FakeRunner:
    """What ModelEngine asks of its runner, on a real KV store: prompts computed whole, decode steps
    over every member of the store, speculative blocks through `verifier`."""

    def __init__(self) -> None:
        self.store = KVStore(LAYOUT, 1 << 20, 16, 4096)
        self.backend = self.store.backend
        self.verifier = FakeVerifier(self)
        self.prompts: dict[str, int] = {}  # prompt length by sequence, to check the rows' chains
        self.prompt_sessions = FakePromptSessions()

    def row_of(self, sequence: str) -> tuple[CapacityClass, int]:
        (klass,) = [k for k in self.store.batches() if sequence in k.members]
        return klass, klass.members.index(sequence)

    def history(self, klass: CapacityClass, row: int) -> list[int]:
        """The row's tokens, read off its K/V; each after the prompt the model's own next token."""
        tokens = [int(t) for t in np.asarray(klass.row_cache(row))[0, 0, :, 0]]
        prompt = self.prompts[klass.members[row]]
        assert all(tokens[i] == next_token(tokens[:i]) for i in range(prompt, len(tokens))), "a broken chain"
        return tokens

    def prompt(self, sequence: str, ids: list[int]) -> PrefilledPrompt:
        self.prompts[sequence] = len(ids)
        return PrefilledPrompt(sequence, logits_after(ids), kv_of(ids), len(ids))

    def prefill(self, runs: list[PromptRun], chunk: int, lane: object = None) -> Iterator[list[PrefilledPrompt]]:
        assert all(run.past is None for run in runs), "no prefix cache here"
        yield [self.prompt(run.request_id, run.token_ids) for run in runs]

    def join(self, prompts: list[PrefilledPrompt]) -> None:
        for prompt in prompts:
            self.store.write(prompt.request_id, prompt.cache, prompt.length, prompt.policy)

    def plan_decode(self, ids: list[str]) -> list[str]:
        assert sorted(ids) == sorted(self.store.members()), "a decode step feeds every member of the store"
        return ids

    def decode_planned(self, plan: list[str], tokens: list[int]) -> np.ndarray:
        fed = dict(zip(plan, tokens, strict=True))
        logits = {}
        for klass in self.store.batches():
            for row, sequence in enumerate(klass.members):
                assert int(klass.lengths[row]) < klass.capacity, "a step fed past the row's room"
                logits[sequence] = logits_after([*self.history(klass, row), fed[sequence]])
            new = [fed[sequence] for sequence in klass.members]
            klass.append_step(np.asarray(new, dtype=np.float32)[None, :, None, None, None].repeat(2, axis=0))
        return np.stack([logits[sequence] for sequence in plan])

    def forget_calls(self, everything: bool = False) -> None: ...


@pytest.fixture()
def engine(tmp_path: Path) -> Iterator[ModelEngine]:
    data = {
        "name": "fake", "scheme": "fake", "n_layers": 1, "n_heads": 1, "head_dim": 1, "vocab_size": VOCAB,
        "max_positions": None, "train_context": 64, "dtype": "float32", "variants": {},
        "tokenizer": {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": 258, "add_bos": True},
    }  # fmt: skip
    config = EngineConfig(prefix_cache=False, max_new_tokens_limit=2048, tail_prefill_tokens=0)
    made = ModelEngine(Manifest(tmp_path / "manifest.json", data), config, ServiceMetrics(CollectorRegistry()),
                       runner=FakeRunner())  # type: ignore[arg-type]  # fmt: skip
    made.start()
    yield made
    made.stop(5)


IDS = itertools.count()


def submit(engine: ModelEngine, prompt: str, new: int, guesses: int = 0) -> Request:
    raw = GenerateInput(model="fake", prompt=prompt, max_new_tokens=new, speculative_tokens=guesses)
    request = engine.inputs.request(raw, f"r{next(IDS)}")
    engine.submit(request)
    return request


def finished(request: Request) -> Request:
    assert request.done.wait(60), "the request did not finish"
    return request


def expected(prompt: str, new: int) -> list[int]:
    history = [BOS, *prompt.encode()]
    for _ in range(new):
        history.append(next_token(history))
    return history[-new:]


def test_requests_decode_the_models_tokens_to_their_limit_and_free_their_rows(engine: ModelEngine) -> None:
    """Three requests at once, of different lengths (rows in different capacity classes, one step for all)."""
    asked = [("abc", 40), ("x", 7), ("hello" * 20, 130)]
    requests = [submit(engine, prompt, new) for prompt, new in asked]
    for request, (prompt, new) in zip(requests, asked, strict=True):
        assert finished(request).status is RequestStatus.FINISHED_LENGTH and request.error is None
        assert request.output_ids == expected(prompt, new)
    assert engine.store.members() == [] and engine.store.stats().used_bytes == 0


def test_speculation_keeps_the_plain_tokens_and_never_feeds_a_row_past_its_room(engine: ModelEngine) -> None:
    """400 tokens guessing up to 16 a step: the cycle's guesses are kept, the scrambled stretch's
    fail until the back-off pauses; as the pause ends and blocks grow back, the engine's next step
    reserves their room (the fake verifier asserts it), and the tokens are the plain run's."""
    plain = finished(submit(engine, "abcdefgh" * 4, 400))
    speculative = finished(submit(engine, "abcdefgh" * 4, 400, guesses=16))
    assert speculative.output_ids == plain.output_ids == expected("abcdefgh" * 4, 400)
    draft = speculative.draft
    assert draft is not None and draft.accepted > 100 and draft.pauses >= 1
    assert engine.runner.verifier.calls < 400 - draft.accepted  # type: ignore[attr-defined]
    assert engine.store.members() == []
