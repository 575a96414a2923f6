"""Writing the manifest that travels with every exported model, and the onnxruntime-genai config.

The reader (`contract.manifest.Manifest`) and the graph names live in `contract`, which the
service imports too; this module only fills them in from a model's config.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from contract.graph import (
    ATTENTION_MASK,
    INPUT_IDS,
    KV_KINDS,
    LOCAL_ATTENTION_MASK,
    LOGITS,
    NEW_KEY_VALUES,
    PAST_KEY_VALUES,
    POSITION_IDS,
    PRESENT,
    kv_name,
)
from contract.kv_spec import LayerCacheSpec
from contract.manifest import DTYPE_BYTES, PREFILL_FUSED, SERVING_FUSED, SERVING_FUSED_INT8, sha256_file
from models.checkpoints import WEIGHTS_DIR
from models.config import ModelConfig
from models.positional import SCHEMES, build_positional
from models.tokenizer import TOKENIZER


def build_manifest(
    name: str,
    config: ModelConfig,
    variants: dict[str, Path],
    opset: int,
    versions: dict[str, str],
    extra: dict[str, object],
) -> dict[str, object]:
    """manifest.json for one model: `variants` maps a variant name (see contract.manifest) to its graph."""
    files = {dtype: {"file": path.name, "sha256": sha256_file(path)} for dtype, path in variants.items()}
    spec = layer_cache_spec(config)
    return {
        "name": name,
        "scheme": config.scheme,
        "n_layers": config.n_layers,
        "n_heads": config.n_heads,
        "head_dim": config.head_dim,
        "d_model": config.d_model,
        "d_ff": config.d_ff,
        "vocab_size": config.vocab_size,
        "max_positions": config.max_positions,
        "train_context": config.train_context,
        "rope_scaling": None if config.rope_scaling is None else vars(config.rope_scaling),
        "dtype": "float32",
        "file": files["float32"]["file"],
        "sha256": files["float32"]["sha256"],
        "variants": files,
        "opset": opset,
        "kv_cache": {
            "layout": "[batch, heads, sequence, width] per layer and entry (spec.entries)",
            "spec": spec.to_json(),
            "bytes_per_token": {
                dtype: config.n_layers * spec.token_floats * DTYPE_BYTES[dtype] for dtype in DTYPE_BYTES
            },
        },
        # The serving graphs (serving-<dtype>): same inputs; outputs logits and new_key_values.{i}.*
        # (the new tokens only). They read the past in place, so masked unused slots may sit in it.
        "serving_outputs": [LOGITS, *_kv_patterns(NEW_KEY_VALUES, "{i}", spec.entries)],
        "inputs": [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *_kv_patterns(PAST_KEY_VALUES, "{i}", spec.entries)],
        "outputs": [LOGITS, *_kv_patterns(PRESENT, "{i}", spec.entries)],
        "layer_groups": layer_groups(config),
        **({"local_cache": local_cache(config)} if local_cache(config) and SERVING_FUSED in variants else {}),
        "cache_eviction": cache_eviction(config),
        "segment_reuse": segment_reuse(config),
        **({"fused_attention": fused_attention()} if SERVING_FUSED in variants else {}),
        "tokenizer": TOKENIZER.manifest(),
        "versions": versions,
        **extra,
    }


def layer_cache_spec(config: ModelConfig) -> LayerCacheSpec:
    """What each layer of the model caches per token: its attention layer says (contract.kv_spec)."""
    attention = build_positional(config).attention(config)
    return LayerCacheSpec.full(config.n_heads, config.head_dim) if attention is None else attention.cache_spec()


def layer_groups(config: ModelConfig) -> list[dict[str, object]]:
    """The layers that attend alike (contract.manifest.LayerGroupSpec): one global group, or a hybrid's
    sliding-window local group and its global group."""
    return [
        {
            "name": group.name,
            "layers": list(group.layers),
            "window": group.window,
            "rotates_keys": group.positional.rotates_keys,
        }
        for group in build_positional(config).layer_groups()
    ]


def local_cache(config: ModelConfig) -> dict[str, object] | None:
    """A hybrid's fused graphs read its windowed layers' past apart (contract.manifest.LocalCache):
    which layers, their window, and the mask their lengths come from. None: every layer is global."""
    groups = [group for group in build_positional(config).layer_groups() if group.window is not None]
    if not groups:
        return None
    return {
        "layers": sorted(layer for group in groups for layer in group.layers),
        "window": max(group.window for group in groups if group.window is not None),
        "mask": LOCAL_ATTENTION_MASK,
        "variants": [SERVING_FUSED, PREFILL_FUSED, SERVING_FUSED_INT8],
    }


def cache_eviction(config: ModelConfig) -> dict[str, object] | None:
    """What the service needs to run cache policies for this scheme (contract.manifest.CacheEviction).
    None where bounded policies do not apply (a hybrid: `PositionalScheme.bounded_policies`)."""
    scheme = build_positional(config)
    if not scheme.bounded_policies:
        return None
    inv_freq = None
    if scheme.rotates_keys:
        inv_freq = [float(f) for f in scheme.key_frequencies()]
    return {"positions": scheme.eviction_positions, "rotary_inv_freq": inv_freq}


def segment_reuse(config: ModelConfig) -> dict[str, object]:
    """How K/V computed for a text at position 0 serves it at another offset (contract.manifest.SegmentReuse)."""
    scheme = build_positional(config)
    inv_freq = [float(f) for f in scheme.key_frequencies()] if scheme.segment_reuse == "rotate" else None
    # Only layers whose keys carry a rotation are turned (a hybrid's global NoPE layer is reused as is).
    rotated = [layer for group in scheme.layer_groups() if group.positional.rotates_keys for layer in group.layers]
    return {"mode": scheme.segment_reuse, "rotary_inv_freq": inv_freq, "rotated_layers": rotated}


def fused_attention() -> dict[str, object]:
    """The fused decode graph's contract (contract.manifest.FusedAttention; export/fused.py)."""
    return {
        "variant": SERVING_FUSED,
        "dtype": "float32",
        "op": "com.microsoft.GroupQueryAttention",
        # present.{i}.* alias past_key_values.{i}.*: the kernel writes the new token's K/V at each
        # row's length (sum(attention_mask) - 1) itself, so the caller appends nothing.
        "shares_cache_buffer": True,
        "inputs": [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *_kv_patterns(PAST_KEY_VALUES, "{i}")],
        "outputs": [LOGITS, *_kv_patterns(PRESENT, "{i}")],
        # Decode only (one token per row), rows left-aligned; bounded and int8 policies keep the
        # explicit serving graph (the kernel cannot shift rows by one token or use per-token scales).
        "policies": ["full"],
    }


