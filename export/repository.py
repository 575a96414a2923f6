"""Building the model repository, as a library: `python -m export` is its command line.

For every scheme with shipped weights: export the graphs this device serves (float32 and its
in-place serving graph, the int8 cache's serving graph, the fused decode and prompt graphs (`export.fused`), and
both float16 graphs where CUDA ONNX Runtime is present or when asked), write manifest.json and
genai_config.json, then optionally check parity against PyTorch and evaluate bits per byte. The
models (`model_variants`: weights, rope scalings, further seeds, random sizes) are `export.sources`'s
`ModelSpec`s; they are exported side by side in worker processes (`export.workers`); rope scaling
variants are derived from the exported rope graphs by rewriting constants (`export.rope_variants`),
not traced again.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import Future, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx
import onnxruntime
import torch

from contract.manifest import (
    GENAI_CONFIG,
    MANIFEST,
    PREFILL_FUSED,
    PREFILL_UP_PROJECTED,
    SERVING,
    SERVING_FP16,
    SERVING_FUSED,
    SERVING_FUSED_INT8,
    SERVING_INT8,
    variant_dtype,
)
from contract.paths import REPOSITORY_ROOT
from export.evaluate import onnx_bits_per_byte
from export.fused import export_fused
from export.int8_channels import kv_channel_scales
from export.manifest import build_manifest, genai_config, layer_cache_spec, write_json, write_tokenizer_json
from export.onnx import OPSET, export_onnx
from export.rope_variants import derive_rope_variant
from export.runtime import OnnxCausalLM
from export.sources import (
    ROPE_SCHEME,
    ModelSpec,
    extra_seeds,
    reference_model,
    rope_scaled_name,
    training_seed,
    weights_folder,
)
from export.verify import (
    FP32_TOLERANCE,
    INT8_CHANNEL_TOLERANCE,
    ParityReport,
    check_fused_graph,
    check_fused_int8_graph,
    check_int8_graph,
    check_parity,
    check_prefill_graph,
    default_prompts,
    tolerance,
    torch_reference,
)
from export.workers import PROGRESS_POLL_S, ExportProgress, available_cores, executor
from models.checkpoints import WEIGHTS_DIR, trained_schemes
from models.config import ModelConfig, RopeScaling
from models.corpus import load_corpus
from models.evaluation import evaluation_sequences
from models.sizes import RANDOM_SCHEMES, RANDOM_SEED, RANDOM_SIZES
from models.tokenizer import TOKENIZER
from models.transformer import Transformer

DEFAULT_OUT = REPOSITORY_ROOT / "model_repository"
# The file of each manifest variant, in export order. Variant names are the contract; file names are ours.
GRAPH_FILES = {
    "float32": "model.onnx",
    SERVING: "model.serving.onnx",
    "float16": "model.fp16.onnx",
    SERVING_FP16: "model.serving.fp16.onnx",
    SERVING_INT8: "model.serving.int8.onnx",
    SERVING_FUSED: "model.serving.fused.onnx",
    PREFILL_FUSED: "model.prefill.fused.onnx",
    SERVING_FUSED_INT8: "model.serving.fused.int8.onnx",
    PREFILL_UP_PROJECTED: "model.prefill.up.onnx",
}
FP16_GRAPHS = ("float16", SERVING_FP16)
# The graphs whose parity against PyTorch export checks (serving graphs are held to these in tests).
PARITY_GRAPHS = ("float32", "float16")
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}
# The graphs a random size gets: the decode and prompt graphs the service runs (the explicit serving
# graph stays: bounded cache policies decode through it) beside float32, onnxruntime-genai's.
RANDOM_GRAPHS = (SERVING, SERVING_FUSED, PREFILL_FUSED, PREFILL_UP_PROJECTED)


# The graphs a cache that is not K and V (latent attention, contract.kv_spec) is exported as: the traced
# ones. The int8 graphs quantize K and V, and the fused ones are GroupQueryAttention over K and V.
TRACED_GRAPHS = ("float32", SERVING, "float16", SERVING_FP16)


def graphs_for(scheme: str, graphs: tuple[str, ...]) -> tuple[str, ...]:
    """The graphs of `graphs` a scheme's cache can be served by: the K/V kernels' for K and V, the
    traced ones and the prompts' own form for latent attention."""
    if layer_cache_spec(ModelConfig(scheme=scheme)).key_value:
        return tuple(variant for variant in graphs if variant != PREFILL_UP_PROJECTED)
    return tuple(variant for variant in graphs if variant in (*TRACED_GRAPHS, PREFILL_UP_PROJECTED))


