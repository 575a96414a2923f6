"""The two KV-reuse workloads, as prompts: the comparison's `reuse` section (loadtest/study/reuse.py)
and the Locust users (loadtest/locustfile.py) build them here, from held-out bytes.

- **Shared prefix**: one long prefix every request shares (a system prompt, a few-shot header) and a
  unique tail, the case an exact prefix cache serves.
- **Documents in varying order** (RAG-like): a few documents out of a small set, in a random order
  each time, with a passkey planted in one of them and asked for at the end. A prefix cache finds
  little here (the order changes what comes first); reusable segments (`GenerateRequest.segments`)
  compute each document once and place it wherever it lands. The comparison draws a fresh set for
  every PROMPTS_PER_SET prompts (`document_prompts`), so that its figures generalise over documents
  and not only over orders of eight: prompts of one set share documents, and intervals resample
  the sets (issue 55: with one set for 192 prompts, fresh samples fell outside the intervals).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.probes import PASSKEY_DIGITS, PASSKEY_QUESTION, passkey, passkey_line

SHARED_PREFIX_BYTES, SHARED_TAIL_BYTES, SHARED_NEW_TOKENS = 1536, 64, 32
SHARED_PREFIX_SEED = 31
DOCUMENTS, DOCUMENTS_PER_PROMPT = 8, 4
# Prompts drawn from one document set in the comparison: each document comes back about twice, in
# another order and at another offset, and 192 prompts rest on 48 independent sets.
PROMPTS_PER_SET = 4
LONG_DOCUMENT_BYTES = 256


def load_prompt_bytes(limit: int | None) -> int:
    """The comparison's load prompts (loadtest/study/timed.py): 512 bytes, or 200 for a model with a
    position limit (learned's 256 positions). Schemes on different lengths serve different
    workloads, so the report ranks load figures only within one length."""
    return 200 if limit else 512


def held_out_slice(data: bytes, rng: random.Random, length: int) -> str:
    """About `length` bytes of `data` from a random offset, valid UTF-8 (at most `length` bytes)."""
    start = rng.randrange(0, len(data) - length - 1)
    return data[start : start + length].decode("utf-8", errors="ignore")


def shared_prefix_text(data: bytes, size: int = SHARED_PREFIX_BYTES) -> str:
    """The prefix every request shares: the same held-out bytes in every process, cut to `size`."""
    return (
        held_out_slice(data, random.Random(SHARED_PREFIX_SEED), SHARED_PREFIX_BYTES)
        .encode()[:size]
        .decode("utf-8", errors="ignore")
    )


def shared_prefix_sizes(limit: int, new_tokens: int = SHARED_NEW_TOKENS) -> tuple[int, int]:
    """Prefix and tail bytes: the workload's, scaled down together where the model's positions
    (`limit`, 0: none) cannot hold them with the BOS token and the new tokens (learned's 256)."""
    prefix, tail = SHARED_PREFIX_BYTES, SHARED_TAIL_BYTES
    room = limit - 1 - new_tokens if limit else prefix + tail
    if room >= prefix + tail:
        return prefix, tail
    scale = max(0, room) / (prefix + tail)
    return int(prefix * scale), max(1, int(tail * scale))


def short_document_bytes(train_context: int, per_prompt: int = DOCUMENTS_PER_PROMPT) -> int:
    """Document bytes such that a whole prompt (BOS, `per_prompt` documents, the planted line, the
    question) and its answer fit the training context, where every scheme retrieves."""
    overhead = 1 + len(passkey_line("0" * PASSKEY_DIGITS)) + len(PASSKEY_QUESTION) + PASSKEY_DIGITS
    return (train_context - overhead) // per_prompt


@dataclass(frozen=True)
class DocumentPrompt:
    """Documents in order (the one at `carrier` holds the planted key), the question, and the answer."""

    documents: tuple[str, ...]
    carrier: int
    answer: str
    document_set: int = 0  # the set its documents came from: prompts of one set are not independent

    @property
    def reused(self) -> set[str]:
        """The documents a segment cache can hold before the prompt arrives (all but the carrier, whose
        planted key is new)."""
        return {d for i, d in enumerate(self.documents) if i != self.carrier}

    @property
    def question(self) -> str:
        return PASSKEY_QUESTION

    @property
    def text(self) -> str:
        """The prompt as one text (what a plain request sends)."""
        return "".join(self.documents) + self.question

    def segments(self) -> list[tuple[str, bool]]:
        """The prompt as (text, reusable) segments: every document reusable, the question not."""
        return [(document, True) for document in self.documents] + [(self.question, False)]


def document_set(data: bytes, rng: random.Random, size: int, count: int = DOCUMENTS) -> list[str]:
    """`count` documents of about `size` bytes from `data` (the held-out split)."""
    return [held_out_slice(data, rng, size) for _ in range(count)]


def plant(document: str, key: str, rng: random.Random) -> str:
    """The document with the key's line inserted at a random character."""
    at = rng.randint(0, len(document))
    return document[:at] + passkey_line(key) + document[at:]


def document_prompt(
    documents: list[str], rng: random.Random, per_prompt: int = DOCUMENTS_PER_PROMPT, document_set: int = 0
) -> DocumentPrompt:
    """`per_prompt` of `documents` in a random order, a fresh key planted in one of them."""
    chosen = rng.sample(documents, per_prompt)
    carrier, key = rng.randrange(per_prompt), passkey(rng)
    chosen[carrier] = plant(chosen[carrier], key, rng)
    return DocumentPrompt(tuple(chosen), carrier, key, document_set)


def document_prompts(
    data: bytes, rng: random.Random, size: int, count: int, per_set: int = PROMPTS_PER_SET
) -> list[DocumentPrompt]:
    """`count` prompts of documents of about `size` bytes, `per_set` from each fresh document set
    (numbered in `DocumentPrompt.document_set`)."""
    prompts: list[DocumentPrompt] = []
    while len(prompts) < count:
        number, documents = len(prompts) // per_set, document_set(data, rng, size)
        drawn = min(per_set, count - len(prompts))
        prompts += [document_prompt(documents, rng, document_set=number) for _ in range(drawn)]
    return prompts
