"""Building the model repository, as a library: `python -m export` is its command line.

For every scheme with shipped weights: export the float32 graph and the in-place serving
graph (and both again in float16) and the int8 cache's serving graph, write manifest.json and
genai_config.json, then optionally check parity against PyTorch and evaluate bits per byte.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch
from tqdm import tqdm

from contract.manifest import GENAI_CONFIG, MANIFEST, SERVING, SERVING_FP16, SERVING_INT8, serving_variant
from export.evaluate import bits_per_byte, evaluation_sequences
from export.manifest import build_manifest, genai_config, write_json
from export.onnx import OPSET, export_onnx
from export.runtime import OnnxCausalLM
from export.verify import FP32_TOLERANCE, ParityReport, check_int8_graph, check_parity, default_prompts, tolerance
from models.config import RopeScaling
from models.corpus import load_corpus
from models.positional import SCHEMES
from models.tokenizer import TOKENIZER
from models.train import WEIGHTS_DIR
from models.transformer import Transformer

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPOSITORY_ROOT / "model_repository"
# The file of each manifest variant. Variant names are the contract; file names are ours.
GRAPH_FILES = {
    "float32": "model.onnx",
    SERVING: "model.serving.onnx",
    "float16": "model.fp16.onnx",
    SERVING_FP16: "model.serving.fp16.onnx",
    SERVING_INT8: "model.serving.int8.onnx",
}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass
class ExportOptions:
    weights: Path = WEIGHTS_DIR
    out: Path = DEFAULT_OUT
    schemes: tuple[str, ...] = SCHEMES
    fp16: bool = True
    rope_scaling: tuple[str, ...] = ()
    verify: bool = True
    eval_windows: int = 16
    eval_contexts: tuple[int, ...] = (256, 512)
    corpus: Path | None = None


@dataclass
class ExportResult:
    name: str
    parameters: int
    val_bpb: float | None
    onnx_bytes: dict[str, int]  # per manifest variant, in export order
    export_seconds: float
    parity: list[ParityReport] = field(default_factory=list)
    test_bpb: dict[int, float | None] = field(default_factory=dict)
    int8_max_abs: float | None = None  # serving-int8 against PyTorch fed the same dequantized cache

    def parity_failures(self) -> list[str]:
        """`name variant` of every graph whose parity is outside its dtype's tolerance."""
        failures = [f"{p.name} {p.dtype}" for p in self.parity if not p.passed(tolerance(p.dtype))]
        if self.int8_max_abs is not None and not self.int8_max_abs <= FP32_TOLERANCE:
            failures.append(f"{self.name} {SERVING_INT8}")
        return failures


def rope_scaled_name(scaling: RopeScaling) -> str:
    """Model name of a rope model with inference-time scaling, e.g. rope-ntk-x4."""
    return f"rope-{scaling.kind}-x{scaling.factor:g}"


def export_model(name: str, model: Transformer, options: ExportOptions, training: dict[str, object]) -> ExportResult:
    """Every graph of one model, then its manifest (which hashes them) and genai config."""
    folder = options.out / name
    folder.mkdir(parents=True, exist_ok=True)
    started = time.time()
    variants: dict[str, Path] = {}
    for dtype in ("float32", "float16") if options.fp16 else ("float32",):
        for variant, new_only in ((dtype, False), (serving_variant(dtype), True)):
            variants[variant] = folder / GRAPH_FILES[variant]
            # A copy each time: export casts the model and the serving layout rewires its layers.
            export_onnx(copy.deepcopy(model), variants[variant], TORCH_DTYPES[dtype], new_only=new_only)
    variants[SERVING_INT8] = folder / GRAPH_FILES[SERVING_INT8]
    export_onnx(copy.deepcopy(model), variants[SERVING_INT8], int8=True)
    seconds = time.time() - started
    versions = {"torch": torch.__version__, "onnx": onnx.__version__, "python": sys.version.split()[0]}
    extra = {
        "parameters": model.num_parameters(),
        "training": {k: training.get(k) for k in ("val_bpb", "command", "tokens_seen")},
    }
    write_json(folder / MANIFEST, build_manifest(name, model.config, variants, OPSET, versions, extra))
    write_json(folder / GENAI_CONFIG, genai_config(model.config, variants["float32"].name))
    return ExportResult(
        name,
        model.num_parameters(),
        training.get("val_bpb"),  # type: ignore[arg-type]
        {variant: path.stat().st_size for variant, path in variants.items()},
        seconds,
    )


def load_weights(options: ExportOptions, scheme: str) -> tuple[Transformer, dict[str, object]]:
    folder = options.weights / scheme
    if not (folder / "model.safetensors").is_file():
        raise SystemExit(
            f"{folder / 'model.safetensors'}: no weights for scheme {scheme!r}; train with python -m models.train"
        )
    training_file = folder / "training.json"
    training = json.loads(training_file.read_text()) if training_file.is_file() else {}
    return Transformer.load(folder), training


def model_variants(options: ExportOptions) -> list[tuple[str, str, RopeScaling | None]]:
    """(model name, scheme, rope scaling): one per scheme plus any rope scaling variants."""
    variants: list[tuple[str, str, RopeScaling | None]] = [(scheme, scheme, None) for scheme in options.schemes]
    for spec in options.rope_scaling:
        scaling = RopeScaling.parse(spec)
        variants.append((rope_scaled_name(scaling), "rope", scaling))
    return variants


def run(options: ExportOptions) -> list[ExportResult]:
    """Export every model; with `verify`, check the float32/float16 graphs' parity and evaluate float32."""
    results = []
    corpus = load_corpus(options.corpus) if options.verify else None
    for name, scheme, scaling in tqdm(model_variants(options), desc="export", unit="model"):
        model, training = load_weights(options, scheme)
        model.config.rope_scaling = scaling
        if scaling is not None:
            scaling.original_max_positions = model.config.train_context
        result = export_model(name, model, options, training)
        if options.verify and corpus is not None:
            reference = Transformer.load(options.weights / scheme)
            reference.config.rope_scaling = scaling
            for dtype in ("float32", "float16")[: 1 + options.fp16]:
                runtime = OnnxCausalLM(options.out / name, dtype)
                result.parity.append(check_parity(reference, runtime, default_prompts(TOKENIZER.bos_token_id)))
            int8_runtime = OnnxCausalLM(options.out / name, SERVING_INT8)
            result.int8_max_abs = check_int8_graph(reference, int8_runtime, default_prompts(TOKENIZER.bos_token_id))
            runtime = OnnxCausalLM(options.out / name)
            for context in options.eval_contexts:
                sequences = evaluation_sequences(
                    corpus.splits["test"], context, options.eval_windows, TOKENIZER.bos_token_id
                )
                result.test_bpb[context] = bits_per_byte(runtime, sequences)
        results.append(result)
    return results
