"""Which int8 cache layout: bits per byte at 1x with the K/V cache quantized per token (served) or
keys per channel in groups (KIVI), on the shipped weights: `python -m export.int8_study`.

Teacher-forced in one forward pass with the semantics of the +int8 policies (contract/cache_policy.py):
token t attends to the quantized K/V of tokens before it and to its own float32 K/V. KIVI (Liu et
al. 2024, https://arxiv.org/abs/2402.02750) quantizes keys per channel with scales over a group of
G tokens, so a key is quantized only once its group is complete (before that it stays float32);
values per token either way.

Per token is served to bounded rows (contract/kv_int8.py): both layouts cost far less than 1% of bits
per byte on the shipped weights, and per-channel keys would add group-fixed scales and up to a group of
float32 keys per row for no measurable gain. The unbounded `int8` cache is served in the `channel`
layout, the one ONNX Runtime's attention kernel reads: fixed per-channel scales for K and V from a
calibration on the train split (export/int8_channels.py), every token attending to its own K/V
quantized too.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from torch import Tensor

from export.int8_channels import kv_channel_scales
from models.checkpoints import WEIGHTS_DIR
from models.corpus import load_corpus
from models.evaluation import bits_per_byte, evaluation_sequences
from models.positional import SCHEMES
from models.streaming import attending_to_stored, channel_quantizer, fake_quantize
from models.tokenizer import TOKENIZER
from models.transformer import Transformer, attend_concatenated


def per_channel_groups(keys: Tensor, group: int) -> Tensor:
    """Keys (B, H, T, hd) quantized per channel over each complete group of `group` tokens."""
    batch, heads, length, dim = keys.shape
    out, full = keys.clone(), length // group * group
    if full:
        grouped = keys[:, :, :full].reshape(batch, heads, length // group, group, dim)
        top = grouped.abs().amax(dim=3, keepdim=True)
        scale = torch.where(top > 0, top / 127, torch.ones_like(top))
        quantized = torch.clamp(torch.round(grouped / scale), -127, 127) * scale
        out[:, :, :full] = quantized.reshape(batch, heads, full, dim)
    return out


def quantized_attention(layout: str, group: int):
    def attend(q: Tensor, k: Tensor, v: Tensor, past: object, bias: Tensor, scale: float) -> tuple[Tensor, object]:
        index = torch.arange(k.shape[2])
        before = index[None, :] < index[:, None]  # (query, key): key cached before the query
        if layout == "per-token":
            keys, key_quantized = fake_quantize(k), before
        else:
            keys, key_quantized = per_channel_groups(k, group), (index[None, :] // group + 1) * group <= index[:, None]
        scores = torch.where(key_quantized, q @ keys.transpose(-2, -1), q @ k.transpose(-2, -1))
        weights = torch.softmax(scores * scale + bias, dim=-1)
        return (weights * before) @ fake_quantize(v) + (weights * ~before) @ v, (k, v)

    return attend


@torch.no_grad()
def target_logprobs(model: Transformer, ids: list[int]) -> Tensor:
    """Teacher-forced log-probabilities of ids[1:] (T - 1, 1), in float64."""
    logits, _ = model(torch.tensor([ids[:-1]]))
    return torch.log_softmax(logits[0].double(), -1).gather(1, torch.tensor(ids[1:])[:, None])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m export.int8_study", description=__doc__)
    parser.add_argument("--context", type=int, default=256, help="tokens per window (256: 1x, the training context)")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--group", type=int, default=32, help="KIVI's key group (tokens)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sequences = evaluation_sequences(load_corpus().splits["test"], args.context, args.windows, TOKENIZER.bos_token_id)
    for scheme in SCHEMES:
        model = Transformer.load(WEIGHTS_DIR / scheme)
        results = {}
        for layout in ("float32", "per-token", f"kivi-g{args.group}"):
            attend = attend_concatenated if layout == "float32" else quantized_attention(layout, args.group)
            for block in model.blocks:
                block.attn.attend = attend
            results[layout] = bits_per_byte(partial(target_logprobs, model), sequences)
        for block in model.blocks:  # the served channel format: every token sees its own K/V stored too
            block.attn.attend = attend_concatenated
        with attending_to_stored(model, channel_quantizer(kv_channel_scales(model))):
            results["channel"] = bits_per_byte(partial(target_logprobs, model), sequences)
        base = results["float32"]
        print(scheme.ljust(11), "  ".join(f"{k} {v:.4f} ({100 * (v / base - 1):+.2f}%)" for k, v in results.items()))


if __name__ == "__main__":
    main()
