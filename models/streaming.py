"""The PyTorch reference of the cache policies (contract/cache_policy.py): decoding one token at
a time with a bounded K/V cache, the way the service runs it, so its numbers can be checked.

Per step, with n tokens cached before it and t its index in the sequence:
- the query position is `t` for schemes whose positions cannot be re-indexed (`original`) and for
  rope (whose cached keys already carry their positions, see below), else `n`, its rank in the
  cache. Key positions come from the attention mask, ranks 0..n, so bias schemes (ALiBi, T5)
  see the distances within the cache, consistent with the query (`Transformer.forward` takes query
  positions from `position_ids` but key positions from the mask: a query position that disagreed
  with the mask would give the bias schemes wrong distances);
- once the cache holds the budget B = S + W tokens, each step evicts the oldest non-sink token
  (cache index S) from every layer's K and V;
- rope keys cannot be re-indexed by position ids: the window keeps its original rotations, which
  are already right relative to the query at `t`, and the sink keys are moved by the number of
  evicted tokens (`move_keys`, from the keys as they were before the first eviction, so no
  rounding accumulates). The sinks then sit right before the window, as StreamingLLM re-indexes.
- `+int8` policies store each token's K/V as the int8 cache does (contract/kv_int8.py: quantized
  then dequantized, per token and head) once its step is done; the token itself attended with its
  float32 K/V. Moved rope sinks are quantized again after the move, from the stored anchor.
  `prompt_tokens` computes the first tokens in one float32 pass, as the service prefills a
  generation's prompt, and stores their cache quantized after it.
- the unbounded `int8` policy, given the model's channel scales (`int8_channel_scales`, the
  manifest's), stores K/V in contract/kv_int8.py's channel format instead, and each decoded token
  attends to its own K/V quantized, as the fused int8 kernel does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
from torch import Tensor

from contract import kv_int8
from contract.cache_policy import INT8_CHANNEL, CachePolicy
from models.transformer import KeyValue, Transformer

FLOAT = "float32"  # the reference's K/V, and the storage kind of a policy that keeps them as they are


def _query_position(model: Transformer, t: int, n: int) -> int:
    """Where the new token sits: its sequence index, or its rank in the cache."""
    scheme = model.positional
    return t if scheme.eviction_positions == "original" or scheme.rotates_keys else n


def _with_new(past: list[KeyValue], presents: list[KeyValue], n: int) -> list[KeyValue]:
    """Past plus the step's K/V; accepts both layouts (present = past + new, or new only)."""
    if presents[0][0].shape[2] == n + 1:
        return presents
    return [
        (torch.cat((pk, k), dim=2), torch.cat((pv, v), dim=2)) for (pk, pv), (k, v) in zip(past, presents, strict=True)
    ]


def _evict(cache: list[KeyValue], sinks: int) -> list[KeyValue]:
    """Drop cache index `sinks` (the oldest token that is not a sink) from every layer."""

    def drop(x: Tensor) -> Tensor:
        return torch.cat((x[:, :, :sinks], x[:, :, sinks + 1 :]), dim=2)

    return [(drop(k), drop(v)) for k, v in cache]


def fake_quantize(x: Tensor) -> Tensor:
    """x as the int8 cache stores it (contract.kv_int8, the store's own numpy code), in x's dtype."""
    return torch.from_numpy(kv_int8.fake_quantize(x.detach().cpu().numpy())).to(x)


def channel_quantizer(scales: np.ndarray) -> Callable[[Tensor, int], Tensor]:
    """x, tensor index (2 x layer, + 1 for V) -> x as the channel-format cache stores it."""

    def quantize(x: Tensor, tensor: int) -> Tensor:
        stored = kv_int8.fake_quantize_channels(x.detach().cpu().numpy(), scales[tensor])
        return torch.from_numpy(stored).to(x)

    return quantize


@contextmanager
def attending_to_stored(model: Transformer, quantize: Callable[[Tensor, int], Tensor]) -> Iterator[None]:
    """While inside: each layer's new K/V are quantized before its tokens attend to them."""
    originals = [block.attn.attend for block in model.blocks]

    def layer(i: int, attend):  # type: ignore[no-untyped-def]
        return lambda q, k, v, past, bias, scale: attend(
            q, quantize(k, 2 * i), quantize(v, 2 * i + 1), past, bias, scale
        )

    try:
        for i, block in enumerate(model.blocks):
            block.attn.attend = layer(i, originals[i])
        yield
    finally:
        for block, attend in zip(model.blocks, originals, strict=True):
            block.attn.attend = attend


