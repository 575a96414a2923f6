"""The KV-reuse workloads' prompts (loadtest/workloads.py): pure logic, no server."""

from __future__ import annotations

import random

from loadtest.probes import PASSKEY_QUESTION
from loadtest.workloads import (
    DOCUMENTS,
    DOCUMENTS_PER_PROMPT,
    LONG_DOCUMENT_BYTES,
    PROMPTS_PER_SET,
    SHARED_NEW_TOKENS,
    SHARED_PREFIX_BYTES,
    SHARED_TAIL_BYTES,
    document_prompt,
    document_prompts,
    document_set,
    shared_prefix_sizes,
    shared_prefix_text,
    short_document_bytes,
)

DATA = ("def f(x):\n    return x + 1\n" * 4000 + "é").encode()


def test_the_shared_prefix_keeps_its_size_where_positions_allow_and_shrinks_to_fit_learned() -> None:
    assert shared_prefix_sizes(0) == (SHARED_PREFIX_BYTES, SHARED_TAIL_BYTES)
    assert shared_prefix_sizes(4096) == (SHARED_PREFIX_BYTES, SHARED_TAIL_BYTES)
    prefix, tail = shared_prefix_sizes(256)
    assert 1 + prefix + tail + SHARED_NEW_TOKENS <= 256 and prefix > 150 and tail >= 1
    share = SHARED_PREFIX_BYTES / (SHARED_PREFIX_BYTES + SHARED_TAIL_BYTES)
    assert abs(prefix / (prefix + tail) - share) < 0.02  # both scaled alike


def test_the_shared_prefix_is_the_same_text_in_every_process_and_cut_to_size() -> None:
    whole = shared_prefix_text(DATA)
    assert whole == shared_prefix_text(DATA) and len(whole.encode()) <= SHARED_PREFIX_BYTES
    assert whole.startswith(shared_prefix_text(DATA, 100))


def test_a_short_prompt_and_its_answer_fit_the_training_context() -> None:
    size = short_document_bytes(256)
    assert 40 <= size <= 48
    rng = random.Random(1)
    documents = document_set(DATA, rng, size)
    assert len(documents) == DOCUMENTS and all(len(d.encode()) <= size for d in documents)
    for _ in range(20):
        prompt = document_prompt(documents, rng)
        assert 1 + len(prompt.text.encode()) + len(prompt.answer) <= 256


def test_a_document_prompt_holds_four_documents_in_random_order_with_the_key_in_the_carrier() -> None:
    rng = random.Random(2)
    documents = document_set(DATA, rng, LONG_DOCUMENT_BYTES)
    prompts = [document_prompt(documents, rng) for _ in range(30)]
    orders = set()
    for prompt in prompts:
        assert len(prompt.documents) == DOCUMENTS_PER_PROMPT
        assert prompt.answer.isdigit() and len(prompt.answer) == 5
        carrier = prompt.documents[prompt.carrier]
        assert f'pass_key = "{prompt.answer}"' in carrier
        others = [d for i, d in enumerate(prompt.documents) if i != prompt.carrier]
        assert all(d in documents for d in others) and len(set(others)) == len(others)
        assert prompt.text.endswith(PASSKEY_QUESTION)
        segments = prompt.segments()
        assert "".join(text for text, _ in segments) == prompt.text
        assert [reusable for _, reusable in segments] == [True] * DOCUMENTS_PER_PROMPT + [False]
        orders.add(tuple(documents.index(d) for d in others))
    assert len(orders) > 20  # the order varies


def test_the_comparisons_prompts_draw_a_fresh_document_set_every_few_prompts() -> None:
    """Prompts of one set share documents (the reuse a segment cache serves); sets share none, so an
    interval over sets covers documents the study did not draw (issue 55)."""
    letters = random.Random(4)
    data = bytes(letters.choice(b"abcdefgh ij\n") for _ in range(100_000))
    prompts = document_prompts(data, random.Random(3), 40, 4 * PROMPTS_PER_SET + 2)
    assert [p.document_set for p in prompts] == [i // PROMPTS_PER_SET for i in range(4 * PROMPTS_PER_SET + 2)]
    documents = {}
    for prompt in prompts:
        documents.setdefault(prompt.document_set, set()).update(prompt.reused)
        assert prompt.reused == set(prompt.documents) - {prompt.documents[prompt.carrier]}
    assert len(documents[0]) <= DOCUMENTS and len(documents[0]) > DOCUMENTS_PER_PROMPT - 1  # some come back
    assert all(not documents[a] & documents[b] for a in documents for b in documents if a < b)
    assert prompts == document_prompts(data, random.Random(3), 40, 4 * PROMPTS_PER_SET + 2)  # seeded
