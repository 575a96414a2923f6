"""Training batches: planted repeats sit where only copying predicts, plain batches stay plain."""

from __future__ import annotations

import numpy as np

from models.data import sample_batch


def test_planted_repeats_are_marked_where_only_copying_predicts() -> None:
    generator = np.random.default_rng(0)
    stream = np.full(5000, ord(" "), dtype=np.int16)
    inputs, targets, copied = sample_batch(stream, 8, 64, generator, planted=4, spans=3)
    assert inputs.shape == targets.shape == copied.shape == (8, 64)
    assert not copied[4:].any() and copied[:4].any(axis=1).all()
    for row in range(4):
        window = targets[row].tolist()  # target t is window byte t
        for t in np.flatnonzero(copied[row].numpy()):
            assert chr(window[t]).isalnum()
            # the byte before a copied one also appears earlier, followed by the same byte
            earlier = [j for j in range(t - 1) if window[j] == window[t - 1] and window[j + 1] == window[t]]
            assert earlier, (row, t)
    plain, _, none_copied = sample_batch(stream, 8, 64, np.random.default_rng(0))
    assert not none_copied.any() and not (plain[:, 1:] != ord(" ")).any()