def cuda_onnxruntime() -> bool:
    """True where the installed ONNX Runtime can run CUDA: the only place float16 graphs are served."""
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


@dataclass
class ExportOptions:
    weights: Path = WEIGHTS_DIR
    out: Path = DEFAULT_OUT
    # None: every scheme of SCHEMES whose weights are in `weights` (a scheme still in training is skipped).
    schemes: tuple[str, ...] | None = None
    # Float16 graphs: None = only where CUDA ONNX Runtime is present (CPUs serve float32).
    fp16: bool | None = None
    # Manifest variants to write (float32 always: the manifest's main graph); None = by `fp16`.
    graphs: tuple[str, ...] | None = None
    rope_scaling: tuple[str, ...] = ()
    verify: bool = True
    eval_windows: int = 16
    eval_contexts: tuple[int, ...] = (256, 512)
    corpus: Path | None = None
    # Processes exporting models side by side: 0 = one per available core, at most one per model.
    workers: int = 0
    # Also export every further training seed of the schemes found in `weights` (SEED_FOLDER), as
    # `<scheme>@seed<N>` (contract.names): scored beside the served models, served only when named.
    # Off by default: neither the demo nor `compare --quick` uses them, and `compare` exports the ones
    # it scores (loadtest.study.serving.ensure_repository), so a first run exports one model a scheme.
    extra_seeds: bool = False
    # Only the models of these names among the above (None: all of them), e.g. the ones a repository lacks.
    names: tuple[str, ...] | None = None
    # A size of models.sizes.RANDOM_SIZES: random weights from a fixed seed at that size instead of
    # the trained ones (None: the trained weights in `weights`); `n_layers` makes a shallower stand-in.
    size: str | None = None
    n_layers: int | None = None

    def chosen_schemes(self) -> tuple[str, ...]:
        """The schemes to export: those asked for, or every one with weights (a random size: RANDOM_SCHEMES)."""
        if self.schemes is not None:
            return self.schemes
        return RANDOM_SCHEMES if self.size is not None else trained_schemes(self.weights)

    def graph_variants(self) -> tuple[str, ...]:
        """The variants every model gets, in GRAPH_FILES order."""
        if self.graphs is not None:
            unknown = sorted(set(self.graphs) - set(GRAPH_FILES))
            if unknown:
                raise ValueError(f"unknown graph variants {unknown}; choose from {', '.join(GRAPH_FILES)}")
            wanted = {"float32", *self.graphs}
        elif self.size is not None:  # what the service needs, no more: 340 MB a graph at `small`
            wanted = {"float32", *RANDOM_GRAPHS}
        else:
            fp16 = cuda_onnxruntime() if self.fp16 is None else self.fp16
            wanted = set(GRAPH_FILES) - (set() if fp16 else set(FP16_GRAPHS))
        return tuple(variant for variant in GRAPH_FILES if variant in wanted)


@dataclass
class ExportResult:
    name: str
    parameters: int
    val_bpb: float | None
    onnx_bytes: dict[str, int]  # per manifest variant, in export order
    export_seconds: float  # tracing (or, for a derived rope variant, rewriting) its graphs
    parity: list[ParityReport] = field(default_factory=list)
    test_bpb: dict[int, float | None] = field(default_factory=dict)
    int8_max_abs: float | None = None  # serving-int8 against PyTorch fed the same dequantized cache
    fused_max_abs: float | None = None  # serving-fused decode steps against PyTorch (nan: greedy differed)
    prefill_max_abs: float | None = None  # prefill-fused prompt logits against PyTorch
    fused_int8_max_abs: float | None = None  # serving-fused-int8 steps against the int8 streaming reference

    @property
    def float32_limit(self) -> float:
        """What a float32 graph is held to: FP32_TOLERANCE, raised for a model whose PyTorch float32
        rounding is larger (ParityReport.limit)."""
        return max((p.limit(FP32_TOLERANCE) for p in self.parity), default=FP32_TOLERANCE)

    def parity_failures(self) -> list[str]:
        """`name variant` of every graph whose parity is outside its dtype's tolerance."""
        failures = [f"{p.name} {p.dtype}" for p in self.parity if not p.passed(tolerance(p.dtype))]
        limit = self.float32_limit
        if self.int8_max_abs is not None and not self.int8_max_abs <= limit:
            failures.append(f"{self.name} {SERVING_INT8}")
        if self.fused_max_abs is not None and not self.fused_max_abs <= limit:
            failures.append(f"{self.name} {SERVING_FUSED}")
        if self.prefill_max_abs is not None and not self.prefill_max_abs <= limit:
            failures.append(f"{self.name} {PREFILL_FUSED}")
        if self.fused_int8_max_abs is not None and not self.fused_int8_max_abs <= INT8_CHANNEL_TOLERANCE:
            failures.append(f"{self.name} {SERVING_FUSED_INT8}")
        return failures


