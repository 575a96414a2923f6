"""What a comparison run measured: the typed form of reports/<run-id>/results.json.

`python -m loadtest.compare` fills a `Results` and saves it; `python -m loadtest.report` loads the
same `Results` back (`Results.read`). The nested figures stay plain JSON objects (TypedDicts and dicts keyed by
length, users or policy), so the file is exactly `asdict(results)` and older files still load.
"""

from __future__ import annotations

import json
import string
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

from contract.names import seed_model_name

# A graded figure with its 95% interval (loadtest/probes.py, `Interval.as_dict()`): value, low, high, n.
Cell = dict[str, float]
# Cells by length in bytes (or a natural-text distance bucket, with "all"); None: not servable.
Cells = dict[str, Cell | None]
# One closed-loop load level's figures (requests, p50_s, tokens_per_s, goodput_per_s, ...).
LoadFigures = dict[str, float]
# A figure by prompt, context or text length (s or bits per byte); None: not servable.
ByLength = dict[str, float | None]
Probe = Literal["copy", "passkey", "natural"]
# The alphabet loadtest/probes.py planted copy spans from before it took models.spans' alphabet:
# the alphabet of every results.json written without a `span_alphabet`.
LEGACY_SPAN_ALPHABET = string.ascii_lowercase + string.digits


class ModelInfo(TypedDict):
    """The served model's description, from ListModels."""

    max_positions: int | None
    kv_bytes_per_token: int  # what one more token adds to a row
    # The fixed part of every row: a split hybrid's local layers' columns (0 for whole rows; absent
    # from results written before ListModels reported it).
    kv_bytes_per_sequence: NotRequired[int]
    kv_capacity_bytes: int
    train_context: int


class Retrieval(TypedDict):
    """One scheme's graded probes (loadtest/probes.py)."""

    copy: Cells  # by filler bytes between the copies
    copy_depth: dict[str, Cells]  # context bytes -> depth of the first copy -> cell
    passkey: Cells  # by context bytes
    natural: Cells  # by distance bucket, and "all"


class CacheBudget(TypedDict):
    """One scheme under bounded and int8 caches (loadtest/study/cache_budget.py)."""

    policies: list[str]
    bytes_per_token: int
    bpb: dict[str, ByLength]  # policy -> multiple of the training context -> bits per byte
    retrieval: dict[str, Cells]  # policy -> "copy@D" / "passkey@L" -> cell
    # int8 policy (and "full" at the same lengths) -> multiple -> bpb, and "copy@D" -> cell
    int8: dict[str, dict[str, float | Cell | None]]
    cost: dict[str, dict[str, float] | None]  # policy -> kv_physical_bytes, itl_s (None: not servable)


class ReuseMode(TypedDict):
    """One way of computing the documents workload's prompts (loadtest/study/reuse.py)."""

    accuracy: Cell | None  # share of the key's digits the server's greedy generation gets (None: not served)
    bpb: Cell | None  # bits per byte of the true key after the prompt, computed in-process
    teacher_forced: Cell | None  # share of the key's digits the in-process greedy prediction gets
    ttft_s: float | None  # the server's time to first token, median (None: not served)
    cached_share: float | None  # prompt tokens the prefix cache held, mean share
    reused_share: float | None  # prompt tokens of reused segments, mean share
    # The answer's bits over the full recompute's on the same prompts, less one, with a paired 95%
    # bootstrap interval over prompts (loadtest/study/reuse_scoring.py; absent in older runs).
    change: NotRequired[Cell | None]


class DocumentsForm(TypedDict):
    """The documents workload at one document size."""

    document_bytes: int
    prompt_bytes: float  # mean
    trials: int
    # Mode ("full", "prefix", "as_is", "rotate", "sink", "repair:K", "repair:all") -> figures; absent: not applicable to
    # the scheme; None: the prompts do not fit the model.
    modes: dict[str, ReuseMode | None]


class SharedPrefix(TypedDict):
    """The shared-prefix workload's closed loop, without and with the prefix cache."""

    prefix_bytes: int
    tail_bytes: int
    new_tokens: int
    no_cache: dict[str, LoadFigures]  # users -> figures (the rounds' medians)
    cache: dict[str, LoadFigures]
    # Each round's figures (loadtest/study/rounds.py): "no_cache" / "cache" -> users -> figures a round.
    rounds: NotRequired[dict[str, dict[str, list[LoadFigures]]]]


