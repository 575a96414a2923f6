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
`rotate` (rope's keys turned by the offset), and `repair:K` on top of the scheme's own placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract.graph import target_logprobs
from contract.manifest import REUSE_AS_IS, REUSE_RECOMPUTE, REUSE_ROTATE, Manifest, SegmentReuse
from loadtest.probes import ratio_interval, wilson
from loadtest.study.results import Cell
from loadtest.workloads import DocumentPrompt
from models.tokenizer import TOKENIZER
from service.engine.messages import PromptSegment
from service.engine.prompts import PrefilledPrompt
from service.engine.runner import ModelRunner, StoreConfig
from service.engine.segments import SegmentAssembly, segment_spans

CHUNK_TOKENS = 512


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

    def _prompt(self, prompt: DocumentPrompt, mode: str, repair: int) -> PrefilledPrompt:
        token_ids = TOKENIZER.encode(prompt.text)
        if mode == "full":
            *_, last = self.runner.prefill_chunks("score", token_ids, CHUNK_TOKENS)
            assert last is not None
            return last
        segments = tuple(PromptSegment(text, reusable) for text, reusable in prompt.segments())
        spans = segment_spans(segments, add_bos=True)
        return self._assembly(mode).run("score", token_ids, spans, [None] * len(spans), repair, None)

    def score(self, prompt: DocumentPrompt, mode: str, repair: int = 0) -> AnswerScore:
        """The answer's bits and greedy hits after the prompt's K/V computed by `mode`."""
        computed = self._prompt(prompt, mode, repair)
        answer = list(prompt.answer.encode())
        logits = computed.logits[None]  # (1, vocab): predicts the answer's first byte
        if len(answer) > 1:
            ids = np.asarray([answer[:-1]], dtype=np.int64)
            positions = np.arange(computed.length, computed.length + len(answer) - 1, dtype=np.int64)[None]
            mask = np.ones((1, computed.length + len(answer) - 1), dtype=np.int64)
            rest, _ = self.runner._prompt_call(ids, mask, positions, computed.cache[:, None], last_only=False)
            logits = np.concatenate([logits, rest[0]])
        logprobs = target_logprobs(logits, answer)
        hits = int((np.asarray(logits).argmax(-1) == np.asarray(answer)).sum())
        return AnswerScore(float(-logprobs.sum() / math.log(2)), hits, len(answer))

    def cells(self, prompts: list[DocumentPrompt], mode: str, repair: int = 0) -> tuple[Cell | None, Cell]:
        """Bits per byte of the answers (95% interval over prompts) and the greedy hit rate (Wilson)."""
        scores = [self.score(p, mode, repair) for p in prompts]
        bpb = ratio_interval((s.bits, s.length) for s in scores)
        hit_rate = sum(s.hits / s.length for s in scores) / len(scores)
        return None if bpb is None else bpb.as_dict(), wilson(hit_rate, len(scores)).as_dict()


def scored_modes(declared: str, repairs: tuple[int, ...]) -> list[tuple[str, str, int]]:
    """(name, placement, k) of every mode scored for a scheme: full, its placements, its repairs."""
    modes = [("full", "full", 0)] + [(m, m, 0) for m in placements(declared)]
    if declared != REUSE_RECOMPUTE:
        modes += [(f"repair:{k}", declared, k) for k in repairs]
    return modes
