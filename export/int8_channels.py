"""The fixed per-channel scales of the fused int8 graph's cache (contract/kv_int8.py's channel format):
max |K| and |V| per layer, head and channel over a calibration text, divided by 127.

The calibration text is the corpus's train split (never the test split the quality figures use):
CALIBRATION_WINDOWS evenly spaced windows of CALIBRATION_CONTEXT tokens, or of the model's own
limit where its positions end sooner (`learned`). Bits per byte of the test split at 1x, float32
against the channel format, on the shipped weights (`python -m export.int8_study`): +0.00% to +0.04%
for every scheme but NoPE (+0.33%); per-token scales -0.01% to +0.04%.
"""

from __future__ import annotations

import numpy as np
import torch

from models.corpus import load_corpus
from models.evaluation import evaluation_sequences
from models.tokenizer import TOKENIZER
from models.transformer import Transformer

CALIBRATION_CONTEXT = 1024  # tokens per window: K/V at positions beyond the 256 trained, where rope's keys turn
CALIBRATION_WINDOWS = 8


@torch.no_grad()
def kv_channel_scales(model: Transformer) -> np.ndarray:
    """(2 x layers, heads, 1, head_dim) float32: each channel's max |x| over the calibration text / 127
    (K then V of each layer, the store's tensor order); a channel that is always zero gets scale 1."""
    model = model.float().eval()
    limit = model.config.max_positions
    context = CALIBRATION_CONTEXT if limit is None else min(CALIBRATION_CONTEXT, limit - 1)
    windows = CALIBRATION_WINDOWS * max(1, CALIBRATION_CONTEXT // context)
    sequences = evaluation_sequences(load_corpus().splits["train"], context, windows, TOKENIZER.bos_token_id)
    top: torch.Tensor | None = None
    for ids in sequences:
        _, presents = model(torch.tensor([ids[:-1]]))
        stacked = torch.stack([t[0].abs().amax(dim=1) for pair in presents for t in pair])  # (2L, heads, head_dim)
        top = stacked if top is None else torch.maximum(top, stacked)
    assert top is not None
    scales = torch.where(top > 0, top / 127, torch.ones_like(top))
    return scales[:, :, None, :].numpy().astype(np.float32)