class Reuse(TypedDict):
    """One scheme's KV reuse: its declared segment reuse (ListModels), both workloads."""

    segment_reuse: str  # as_is, rotate or recompute
    shared_prefix: NotRequired[SharedPrefix]  # absent for a further training seed (scored in-process only)
    documents: dict[str, DocumentsForm]  # "short", "long"
    seed: NotRequired[int]  # the documents' prompt sample (absent in older runs: 32)
    # Other prompt samples, scored in-process only: seed -> form -> mode -> paired change (None: does not fit).
    samples: NotRequired[dict[str, dict[str, dict[str, Cell | None]]]]


# One speculative cell (loadtest/speculative.py): speedup, acceptance, proposed, guesses, tokens/s each way,
# and acceptance_interval (a Cell over prompts; absent in older runs).
SpeculativeCell = dict[str, Any]


class TrainingCurve(TypedDict):
    """One scheme's copy-emergence curve from its training log (models/emergence.py)."""

    points: list[dict[str, float | None]]  # step, tokens, val_bpb and copy accuracy per distance ("32", "128")
    copies_at: dict[str, int] | None  # step and tokens of the first point that copies
    steps_done: int
    cap_steps: int | None
    finished: bool
    command: str | None


class Environment(TypedDict):
    """The machine, library versions and commit a run measured on."""

    machine: str
    processor: str
    cpus: int | None
    memory: str
    platform: str
    python: str
    onnxruntime: str
    torch: str
    grpcio: str
    commit: str


class RunRecord(TypedDict):
    """One invocation: which sections it measured, where, and with which budget."""

    sections: list[str]
    environment: Environment
    budget: dict[str, Any]  # asdict(Budget)
    schemes: NotRequired[list[str]]  # the schemes it measured (absent in older runs)
    seconds: NotRequired[dict[str, float]]  # wall time of each section (measured together: "latency+load")


class RunConfig(TypedDict, total=False):
    budget: dict[str, Any]  # asdict(Budget) of the first, full run
    threads: int
    schemes: list[str]
    goodput_targets: dict[str, float]  # ttft_s, itl_s
    admission_ttft_slo_s: float
    runs: list[RunRecord]