@dataclass
class Verification:
    """What `verify_model` measures of one exported model."""

    parity: list[ParityReport]
    int8_max_abs: float | None
    test_bpb: dict[int, float | None]
    fused_max_abs: float | None = None
    prefill_max_abs: float | None = None
    fused_int8_max_abs: float | None = None


def export_model(
    name: str,
    model: Transformer,
    options: ExportOptions,
    training: dict[str, object],
    graphs: tuple[str, ...] | None = None,
) -> ExportResult:
    """Every graph of one model (`graphs`, default options.graph_variants()), then its manifest
    (which hashes them) and genai config."""
    folder = options.out / name
    folder.mkdir(parents=True, exist_ok=True)
    started = time.time()
    variants: dict[str, Path] = {}
    extra: dict[str, object] = {}
    for variant in graphs or graphs_for(model.config.scheme, options.graph_variants()):
        variants[variant] = folder / GRAPH_FILES[variant]
        # A copy each time: export casts the model and the serving layout rewires its layers.
        if variant == SERVING_INT8:
            export_onnx(copy.deepcopy(model), variants[variant], int8=True)
        elif variant in (SERVING_FUSED, PREFILL_FUSED):
            export_fused(copy.deepcopy(model), variants[variant], prompt=variant == PREFILL_FUSED)
        elif variant == PREFILL_UP_PROJECTED:
            export_onnx(copy.deepcopy(model), variants[variant], prompts=True)
        elif variant == SERVING_FUSED_INT8:
            scales = kv_channel_scales(copy.deepcopy(model))
            export_fused(copy.deepcopy(model), variants[variant], int8_scales=scales)
            extra["int8_channel_scales"] = scales.reshape(-1).tolist()
        else:
            dtype = TORCH_DTYPES[variant_dtype(variant)]
            export_onnx(copy.deepcopy(model), variants[variant], dtype, new_only=variant != variant_dtype(variant))
    seconds = time.time() - started
    versions = {"torch": torch.__version__, "onnx": onnx.__version__, "python": sys.version.split()[0]}
    if options.size is not None:  # ListModels and every report say so (contract.manifest.Manifest.random_weights)
        extra |= {"size": options.size, "random_weights": {"seed": RANDOM_SEED}}
    extra |= {
        "parameters": model.num_parameters(),
        "training": {k: training.get(k) for k in ("val_bpb", "command", "tokens_seen")}
        | {"seed": training_seed(training)},
    }
    write_json(folder / MANIFEST, build_manifest(name, model.config, variants, OPSET, versions, extra))
    if layer_cache_spec(model.config).key_value:  # onnxruntime-genai's decoder caches a key and a value a layer
        write_json(folder / GENAI_CONFIG, genai_config(model.config, variants["float32"].name))
    write_tokenizer_json(folder)
    return ExportResult(
        name,
        model.num_parameters(),
        training.get("val_bpb"),  # type: ignore[arg-type]
        {variant: path.stat().st_size for variant, path in variants.items()},
        seconds,
    )


def model_variants(options: ExportOptions) -> list[ModelSpec]:
    """One model per scheme, its rope scaling variants, then its further training seeds (if asked)."""
    if options.size is not None:
        if options.size not in RANDOM_SIZES:
            raise SystemExit(f"--size must be one of {', '.join(RANDOM_SIZES)} (random weights), got {options.size!r}")
        schemes = options.chosen_schemes()
        return [ModelSpec(scheme, scheme, options.weights / scheme, None, options.size, options.n_layers)
                for scheme in schemes if options.names is None or scheme in options.names]  # fmt: skip
    variants = [ModelSpec(scheme, scheme, options.weights / scheme) for scheme in options.chosen_schemes()]
    for spec in options.rope_scaling:
        scaling = RopeScaling.parse(spec)
        variants.append(ModelSpec(rope_scaled_name(scaling), ROPE_SCHEME, options.weights / ROPE_SCHEME, scaling))
    if options.extra_seeds:
        variants += extra_seeds(options.weights, options.chosen_schemes())
    return variants if options.names is None else [spec for spec in variants if spec.name in options.names]


