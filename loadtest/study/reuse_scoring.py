"""Bits per byte of the true answer after a document prompt, under each way of computing the prompt's K/V.

The service returns no per-token log-probabilities from `Generate`, and `Score` takes no segments,
so the answer is scored here, in-process, through the service's own code: the model's ONNX graphs in
a `ModelRunner` and the prompt assembled by `SegmentAssembly`, the class the engine's prefill runs
(each document's K/V computed on its own from position 0, then placed as the mode says, the first k
tokens of each repaired in context). The answer is then computed after that K/V, teacher-forced,
so its log-probabilities are those a request with that prompt would sample from. The exact prefix
cache copies a fresh prefill's K/V, so its figures are the full recompute's.

Modes: `full` (the prompt computed in one pass), `as_is` (documents' K/V placed unchanged: the
declaration of alibi, relative and none; for rope, the naive reuse its declaration avoids),
`rotate` (rope's keys turned by the offset), `sink` (EPIC's precompute: each document computed
after a BOS, a sink of its own, whose K/V is dropped when the document is placed the scheme's way),
and `repair:K` on top of the scheme's own placement (`repair:all`: every token of every document
recomputed in context, which must equal `full`).

The sink-kept precompute is a study placement, not one the server offers (no manifest declaration):
on the shipped weights it brings no scheme's reuse within 1% of the full recompute (ALiBi's and
NoPE's cost falls from about 20% and 35% to 2-6%, relative's and rope's rises to about 6%), and a
sink-kept document's K/V differs from a plain one's, so offering it would split the segment cache's
entries by placement for no verdict a client could rely on.

Each mode's verdict is about its difference from `full` on the same prompts, so its interval is a
paired one: a bootstrap of the ratio of the mode's answer bits to full's, less one (`paired_change`),
over the prompts' document sets (loadtest/workloads.py, `document_prompts`): prompts of one set share
documents, so resampling prompts as if independent gave intervals that five fresh samples mostly fell
outside of (issue 55). The intervals on each mode's own bits per byte are several times wider.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract.graph import target_logprobs
from contract.manifest import REUSE_AS_IS, REUSE_RECOMPUTE, REUSE_ROTATE, Manifest, SegmentReuse
from loadtest.probes import clustered_wilson, ratio_interval
from loadtest.study.results import Cell
from loadtest.workloads import DocumentPrompt
from models.tokenizer import TOKENIZER
from service.engine.kv import Array, SplitKV
from service.engine.messages import PromptSegment
from service.engine.processing.input_processor import segment_spans
from service.engine.prompts.prompt import PrefilledPrompt, PromptRun
from service.engine.prompts.segments import SegmentAssembly
from service.engine.worker.runner import ModelRunner, StoreConfig

CHUNK_TOKENS = 512
SINK = "sink"  # EPIC's precompute: a document's K/V computed after a BOS that is dropped when placed
REPAIR_WHOLE = "all"  # `repair:all`: every token of every reused document recomputed in context
WHOLE_TOKENS = 1 << 30  # a repair longer than any document
BOOTSTRAP_RESAMPLES = 4000
BOOTSTRAP_SEED = 0


def repair_tokens(k: int | str) -> int:
    """The repair's token count for a `repair:K` mode's K (`all`: the whole document)."""
    return WHOLE_TOKENS if k == REPAIR_WHOLE else int(k)


def paired_change(bits: list[float], full_bits: list[float], clusters: list[int] | None = None,
                  resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Cell:  # fmt: skip
    """sum(bits) / sum(full_bits) - 1 (the answer's bits per byte against the full recompute's: the
    same answers, so the bytes cancel) with a 95% percentile bootstrap resampling the pairs together:
    the verdict is about the difference, so the prompts' own spread cancels. `clusters`: each prompt's
    document set; the bootstrap then resamples whole sets (prompts of one set share documents, and a
    verdict is about documents in general, not these), else prompts."""
    mode, full = np.asarray(bits, dtype=np.float64), np.asarray(full_bits, dtype=np.float64)
    value = float(mode.sum() / full.sum() - 1)
    ids = np.arange(len(mode)) if clusters is None else np.unique(np.asarray(clusters), return_inverse=True)[1]
    count = int(ids.max()) + 1
    mode_sums, full_sums = np.bincount(ids, mode, count), np.bincount(ids, full, count)
    picks = np.random.default_rng(seed).integers(0, count, size=(resamples, count))
    changes = mode_sums[picks].sum(axis=1) / full_sums[picks].sum(axis=1) - 1
    low, high = np.percentile(changes, [2.5, 97.5])
    return {"value": value, "low": float(low), "high": float(high), "n": len(mode), "clusters": count}


def placements(declared: str) -> list[str]:
    """The placement modes worth scoring for a scheme's declaration (none: it recomputes)."""
    return {REUSE_AS_IS: [REUSE_AS_IS], REUSE_ROTATE: [REUSE_AS_IS, REUSE_ROTATE]}.get(declared, [])


@dataclass
class AnswerScore:
    bits: float
    hits: int
    length: int


