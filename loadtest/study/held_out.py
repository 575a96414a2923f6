"""The comparison's input text: the corpus's test split, never seen in training."""

from __future__ import annotations

import random

import numpy as np

from models.corpus import load_corpus


class HeldOut:
    """Text from the corpus's test split, never seen in training."""

    def __init__(self, seed: int = 0, data: bytes | None = None) -> None:
        self.data = load_corpus().text_bytes("test") if data is None else data
        self.seed = seed
        self.rng = random.Random(seed)

    def again(self) -> HeldOut:
        """The same text drawn again from the start: each model scored on it sees the same texts, so
        two training seeds' figures differ by their checkpoints, not by what they were asked."""
        return HeldOut(self.seed, self.data)

    def text(self, length: int) -> str:
        """About `length` bytes of held-out text, valid UTF-8, at least `length` - 3 bytes."""
        start = self.rng.randrange(0, len(self.data) - length - 1)
        return self.data[start : start + length].decode("utf-8", errors="ignore")

    def windows(self, length: int, count: int) -> list[str]:
        starts = np.linspace(0, len(self.data) - length - 1, count).astype(np.int64)
        return [self.data[s : s + length].decode("utf-8", errors="ignore") for s in starts]