def verify_model(
    folder: Path,
    reference: Transformer,
    graphs: tuple[str, ...],
    sequences: dict[int, list[list[int]]],
    threads: int = 0,
) -> Verification:
    """Parity of the float32 (and float16) graphs against one PyTorch run, the int8 graph against
    PyTorch fed its dequantized cache, and bits per byte of the float32 graph per context."""
    prompts = default_prompts(TOKENIZER.bos_token_id)
    torch_run = torch_reference(reference, prompts, TOKENIZER.pad_token_id)
    parity = [
        check_parity(torch_run, OnnxCausalLM(folder, variant, threads=threads), prompts)
        for variant in PARITY_GRAPHS
        if variant in graphs
    ]
    int8 = None
    if SERVING_INT8 in graphs:
        int8 = check_int8_graph(reference, OnnxCausalLM(folder, SERVING_INT8, threads=threads), prompts)
    fused = None
    if SERVING_FUSED in graphs:
        report = check_fused_graph(reference, folder, prompts, threads=threads)
        fused = report.max_abs if report.greedy_equal else float("nan")
    prefill = check_prefill_graph(reference, folder, prompts) if PREFILL_FUSED in graphs else None
    fused_int8 = None
    if SERVING_FUSED_INT8 in graphs:
        fused_int8 = check_fused_int8_graph(reference, folder, prompts, threads=threads)
    test_bpb = {}
    if sequences:
        runtime = OnnxCausalLM(folder, threads=threads)
        test_bpb = {context: onnx_bits_per_byte(runtime, windows) for context, windows in sequences.items()}
    return Verification(parity, int8, test_bpb, fused, prefill, fused_int8)


@dataclass
class _Job:
    """One model for a worker to export (its verification is a task of its own, `_verify_job`)."""

    spec: ModelSpec
    options: ExportOptions
    graphs: tuple[str, ...]


def _export_job(job: _Job) -> ExportResult:
    model, training = job.spec.model()
    return export_model(job.spec.name, model, job.options, training, job.graphs)


def _verify_job(
    folder: Path, spec: ModelSpec, graphs: tuple[str, ...], sequences: dict[int, list[list[int]]]
) -> Verification:
    threads = 1 if multiprocessing.parent_process() is not None else 0
    return verify_model(folder, reference_model(spec), graphs, sequences, threads)


def _attach(result: ExportResult, verification: Verification) -> ExportResult:
    result.parity, result.int8_max_abs = verification.parity, verification.int8_max_abs
    result.test_bpb = verification.test_bpb
    result.fused_max_abs, result.prefill_max_abs = verification.fused_max_abs, verification.prefill_max_abs
    result.fused_int8_max_abs = verification.fused_int8_max_abs
    return result


def _evaluation_windows(options: ExportOptions) -> dict[int, list[list[int]]]:
    """Test-split windows per evaluated context; none for random weights (their bits per byte say nothing)."""
    if options.size is not None:
        return {}
    corpus = load_corpus(options.corpus)
    stream = corpus.splits["test"]
    return {
        context: evaluation_sequences(stream, context, options.eval_windows, TOKENIZER.bos_token_id)
        for context in options.eval_contexts
    }


def derive_scaled(
    rope_base: Path, options: ExportOptions, name: str, scaling: RopeScaling, graphs: tuple[str, ...]
) -> ExportResult:
    """One rope scaling variant from the base rope model's graphs (`export.rope_variants`)."""
    started = time.time()
    base = ModelConfig.load(options.weights / ROPE_SCHEME / "config.json")
    paths = derive_rope_variant(rope_base, options.out / name, name, base, scaling, graphs)
    manifest = json.loads((options.out / name / MANIFEST).read_text())
    return ExportResult(
        name,
        int(manifest.get("parameters", 0)),
        manifest.get("training", {}).get("val_bpb"),
        {variant: path.stat().st_size for variant, path in paths.items()},
        time.time() - started,
    )