class AnswerScorer:
    """One model's runner, scoring answers after prompts computed each way."""

    def __init__(self, repository: Path, model: str, threads: int) -> None:
        self.manifest = Manifest.load(repository / model)
        self.runner = ModelRunner(self.manifest, StoreConfig(64 << 20, 16, 4096), "cpu", threads=threads)
        self.declared = self.manifest.segment_reuse

    def _assembly(self, mode: str) -> SegmentAssembly:
        reuse = self.declared if mode == self.declared.mode else SegmentReuse(mode)
        return SegmentAssembly(self.runner, reuse, CHUNK_TOKENS)

    def _sink_kept(self, token_ids: list[int], spans: tuple[tuple[int, int], ...]) -> list[Array | None]:
        """Each document's K/V computed after the BOS (its sink, EPIC's per-chunk BOS), the BOS's
        column dropped: as if computed from position 0, except rope's keys sit one position later and
        are turned back one, so that the placement's rotation by the offset lands them right."""
        kept: list[Array | None] = []
        for start, end in spans:
            document = PromptRun("score", token_ids[:1] + token_ids[start:end])
            *_, [computed] = self.runner.prefill([document], CHUNK_TOKENS)
            assert computed is not None
            # the engine's own placement turned back one (rotated keys only; as is where nothing rotates)
            kept.append(self._assembly(self.declared.mode).placed(computed.cache[:, :, 1:], -1))
        return kept

    def _prompt(self, prompt: DocumentPrompt, mode: str, repair: int) -> PrefilledPrompt:
        token_ids = TOKENIZER.encode(prompt.text)
        if mode == "full":
            *_, [last] = self.runner.prefill([PromptRun("score", token_ids)], CHUNK_TOKENS)
            assert last is not None
            return last
        segments = tuple(PromptSegment(text, reusable) for text, reusable in prompt.segments())
        spans = segment_spans(segments, add_bos=True)
        if mode == SINK:
            cached = self._sink_kept(token_ids, spans)
            return self._assembly(self.declared.mode).run("score", token_ids, spans, cached, repair, None)
        return self._assembly(mode).run("score", token_ids, spans, [None] * len(spans), repair, None)

    def score(self, prompt: DocumentPrompt, mode: str, repair: int = 0) -> AnswerScore:
        """The answer's bits and greedy hits after the prompt's K/V computed by `mode`."""
        computed = self._prompt(prompt, mode, repair)
        answer = list(prompt.answer.encode())
        logits = computed.logits[None]  # (1, vocab): predicts the answer's first byte
        if len(answer) > 1:
            logits = np.concatenate([logits, self._rest(prompt, computed, answer[:-1])])
        logprobs = target_logprobs(logits, answer)
        hits = int((np.asarray(logits).argmax(-1) == np.asarray(answer)).sum())
        return AnswerScore(float(-logprobs.sum() / math.log(2)), hits, len(answer))

    @property
    def split(self) -> bool:
        """The model's rows keep its local layers apart (a hybrid on split rows): the sink-kept
        precompute, which drops a BOS column from every layer, is not built for them."""
        return self.runner.layout.split

    def _rest(self, prompt: DocumentPrompt, computed: PrefilledPrompt, fed: list[int]) -> np.ndarray:
        """Logits (len(fed), vocab) of the answer's bytes fed after the prompt's K/V: the runner's
        chunked path (a split row's local layers keep only their window)."""
        cache = computed.cache
        split = isinstance(cache, SplitKV)
        past = SplitKV(cache.global_kv[:, None], cache.local_kv[:, None]) if split else cache[:, None]
        token_ids = TOKENIZER.encode(prompt.text) + fed
        assert len(token_ids) == computed.length + len(fed)
        return self.runner.continue_logits(token_ids, computed.length, past, CHUNK_TOKENS)

    def scores(self, prompts: list[DocumentPrompt], mode: str, repair: int = 0) -> list[AnswerScore]:
        return [self.score(p, mode, repair) for p in prompts]


def cells(scores: list[AnswerScore], clusters: list[int]) -> tuple[Cell | None, Cell]:
    """Bits per byte of the answers and the greedy hit rate, each with a 95% interval over the prompts'
    document sets (`clusters`: each prompt's; cluster-robust ratio, and Wilson with a set as one
    observation)."""
    bits: dict[int, tuple[float, int]] = {}
    for score, cluster in zip(scores, clusters, strict=True):
        total, length = bits.get(cluster, (0.0, 0))
        bits[cluster] = (total + score.bits, length + score.length)
    bpb = ratio_interval(bits.values())
    hit_rate = clustered_wilson([s.hits / s.length for s in scores], clusters)
    return None if bpb is None else bpb.as_dict(), hit_rate.as_dict()


def scored_modes(declared: str, repairs: tuple[int, ...]) -> list[tuple[str, str, int]]:
    """(name, placement, k) of every mode scored for a scheme: full, its placements, the sink-kept
    precompute, its repairs and the whole-document repair (which must come back to full)."""
    modes = [("full", "full", 0)] + [(m, m, 0) for m in placements(declared)]
    if declared != REUSE_RECOMPUTE:
        modes += [(SINK, SINK, 0)]
        modes += [(f"repair:{k}", declared, k) for k in repairs]
        modes += [(f"repair:{REPAIR_WHOLE}", declared, WHOLE_TOKENS)]
    return modes
