"""The two KV-reuse workloads, as prompts: the comparison's `reuse` section (loadtest/study/reuse.py)
and the Locust users (loadtest/locustfile.py) build them here, from held-out bytes.

- **Shared prefix**: one long prefix every request shares (a system prompt, a few-shot header) and a
  unique tail, the case an exact prefix cache serves.
- **Documents in varying order** (RAG-like): a few documents out of a small set, in a random order
  each time, with a passkey planted in one of them and asked for at the end. A prefix cache finds
  little here (the order changes what comes first); reusable segments (`GenerateRequest.segments`)
  compute each document once and place it wherever it lands.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.probes import PASSKEY_DIGITS, PASSKEY_QUESTION, passkey, passkey_line

SHARED_PREFIX_BYTES, SHARED_TAIL_BYTES, SHARED_NEW_TOKENS = 1536, 64, 32
SHARED_PREFIX_SEED = 31
DOCUMENTS, DOCUMENTS_PER_PROMPT = 8, 4
LONG_DOCUMENT_BYTES = 256


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


def document_prompt(documents: list[str], rng: random.Random, per_prompt: int = DOCUMENTS_PER_PROMPT) -> DocumentPrompt:
    """`per_prompt` of `documents` in a random order, a fresh key planted in one of them."""
    chosen = rng.sample(documents, per_prompt)
    carrier, key = rng.randrange(per_prompt), passkey(rng)
    chosen[carrier] = plant(chosen[carrier], key, rng)
    return DocumentPrompt(tuple(chosen), carrier, key)