def export_progress(out: Path, graphs: dict[str, tuple[str, ...]], verify: bool) -> ExportProgress:
    """The bar of an export of each model's `graphs` (by name) into `out` (checked after, with `verify`)."""
    paths = [out / name / GRAPH_FILES[variant] for name, variants in graphs.items() for variant in variants]
    return ExportProgress(paths, len(graphs) * verify)


def plan(options: ExportOptions) -> str:
    """What the export is about to do, for its command line to say before the bar starts."""
    variants, graphs = model_variants(options), options.graph_variants()
    jobs = sum(1 for spec in variants if spec.scaling is None)
    workers = options.workers or min(jobs, available_cores()) or 1
    check = "; then each is checked against PyTorch and scored on held-out text" if options.verify else ""
    # Latent attention gets fewer graphs than K/V attention (graphs_for).
    counts = sorted({len(graphs_for(spec.scheme, graphs)) for spec in variants if spec.scaling is None}) or [0]
    each = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return (f"exporting {len(variants)} models ({', '.join(spec.name for spec in variants)}) in {workers} "
            f"processes: {each} graphs each, traced in 5-20 s apiece on an idle core{check}")  # fmt: skip


def run(options: ExportOptions) -> list[ExportResult]:
    """Export every model; with `verify`, check the float32/float16 graphs' parity and the int8 graph,
    and evaluate float32. Results come back in model_variants order, whatever order workers finish in.

    Each model's export is a worker task; its verification is another, submitted when the export is
    written (so the evaluation corpus loads here while the first exports run), and rope scaling
    variants are derived here as soon as the base rope graphs exist.
    """
    graphs = options.graph_variants()
    variants = model_variants(options)
    for spec in variants:
        if spec.size is None:
            weights_folder(spec.weights, spec.scheme)  # before any worker starts
    specs = {spec.name: spec for spec in variants}
    results: dict[str, ExportResult] = {}
    with tempfile.TemporaryDirectory(prefix="rope-base-") as scratch:
        jobs = [_Job(spec, options, graphs_for(spec.scheme, graphs)) for spec in variants if spec.scaling is None]
        # Rope variants need a base rope model: this run's, the repository's, or one exported aside.
        scaled = [spec for spec in variants if spec.scaling is not None]
        rope_base = options.out / ROPE_SCHEME
        if scaled and ROPE_SCHEME not in specs and not (rope_base / MANIFEST).is_file():
            rope_base = Path(scratch) / ROPE_SCHEME
            base = ModelSpec(ROPE_SCHEME, ROPE_SCHEME, options.weights / ROPE_SCHEME)
            jobs.append(_Job(base, replace(options, out=Path(scratch)), graphs_for(ROPE_SCHEME, graphs)))
        workers = options.workers or min(len(jobs), available_cores())
        files = {spec.name: graphs_for(spec.scheme, graphs) for spec in variants}
        progress = export_progress(options.out, files, options.verify)
        with executor(workers) as pool, progress.bar:
            pending: dict[Future, _Job | str] = {pool.submit(_export_job, job): job for job in jobs}
            sequences = _evaluation_windows(options) if options.verify else None

            def written(name: str, result: ExportResult) -> None:
                results[name] = result
                progress.refresh()
                if sequences is None:
                    return
                served = graphs_for(specs[name].scheme, graphs)
                pending[pool.submit(_verify_job, options.out / name, specs[name], served, sequences)] = name

            def derive_all() -> None:
                for spec in scaled:
                    assert spec.scaling is not None
                    derived = graphs_for(ROPE_SCHEME, graphs)
                    written(spec.name, derive_scaled(rope_base, options, spec.name, spec.scaling, derived))

            if scaled and not any(job.options.out / job.spec.name == rope_base for job in jobs):
                derive_all()  # from the rope model already in the repository
            while pending:
                try:
                    done = next(as_completed(pending, timeout=PROGRESS_POLL_S))
                except TimeoutError:
                    progress.refresh()
                    continue
                task, outcome = pending.pop(done), done.result()
                if isinstance(task, str):  # a verification
                    assert isinstance(outcome, Verification)
                    _attach(results[task], outcome)
                    progress.check()
                    continue
                assert isinstance(outcome, ExportResult)
                if task.options.out == options.out:
                    written(task.spec.name, outcome)
                if scaled and task.options.out / task.spec.name == rope_base:
                    derive_all()  # the base is written: its variants follow while other models export
    return [results[spec.name] for spec in variants]
