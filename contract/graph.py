"""Graph input/output names and how the graphs are fed and read: one definition each.

Names follow Hugging Face Optimum and onnxruntime-genai: `input_ids`, `attention_mask`,
`position_ids`, `past_key_values.{i}.key|value` -> `logits`, `present.{i}.key|value`. The
in-place serving graph takes the same inputs and returns `new_key_values.{i}.key|value`
(the new tokens only) instead of `present`. The int8 serving graph (variant serving-int8) takes
the past as int8 `past_key_values.{i}.key|value` plus float32 `past_key_values.{i}.key_scale|value_scale`
(one scale per token and head, contract/kv_int8.py) and returns the same float32 outputs.

The fused prompt graph (variant prefill-fused) takes S new tokens per row after P past ones: input_ids
and position_ids (B, S), attention_mask (B, P + S), past_key_values.{i}.* (B, heads, P, head_dim), and
returns logits (B, S, vocab) and `present.{i}.*` (B, heads, P + S, head_dim): past and new together. Rows
are right-padded (`right_pad_batch`): a row's tokens sit at columns [0, length), its length is
sum(attention_mask); with P > 0 the batch is one row (GroupQueryAttention's continued prompt).
"""

from __future__ import annotations

import numpy as np

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"
PAST_KEY_VALUES = "past_key_values"
PRESENT = "present"
NEW_KEY_VALUES = "new_key_values"
# A hybrid's fused graphs (serving-fused, prefill-fused): the local layers' past is a row's own local
# columns, narrower than the global layers' (service/engine/kv/local.py), with this mask of its own.
LOCAL_ATTENTION_MASK = "local_attention_mask"
KV_KINDS = ("key", "value")
SCALE_KINDS = ("key_scale", "value_scale")


def kv_name(prefix: str, layer: int | str, kind: str) -> str:
    """`{prefix}.{layer}.{kind}`; `layer` may be a placeholder ("{i}", "%d") for documented patterns."""
    return f"{prefix}.{layer}.{kind}"


def _kv_names(prefix: str, n_layers: int, entries: tuple[str, ...] = KV_KINDS) -> list[str]:
    return [kv_name(prefix, i, kind) for i in range(n_layers) for kind in entries]


def past_names(n_layers: int, entries: tuple[str, ...] = KV_KINDS) -> list[str]:
    """Cache inputs in graph order: layer 0 key, layer 0 value, layer 1 key, ... (`entries`: what a
    layer caches per token, contract.kv_spec; latent attention's one `latent` a layer)."""
    return _kv_names(PAST_KEY_VALUES, n_layers, entries)


def layer_kv_names(names: list[str], layers: tuple[int, ...], per_layer: int = 2) -> list[str]:
    """The cache names of these layers, in order, from a (per_layer x layers) list of names."""
    return [names[per_layer * layer + entry] for layer in layers for entry in range(per_layer)]


def past_scale_names(n_layers: int) -> list[str]:
    """Scale inputs of the int8 serving graph, in the order of `past_names`."""
    return [kv_name(PAST_KEY_VALUES, i, kind) for i in range(n_layers) for kind in SCALE_KINDS]


def present_names(n_layers: int, entries: tuple[str, ...] = KV_KINDS) -> list[str]:
    """Cache outputs of the Optimum graph (past + new), in the order of `past_names`."""
    return _kv_names(PRESENT, n_layers, entries)


def new_kv_names(n_layers: int, entries: tuple[str, ...] = KV_KINDS) -> list[str]:
    """Cache outputs of the serving graph (new tokens only), in the order of `past_names`."""
    return _kv_names(NEW_KEY_VALUES, n_layers, entries)


def input_names(n_layers: int, int8: bool = False, entries: tuple[str, ...] = KV_KINDS) -> list[str]:
    """Graph inputs; `int8`: the int8 serving graph's, whose scales follow the int8 past."""
    scales = past_scale_names(n_layers) if int8 else []
    return [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *past_names(n_layers, entries), *scales]


def cache_input_names(n_layers: int, int8: bool = False, entries: tuple[str, ...] = KV_KINDS) -> list[list[str]]:
    """The cache inputs by array: [past] (float graphs) or [past, scales] (int8), each in layer order."""
    return [past_names(n_layers), past_scale_names(n_layers)] if int8 else [past_names(n_layers, entries)]


def output_names(n_layers: int, new_only: bool = False, entries: tuple[str, ...] = KV_KINDS) -> list[str]:
    """`present.*` (past + new, Optimum) or, for the serving graph, `new_key_values.*` (new only)."""
    return [LOGITS, *(new_kv_names(n_layers, entries) if new_only else present_names(n_layers, entries))]


def left_pad_batch(sequences: list[list[int]], pad_token_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, attention_mask, position_ids), each (B, longest), padding on the left.

    Positions count real tokens only, so a padded row sees the positions of a lone sequence.
    """
    longest = max(len(s) for s in sequences)
    ids = np.full((len(sequences), longest), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(sequences), longest), dtype=np.int64)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, longest - len(seq) :] = seq
            mask[row, longest - len(seq) :] = 1
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return ids, mask, positions


def target_logprobs(logits: np.ndarray, targets: list[int]) -> np.ndarray:
    """log softmax(logits)[i, targets[i]] for logits (T, vocab), in float64 (fp16 graphs included)."""
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    log_norm = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
    return logits[np.arange(len(targets)), targets] - log_norm


def right_pad_batch(sequences: list[list[int]], pad_token_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, attention_mask, position_ids), each (B, longest), padding on the right (the fused
    prompt graph's layout); a padded column repeats its row's last position, so no position exceeds
    the row's own."""
    longest = max(len(s) for s in sequences)
    ids = np.full((len(sequences), longest), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(sequences), longest), dtype=np.int64)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    positions = np.minimum(np.arange(longest, dtype=np.int64), np.maximum(mask.sum(1, keepdims=True) - 1, 0))
    return ids, mask, positions