@dataclass
class Results:
    run_id: str
    config: RunConfig
    environment: Environment
    schemes: list[str]
    models: dict[str, ModelInfo] = field(default_factory=dict)
    ttft: dict[str, ByLength] = field(default_factory=dict)  # scheme -> prompt bytes -> s
    itl: dict[str, ByLength] = field(default_factory=dict)  # scheme -> context -> s
    load: dict[str, dict[str, LoadFigures]] = field(default_factory=dict)  # scheme -> users -> figures
    # The same load against a server with --ttft-slo-seconds (refused requests counted, not hidden).
    load_admission: dict[str, dict[str, LoadFigures]] = field(default_factory=dict)
    memory: dict[str, dict[str, float]] = field(default_factory=dict)
    # The load under one fixed KV budget with 4 KB prompts at the most users (timed.measure_budget_load):
    # scheme -> its figures, with users, kv_budget_bytes and prompt_bytes.
    load_budget: dict[str, dict[str, float]] = field(default_factory=dict)
    # The served KV store's footprint (loadtest/study/kv_footprint.py), measured in the cache section:
    # scheme -> `kv_bytes_per_token@<tokens>`, `requests_4kb@budget` and `fixed_budget_bytes`.
    kv_footprint: dict[str, dict[str, float]] = field(default_factory=dict)
    # Each round's figures behind the medians above (loadtest/study/rounds.py): "ttft" / "itl" ->
    # scheme -> length -> one value a round; "load" / "load_admission" -> scheme -> users -> figures a round.
    latency_rounds: dict[str, dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    load_rounds: dict[str, dict[str, dict[str, list[LoadFigures]]]] = field(default_factory=dict)
    quality: dict[str, ByLength] = field(default_factory=dict)  # model -> multiple -> bpb
    retrieval: dict[str, Retrieval] = field(default_factory=dict)
    cache_budget: dict[str, CacheBudget] = field(default_factory=dict)
    reuse: dict[str, Reuse] = field(default_factory=dict)  # KV reuse (loadtest/study/reuse.py)
    # Speculative decoding (loadtest/speculative.py): scheme -> "workload@streams" -> figures.
    speculative: dict[str, dict[str, SpeculativeCell]] = field(default_factory=dict)
    # Routing through HAProxy (loadtest/study/routing.py): "round_robin" and "affinity" -> medians
    # (prefix_hit_rate, ttft_p50_s, ttft_p99_s, goodput_per_s) and their rounds; "kill"; "setup".
    routing: dict[str, Any] = field(default_factory=dict)
    # A noisy and a quiet tenant on one server (loadtest/study/tenants.py): "solo", "fcfs" and "fair" ->
    # each tenant's medians (ttft_p50_s, ttft_p99_s, tokens_per_s, goodput_per_s) and rounds, the
    # policies' ratios to solo (quiet_ttft_vs_solo, noisy_throughput_vs_solo); "setup".
    tenants: dict[str, Any] = field(default_factory=dict)
    # lm-evaluation-harness against the service (loadtest/evaluation.py): scheme -> figures.
    evaluation: dict[str, dict[str, float]] = field(default_factory=dict)
    # The served weights' copy-emergence curves, from their training logs (models/emergence.py).
    training: dict[str, TrainingCurve] = field(default_factory=dict)
    # The characters the retrieval section's copy spans were drawn from (models.spans.SPAN_ALPHABET).
    span_alphabet: str = LEGACY_SPAN_ALPHABET
    # Each scheme's training seeds, the served model's first (issue 55). A further seed's figures are kept
    # under its model name (`rope@seed2`, contract.names) in quality, retrieval, cache_budget, reuse and
    # speculative; a scheme missing here has its served model's only (a run from before seeds).
    seeds: dict[str, list[int]] = field(default_factory=dict)

    def add_seeds(self, seeds: dict[str, list[int]]) -> None:
        """A run's seeds per scheme (the served one first) joined to those the results already hold:
        a run that scores fewer seeds (`--no-extra-seeds`) leaves the others' figures and their seeds."""
        for scheme, found in seeds.items():
            held = self.seeds.get(scheme, [])
            served = found[0] if found else held[0]
            further = {*found[1:], *held[1:]} - {served}
            self.seeds[scheme] = [served, *sorted(further)]

    def models_of(self, scheme: str) -> list[str]:
        """The scheme's model names, one a training seed, the served one first."""
        extra = self.seeds.get(scheme, [])[1:]
        return [scheme, *(seed_model_name(scheme, seed) for seed in extra)]

    def seeded(self, scheme: str, section: dict[str, Any]) -> dict[int | None, str]:
        """Seed -> model name of the scheme's models that `section` (e.g. `results.quality`) has figures
        for, the served one first (seed None where the run did not record the scheme's seeds)."""
        seeds = self.seeds.get(scheme) or [None]
        return {seed: model for seed, model in zip(seeds, self.models_of(scheme), strict=False) if model in section}

    @property
    def span_chance(self) -> float:
        """Chance of guessing one character of a planted copy span: 1 / len(alphabet)."""
        return 1 / len(self.span_alphabet)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Results:
        return cls(**data)

    @classmethod
    def read(cls, path: Path) -> Results:
        return cls.from_dict(json.loads(path.read_text()))

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @property
    def train_context(self) -> int:
        """The models' training context in bytes (256 when no model was described)."""
        return next(iter(self.models.values()))["train_context"] if self.models else 256

    def probe(self, scheme: str, probe: Probe) -> Cells:
        """One scheme's cells of one retrieval probe (empty where it was not measured)."""
        found = self.retrieval.get(scheme)
        return {} if found is None else found.get(probe, {})

    def copy_depth(self, scheme: str) -> dict[str, Cells]:
        """One scheme's copy cells by context and depth (empty where it was not measured)."""
        found = self.retrieval.get(scheme)
        return {} if found is None else found.get("copy_depth", {})
