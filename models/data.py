"""Training batches: random windows of the byte stream, each starting with BOS, some with planted
repeats (random spans written twice) that only copying predicts."""

from __future__ import annotations

import numpy as np
import torch

from models.spans import SPAN_ALPHABET
from models.tokenizer import TOKENIZER

SPAN_BYTES = np.frombuffer(SPAN_ALPHABET.encode(), dtype=np.uint8)  # the span alphabet, as byte ids
# Planted repeats: random spans of SPAN_MIN to `longest` bytes, each written twice in a window, at
# least SPAN_GAP bytes apart.
SPAN_MIN = 6
SPAN_GAP = 4


def batch_generator(seed: int, rank: int, step: int) -> np.random.Generator:
    """The batches of one optimizer step on one rank, seeded by (seed, rank, step): a resumed run
    draws exactly the batches an uninterrupted one would, with no generator state to carry."""
    return np.random.default_rng([seed, rank, step])


def plant_repeats(window: np.ndarray, spans: int, generator: np.random.Generator, longest: int = 16) -> np.ndarray:
    """Write up to `spans` random spans of the span alphabet into `window` (in place), each twice.

    Returns a mask over the window of the bytes that only copying predicts: every repeat
    but its first byte. A span whose places overlap an earlier one is left out.
    """
    size = len(window)
    taken = np.zeros(size, dtype=bool)
    copied = np.zeros(size, dtype=bool)
    for _ in range(spans):
        length = int(generator.integers(SPAN_MIN, longest + 1))
        if 2 * length + SPAN_GAP > size:
            continue
        first = int(generator.integers(0, size - 2 * length - SPAN_GAP + 1))
        second = int(generator.integers(first + length + SPAN_GAP, size - length + 1))
        if taken[first : first + length].any() or taken[second : second + length].any():
            continue
        span = generator.choice(SPAN_BYTES, size=length)
        window[first : first + length] = span
        window[second : second + length] = span
        taken[first : first + length] = taken[second : second + length] = True
        copied[second + 1 : second + length] = True
    return copied


def sample_batch(
    stream: np.ndarray,
    batch: int,
    context: int,
    generator: np.random.Generator,
    planted: int = 0,
    spans: int = 3,
    longest: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random windows, each starting with BOS: inputs (B, context), next-token targets (B, context)
    and the mask of targets only copying predicts (B, context); the first `planted` windows get
    planted repeats. With none planted the draws are exactly those of a plain text batch."""
    starts = generator.integers(0, len(stream) - context, size=batch)
    windows = np.stack([stream[s : s + context] for s in starts]).astype(np.int64)  # (B, context)
    copied = np.zeros(windows.shape, dtype=bool)
    for row in range(planted):
        copied[row] = plant_repeats(windows[row], spans, generator, longest)
    bos = np.full((batch, 1), TOKENIZER.bos_token_id, dtype=np.int64)
    tokens = torch.from_numpy(np.concatenate([bos, windows], axis=1))  # (B, context + 1)
    return tokens[:, :-1], tokens[:, 1:], torch.from_numpy(copied)
