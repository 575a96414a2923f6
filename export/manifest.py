"""The manifest that travels with every exported model, and the onnxruntime-genai config.

The manifest is the one place the service reads limits from (the service never branches on
the scheme), and it carries the tokenizer so any client tokenizes exactly as in training.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.config import ModelConfig
from models.tokenizer import TOKENIZER

MANIFEST = "manifest.json"
GENAI_CONFIG = "genai_config.json"
DTYPE_BYTES = {"float32": 4, "float16": 2}
SERVING = "serving-float32"  # variant name of the in-place serving graph


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ManifestError(ValueError):
    """A model folder whose manifest or ONNX file cannot be trusted."""


@dataclass(frozen=True)
class Manifest:
    """Typed view of manifest.json."""

    path: Path
    data: dict[str, object]

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def name(self) -> str:
        return str(self.data["name"])

    @property
    def scheme(self) -> str:
        return str(self.data["scheme"])

    @property
    def n_layers(self) -> int:
        return int(self.data["n_layers"])  # type: ignore[arg-type]

    @property
    def n_heads(self) -> int:
        return int(self.data["n_heads"])  # type: ignore[arg-type]

    @property
    def head_dim(self) -> int:
        return int(self.data["head_dim"])  # type: ignore[arg-type]

    @property
    def vocab_size(self) -> int:
        return int(self.data["vocab_size"])  # type: ignore[arg-type]

    @property
    def max_positions(self) -> int | None:
        value = self.data["max_positions"]
        return None if value is None else int(value)  # type: ignore[arg-type]

    @property
    def train_context(self) -> int:
        return int(self.data["train_context"])  # type: ignore[arg-type]

    @property
    def tokenizer(self) -> dict[str, object]:
        return dict(self.data["tokenizer"])  # type: ignore[call-overload]

    def variant(self, dtype: str = "float32") -> dict[str, str]:
        """{'file', 'sha256'} of the graph in `dtype`."""
        variants: dict[str, dict[str, str]] = self.data["variants"]  # type: ignore[assignment]
        if dtype not in variants:
            raise ManifestError(f"{self.path}: no {dtype} variant (have {', '.join(variants)})")
        return variants[dtype]

    def onnx_path(self, dtype: str = "float32") -> Path:
        return self.folder / self.variant(dtype)["file"]

    def kv_bytes_per_token(self, dtype: str = "float32") -> int:
        """Cache bytes one token occupies: K and V, every layer and head."""
        return 2 * self.n_layers * self.n_heads * self.head_dim * DTYPE_BYTES[dtype.removeprefix("serving-")]

    def verify(self, dtype: str = "float32") -> Path:
        """Check the ONNX file against the recorded sha256; raise naming the bad file."""
        path = self.onnx_path(dtype)
        if not path.is_file():
            raise ManifestError(f"{path}: ONNX file named by {self.path} is missing")
        actual = sha256_file(path)
        expected = self.variant(dtype)["sha256"]
        if actual != expected:
            raise ManifestError(f"{path}: sha256 {actual} does not match {expected} recorded in {self.path}")
        return path

    def verify_all(self) -> None:
        """Check every graph the manifest lists (a server refuses to start on any bad file)."""
        for variant in self.data["variants"]:  # type: ignore[union-attr]
            self.verify(variant)

    @classmethod
    def load(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as error:
            raise ManifestError(f"{path}: manifest is missing") from error
        except json.JSONDecodeError as error:
            raise ManifestError(f"{path}: manifest is not valid JSON ({error})") from error
        missing = [key for key in REQUIRED_KEYS if key not in data]
        if missing:
            raise ManifestError(f"{path}: manifest lacks {', '.join(missing)}")
        return cls(path, data)


REQUIRED_KEYS = (
    "name", "scheme", "n_layers", "n_heads", "head_dim", "d_model", "vocab_size", "max_positions",
    "train_context", "dtype", "opset", "sha256", "variants", "tokenizer",
)  # fmt: skip


def build_manifest(
    name: str,
    config: ModelConfig,
    variants: dict[str, Path],
    opset: int,
    versions: dict[str, str],
    extra: dict[str, object],
) -> dict[str, object]:
    files = {dtype: {"file": path.name, "sha256": sha256_file(path)} for dtype, path in variants.items()}
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
            "layout": "[batch, n_heads, sequence, head_dim] per layer, key and value",
            "bytes_per_token": {
                dtype: 2 * config.n_layers * config.d_model * DTYPE_BYTES[dtype] for dtype in DTYPE_BYTES
            },
        },
        # model.serving.onnx: same inputs; outputs logits and new_key_values.{i}.key|value (the
        # new tokens only). It reads the past in place, so masked unused slots may sit in it.
        "serving_outputs": ["logits", "new_key_values.{i}.key", "new_key_values.{i}.value"],
        "inputs": [
            "input_ids",
            "attention_mask",
            "position_ids",
            "past_key_values.{i}.key",
            "past_key_values.{i}.value",
        ],
        "outputs": ["logits", "present.{i}.key", "present.{i}.value"],
        "tokenizer": TOKENIZER.manifest(),
        "versions": versions,
        **extra,
    }


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
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
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


def write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value)}")