def _stored(
    cache: list[KeyValue], kind: str, first: int, channels: Callable[[Tensor, int], Tensor] | None = None
) -> list[KeyValue]:
    """The cache as rows of a storage kind (CachePolicy.kind) hold it: columns from `first` on
    quantized in int8 ones (per token, or with `channels` in the channel format)."""
    if kind == FLOAT:
        return cache

    def store(x: Tensor, tensor: int) -> Tensor:
        tail = x[:, :, first:]
        return torch.cat((x[:, :, :first], fake_quantize(tail) if channels is None else channels(tail, tensor)), dim=2)

    return [(store(k, 2 * i), store(v, 2 * i + 1)) for i, (k, v) in enumerate(cache)]


@torch.no_grad()
def stream_logits(
    model: Transformer,
    ids: list[int],
    policy: CachePolicy,
    prompt_tokens: int = 1,
    int8_channel_scales: np.ndarray | None = None,
) -> Tensor:
    """Logits (len(ids), vocab), float32, of `ids` decoded one token at a time under `policy`
    (the first `prompt_tokens`, at most the budget, in one pass: a prompt as the service prefills it;
    an unbounded int8 policy with `int8_channel_scales` in the channel format)."""
    device = model.token_embedding.weight.device
    scheme = model.positional
    budget, sinks = policy.budget, policy.sinks
    cache: list[KeyValue] | None = None
    anchor: list[Tensor] | None = None  # sink keys per layer before the first eviction (rope)
    evicted = 0
    rows: list[Tensor] = []
    head = max(1, min(prompt_tokens, len(ids), budget or len(ids)))
    kind = policy.kind(FLOAT, int8_channel_scales is not None)  # how the service's rows would store it
    channels = None
    if kind == INT8_CHANNEL:
        assert int8_channel_scales is not None
        channels = channel_quantizer(int8_channel_scales)
    if ids:
        logits, cache = model(torch.tensor([ids[:head]], dtype=torch.long, device=device))
        rows.extend(logits[0].to(torch.float32))
        cache = _stored(cache, kind, 0, channels)
    for t, token in enumerate(ids[head:], start=head):
        assert cache is not None
        n = cache[0][0].shape[2]
        input_ids = torch.tensor([[token]], dtype=torch.long, device=device)
        mask = torch.ones((1, n + 1), dtype=torch.long, device=device)
        position_ids = torch.tensor([[_query_position(model, t, n)]], dtype=torch.long, device=device)
        with nullcontext() if channels is None else attending_to_stored(model, channels):
            logits, presents = model(input_ids, mask, position_ids, past_key_values=cache)
        rows.append(logits[0, -1].to(torch.float32))
        cache = _stored(_with_new(cache, presents, n), kind, n, channels)
        if budget is None or n < budget:
            continue
        if scheme.rotates_keys and sinks and anchor is None:
            anchor = [k[:, :, :sinks].clone() for k, _ in cache]
        cache = _evict(cache, sinks)
        evicted += 1
        if anchor is not None:
            moved = [scheme.move_keys(a, evicted) for a in anchor]
            if kind != FLOAT:
                moved = [fake_quantize(m) for m in moved]
            cache = [(torch.cat((m, k[:, :, sinks:]), dim=2), v) for m, (k, v) in zip(moved, cache, strict=True)]
    return torch.stack(rows) if rows else torch.empty((0, model.config.vocab_size))


def stream_logprobs(
    model: Transformer,
    ids: list[int],
    policy: CachePolicy,
    prompt_tokens: int = 1,
    int8_channel_scales: np.ndarray | None = None,
) -> np.ndarray:
    """log p(ids[i + 1] | what the cache kept) for i < len(ids) - 1, float32 (len(ids) - 1,)."""
    logits = stream_logits(model, ids, policy, prompt_tokens, int8_channel_scales)
    if len(ids) < 2:
        return np.zeros(0, dtype=np.float32)
    logprobs = torch.log_softmax(logits[:-1].to(torch.float32), dim=-1)
    targets = torch.tensor(ids[1:], dtype=torch.long, device=logprobs.device)
    return logprobs.gather(1, targets[:, None])[:, 0].cpu().numpy()