def _kv_patterns(prefix: str, placeholder: str, entries: tuple[str, ...] = KV_KINDS) -> list[str]:
    """Documented name patterns, e.g. past_key_values.{i}.key and .value."""
    return [kv_name(prefix, placeholder, kind) for kind in entries]


def genai_config(config: ModelConfig, onnx_file: str) -> dict[str, object]:
    """onnxruntime-genai config: model type `llama` (generic decoder with separate K/V names).

    Context length is the hard limit for `learned`, else what we evaluate up to (8x training).
    """
    context = config.max_positions or 8 * config.train_context
    return {
        "model": {
            "bos_token_id": TOKENIZER.bos_token_id,
            "eos_token_id": TOKENIZER.eos_token_id,
            "pad_token_id": TOKENIZER.pad_token_id,
            "context_length": context,
            "vocab_size": config.vocab_size,
            "type": "llama",
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": onnx_file,
                "head_size": config.head_dim,
                "hidden_size": config.d_model,
                "num_attention_heads": config.n_heads,
                "num_key_value_heads": config.n_heads,
                "num_hidden_layers": config.n_layers,
                "inputs": {
                    "input_ids": INPUT_IDS,
                    "attention_mask": ATTENTION_MASK,
                    "position_ids": POSITION_IDS,
                    "past_key_names": kv_name(PAST_KEY_VALUES, "%d", "key"),
                    "past_value_names": kv_name(PAST_KEY_VALUES, "%d", "value"),
                },
                "outputs": {
                    "logits": LOGITS,
                    "present_key_names": kv_name(PRESENT, "%d", "key"),
                    "present_value_names": kv_name(PRESENT, "%d", "value"),
                },
            },
        },
        "search": {
            "do_sample": False,
            "max_length": context,
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


TOKENIZER_JSON = "tokenizer.json"
SPECIAL_TOKENS = {"bos_token_id": "<|bos|>", "eos_token_id": "<|eos|>", "pad_token_id": "<|pad|>"}


def byte_characters() -> list[str]:
    """GPT-2's byte-to-unicode table (what a ByteLevel pre-tokenizer writes each byte as): printable
    bytes stand for themselves, the others take the code points from 256 on, in order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


def huggingface_tokenizer() -> dict[str, object]:
    """The byte vocabulary as a Hugging Face `tokenizer.json` (read by `tokenizers`, transformers and
    onnxruntime-genai): a ByteLevel pre-tokenizer and a BPE model without merges whose token for each
    byte has the byte's value as id, BOS prepended by the post-processor, and the specials after 255.
    The specials are vocabulary entries, not added tokens: `tokenizers` cuts added tokens out of the
    input text, and the service never does (a text holding "<|eos|>" is those seven bytes), while no
    merge can join bytes into a special. Decoding renders them by name."""
    specials = {SPECIAL_TOKENS[key]: int(value) for key, value in TOKENIZER.manifest().items() if key in SPECIAL_TOKENS}
    bos = SPECIAL_TOKENS["bos_token_id"]
    single = [{"SpecialToken": {"id": bos, "type_id": 0}}] if TOKENIZER.add_bos else []
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [*single, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [*single, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}],
            "special_tokens": {bos: {"id": bos, "ids": [specials[bos]], "tokens": [bos]}} if single else {},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {**{char: byte for byte, char in enumerate(byte_characters())}, **specials},
            "merges": [],
        },
    }


def write_tokenizer_json(folder: Path) -> Path:
    """Write the byte vocabulary's `tokenizer.json` into a model's folder. Export writes it into each
    model of the repository; the shipped weights' folders (models/weights/<scheme>/) carry the same
    file, for tools that start from the weights, rewritten by
    `python -c 'from export.manifest import ship_tokenizers; ship_tokenizers()'`."""
    path = folder / TOKENIZER_JSON
    write_json(path, huggingface_tokenizer())
    return path


def ship_tokenizers(weights: Path = WEIGHTS_DIR) -> list[Path]:
    """`tokenizer.json` into every scheme's weights folder that exists under `weights`."""
    return [write_tokenizer_json(weights / scheme) for scheme in SCHEMES if (weights / scheme).is_dir()]


def write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value)}")
