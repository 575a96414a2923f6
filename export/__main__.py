"""Build the model repository: `python -m export`.

For every scheme with shipped weights: export float32 and float16 graphs with a KV cache,
write manifest.json and genai_config.json, check parity and print an evaluation table.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch
from tqdm import tqdm

from export.evaluate import bits_per_byte, evaluation_sequences
from export.manifest import GENAI_CONFIG, MANIFEST, build_manifest, genai_config, write_json
from export.onnx import OPSET, export_onnx
from export.runtime import OnnxCausalLM
from export.verify import FP16_TOLERANCE, FP32_TOLERANCE, ParityReport, check_parity, default_prompts
from models.config import SCHEMES, RopeScaling
from models.corpus import load_corpus
from models.tokenizer import TOKENIZER
from models.train import WEIGHTS_DIR
from models.transformer import Transformer

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPOSITORY_ROOT / "model_repository"


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
    onnx_bytes: dict[str, int]
    export_seconds: float
    parity: list[ParityReport] = field(default_factory=list)
    test_bpb: dict[int, float | None] = field(default_factory=dict)


def export_model(name: str, model: Transformer, options: ExportOptions, training: dict[str, object]) -> ExportResult:
    folder = options.out / name
    folder.mkdir(parents=True, exist_ok=True)
    started = time.time()
    variants = {"float32": folder / "model.onnx", "serving-float32": folder / "model.serving.onnx"}
    export_onnx(model, variants["float32"], torch.float32)
    export_onnx(copy.deepcopy(model), variants["serving-float32"], torch.float32, new_only=True)
    if options.fp16:
        variants["float16"] = folder / "model.fp16.onnx"
        export_onnx(copy.deepcopy(model), variants["float16"], torch.float16)
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
        {dtype: path.stat().st_size for dtype, path in variants.items()},
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
        variants.append((f"rope-{scaling.kind}-x{scaling.factor:g}", "rope", scaling))
    return variants


def run(options: ExportOptions) -> list[ExportResult]:
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
            runtime = OnnxCausalLM(options.out / name)
            for context in options.eval_contexts:
                sequences = evaluation_sequences(
                    corpus.splits["test"], context, options.eval_windows, TOKENIZER.bos_token_id
                )
                result.test_bpb[context] = bits_per_byte(runtime, sequences)
        results.append(result)
    return results


def format_table(results: list[ExportResult], contexts: tuple[int, ...]) -> str:
    header = ["model", "params", "val bpb@256"] + [f"test bpb@{c}" for c in contexts]
    header += ["parity fp32", "parity fp16", "cached=full", "onnx MB fp32/serving/fp16", "export s"]
    rows = [header]

    def fmt(value: float | None, digits: int = 3) -> str:
        return "not servable" if value is None else f"{value:.{digits}f}"

    for r in results:
        parity = {p.dtype: p for p in r.parity}
        cached = parity["float32"].cached_vs_full_max_abs if "float32" in parity else None
        rows.append(
            [
                r.name,
                f"{r.parameters:,}",
                fmt(r.val_bpb),
                *[fmt(r.test_bpb.get(c)) if c in r.test_bpb else "-" for c in contexts],
                f"{parity['float32'].max_abs:.1e}" if "float32" in parity else "-",
                f"{parity['float16'].max_abs:.1e}" if "float16" in parity else "-",
                f"{cached:.1e}" if cached is not None else "-",
                "/".join(f"{size / 1e6:.1f}" for size in r.onnx_bytes.values()),
                f"{r.export_seconds:.1f}",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> ExportOptions:
    defaults = ExportOptions()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, default=defaults.weights, help="folder of trained weights per scheme")
    parser.add_argument("--out", type=Path, default=defaults.out, help="model repository to write")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(defaults.schemes))
    parser.add_argument("--no-fp16", dest="fp16", action="store_false", help="skip the float16 graphs")
    parser.add_argument(
        "--rope-scaling", nargs="*", default=[], metavar="KIND:FACTOR",
        help="extra rope models with inference-time scaling, e.g. ntk:4 yarn:8 linear:2",
    )  # fmt: skip
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="skip parity and evaluation")
    parser.add_argument("--eval-windows", type=int, default=defaults.eval_windows)
    parser.add_argument("--eval-contexts", type=int, nargs="+", default=list(defaults.eval_contexts))
    parser.add_argument("--corpus", type=Path, default=None, help="evaluation text (default: stdlib test split)")
    args = parser.parse_args(argv)
    return ExportOptions(
        weights=args.weights,
        out=args.out,
        schemes=tuple(args.schemes),
        fp16=args.fp16,
        rope_scaling=tuple(args.rope_scaling),
        verify=args.verify,
        eval_windows=args.eval_windows,
        eval_contexts=tuple(args.eval_contexts),
        corpus=args.corpus,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    options = parse_args(argv)
    started = time.time()
    results = run(options)
    print(format_table(results, options.eval_contexts if options.verify else ()))
    print(f"\nmodel repository: {options.out}  ({time.time() - started:.0f} s in all)")
    failures = [
        f"{p.name} {p.dtype}"
        for r in results
        for p in r.parity
        if not p.passed(FP32_TOLERANCE if p.dtype == "float32" else FP16_TOLERANCE)
    ]
    if failures:
        print(f"parity FAILED for: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
