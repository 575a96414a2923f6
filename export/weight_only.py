"""Weight-only int8 / int4 forms of an exported model: `python -m export.weight_only --bits 4 <folder>...`.

At GPT-2 small's width a decode step at one stream is bound by reading the weights (341 MB of
float32 a token, against 0.3-0.6 MB of K/V a token of context), so storing them in fewer bits is
the lever on single-stream speed. onnxruntime's own quantizer (`MatMulNBitsQuantizer`) rewrites
every MatMul with a constant weight as a `com.microsoft.MatMulNBits` node: blocks of `block_size`
weights along the input axis, one float scale and zero point a block, dequantized inside the kernel.
Activations, K/V, norms and the embedding stay float32. The derived model (`<name>-int<bits>`, a
folder beside the source) carries every graph of the source rewritten this way, so the service
serves it like any model; its manifest records `weight_only` (bits, block size). What it changes
in the logits is measured by `logit_differences` on held-out text against the source's float32 graph.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from contract.cli import HelpFormatter
from contract.manifest import MANIFEST, Manifest, sha256_file
from export.runtime import OnnxCausalLM
from models.corpus import load_corpus
from models.evaluation import evaluation_sequences
from models.tokenizer import TOKENIZER

BLOCK_SIZE = 32  # weights per scale along the input axis (onnxruntime-genai's int4 default)
COPIED = ("genai_config.json", "tokenizer.json")


def weight_only_name(name: str, bits: int, accuracy_level: int | None = None) -> str:
    return f"{name}-int{bits}" + ("" if accuracy_level is None else f"-acc{accuracy_level}")


def quantize_graph(
    source: Path, target: Path, bits: int, block_size: int = BLOCK_SIZE, accuracy_level: int | None = None
) -> None:
    """`source` with every constant-weight MatMul as MatMulNBits of `bits` bits (symmetric blocks);
    `accuracy_level` 4 lets the kernel quantize the activations to int8 too (its int8 dot products)."""
    quantizer = MatMulNBitsQuantizer(
        onnx.load(str(source)), bits=bits, block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level
    )
    quantizer.process()
    onnx.save(quantizer.model.model, str(target))


def derive_weight_only(
    source: Path, bits: int, block_size: int = BLOCK_SIZE, accuracy_level: int | None = None
) -> Path:
    """The weight-only form of the model in `source`, written beside it; returns its folder."""
    manifest = Manifest.load(source)
    name = weight_only_name(manifest.name, bits, accuracy_level)
    folder = source.parent / name
    folder.mkdir(exist_ok=True)
    data = json.loads((source / MANIFEST).read_text())
    for variant, entry in data["variants"].items():
        quantize_graph(source / entry["file"], folder / entry["file"], bits, block_size, accuracy_level)
        entry["sha256"] = sha256_file(folder / entry["file"])
        logging.info("%s %s: %.1f MB", name, variant, (folder / entry["file"]).stat().st_size / 1e6)
    data |= {"name": name, "sha256": data["variants"]["float32"]["sha256"]}
    data["weight_only"] = {"bits": bits, "block_size": block_size, "accuracy_level": accuracy_level,
                           "source": manifest.name}  # fmt: skip
    (folder / MANIFEST).write_text(json.dumps(data, indent=2) + "\n")
    for file in COPIED:
        if (source / file).is_file():
            shutil.copy(source / file, folder / file)
    return folder


def logit_differences(source: Path, derived: Path, windows: int = 4, context: int = 256) -> tuple[float, float, float]:
    """(max, mean) absolute difference of the float32 graphs' logits, `derived` against `source`, over
    `windows` windows of `context` bytes of the test split (held-out text), and the mean absolute
    logit of `source` (the scale they are read against)."""
    stream = load_corpus(None).splits["test"]
    sequences = evaluation_sequences(stream, context, windows, TOKENIZER.bos_token_id)
    reference, quantized = OnnxCausalLM(source), OnnxCausalLM(derived)
    differences, scale = [], []
    for ids in sequences:
        batch = np.array([ids], dtype=np.int64)
        mask, positions = np.ones_like(batch), np.arange(len(ids), dtype=np.int64)[None]
        want, _ = reference.forward(batch, mask, positions, reference.empty_past(1))
        got, _ = quantized.forward(batch, mask, positions, quantized.empty_past(1))
        differences.append(np.abs(got - want))
        scale.append(float(np.abs(want).mean()))
    every = np.concatenate([d.reshape(-1) for d in differences])
    return float(every.max()), float(every.mean()), float(np.mean(scale))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m export.weight_only", description=__doc__,
                                     formatter_class=HelpFormatter)  # fmt: skip
    parser.add_argument(
        "folders", type=Path, nargs="+", help="exported model folders (e.g. model_repository-small/rope)"
    )
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4, help="bits a weight")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="weights per scale")
    parser.add_argument(
        "--accuracy-level", type=int, choices=(1, 2, 3, 4), default=None,
        help="MatMulNBits accuracy_level (4: activations quantized to int8 inside the kernel); named -acc<N>",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for source in args.folders:
        folder = derive_weight_only(source, args.bits, args.block_size, args.accuracy_level)
        largest, mean, scale = logit_differences(source, folder)
        print(f"{folder.name}: logits against {source.name} on held-out text: max |diff| {largest:.4f}, "
              f"mean {mean:.5f} (mean |logit| {scale:.4f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
