"""The `reuse` section: what keeping K/V between requests buys each scheme, measured on real servers.

Two server sets are started, both with the load section's admission control (--ttft-slo-seconds):
one with --no-prefix-cache, one with the prefix cache (the default). Each runs

- **shared prefix** (loadtest/workloads.py): a closed loop at each of `budget.reuse_users` users,
  every prompt the same long prefix and a unique tail (scaled down for a model with fewer
  positions), in rounds over the schemes as the load section runs them;
- **documents in varying order**: the same document prompts, one request at a time, greedy, the
  answer's digits compared with the planted key. Without the cache: `full` (every prompt computed
  in full). With it: `prefix` (the same plain prompts; the prefix cache holds whatever leading text
  an earlier prompt shared), then the prompts as reusable segments, placed as the scheme's
  ListModels `segment_reuse` says (`as_is` or `rotate`), and with the repair at each of the budget's
  served k (the rest of the repair curve, the whole-document repair and EPIC's sink-kept precompute
  are scored in-process only). A scheme
  whose declaration is `recompute` reuses nothing: its reuse modes are not requested (the report
  gives the declaration). The prompts come from a fresh document set every few prompts
  (loadtest/workloads.py, `document_prompts`); each set's documents are sent as segments before
  its timed requests, so the timings are those of documents already cached; the planted key makes
  the carrier document new each time, computed on its own and placed.

Then, with the servers stopped, the answer's bits per byte under each mode are computed in-process
(loadtest/study/reuse_scoring.py), each mode's change from the full recompute with a paired
bootstrap interval over the document sets; the same on each further prompt sample (`budget.reuse_seeds`
after the first), scored only, so that the report can say where two samples' verdicts agree; and the
same on the served prompts for every further training seed of a scheme (issue 55), in-process only.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from tqdm import tqdm

from contract.manifest import REUSE_RECOMPUTE
from loadtest.probes import clustered_wilson
from loadtest.study.budget import Budget
from loadtest.study.held_out import HeldOut
from loadtest.study.results import Cell, DocumentsForm, LoadFigures, Results, Reuse, ReuseMode
from loadtest.study.reuse_scoring import SINK, AnswerScorer, cells, paired_change, scored_modes
from loadtest.study.rounds import medians
from loadtest.study.serving import COMPUTED, model_info, serving
from loadtest.study.timed import ADMISSION_TTFT_SLO_S, measure_load, rotated
from loadtest.workloads import (
    LONG_DOCUMENT_BYTES,
    SHARED_NEW_TOKENS,
    DocumentPrompt,
    document_prompts,
    held_out_slice,
    shared_prefix_sizes,
    shared_prefix_text,
    short_document_bytes,
)
from service.api import generation_pb2 as pb
from service.api.retry import RETRY_AFTER_KEY
from service.process import ServerProcess

SECTIONS = ("reuse",)


@dataclass
class Workloads:
    """What every scheme is sent: the held-out bytes of the shared prefix and tails, each form's document prompts."""

    data: bytes
    forms: dict[str, list[DocumentPrompt]]
    document_bytes: dict[str, int]

    @classmethod
    def build(cls, held_out: HeldOut, budget: Budget, train_context: int, seed: int) -> Workloads:
        rng = random.Random(seed)
        sizes = {"short": short_document_bytes(train_context), "long": LONG_DOCUMENT_BYTES}
        forms = {}
        for form in budget.reuse_forms:
            forms[form] = document_prompts(held_out.data, rng, sizes[form], budget.reuse_trials)
        return cls(held_out.data, forms, {form: sizes[form] for form in budget.reuse_forms})

    def shared_prompt(self, limit: int) -> tuple[int, int, Callable[[random.Random], str]]:
        """Prefix and tail bytes for a model's limit, and the prompt drawer for `measure_load`."""
        prefix_bytes, tail_bytes = shared_prefix_sizes(limit)
        prefix = shared_prefix_text(self.data, prefix_bytes)
        return prefix_bytes, tail_bytes, lambda rng: prefix + held_out_slice(self.data, rng, tail_bytes)


def generate(server: ServerProcess, request: pb.GenerateRequest) -> pb.GenerateResponse:
    """One unary call; a refusal for load is retried after the server's hint (admission is on)."""
    for _ in range(20):
        try:
            return server.stub.Generate(request, timeout=300)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            hint = dict(error.trailing_metadata() or ()).get(RETRY_AFTER_KEY)  # type: ignore[attr-defined]
            time.sleep(int(hint) / 1000 if hint else 0.1)
    raise RuntimeError(f"{request.model}: refused 20 times")


def request(model: str, prompt: DocumentPrompt, segments: bool, repair: int = 0) -> pb.GenerateRequest:
    """A greedy request for the answer, as one prompt or as segments (documents reusable)."""
    new_tokens = len(prompt.answer.encode())
    if not segments:
        return pb.GenerateRequest(model=model, prompt=prompt.text, max_new_tokens=new_tokens)
    parts = [pb.PromptSegment(text=text, reusable=reusable) for text, reusable in prompt.segments()]
    return pb.GenerateRequest(model=model, segments=parts, max_new_tokens=new_tokens, segment_repair_tokens=repair)


def warm(server: ServerProcess, model: str, documents: set[str]) -> None:
    """Each document sent once as a reusable segment, so that the timed requests find it cached."""
    for document in sorted(documents):
        generate(server, pb.GenerateRequest(model=model, segments=[pb.PromptSegment(text=document, reusable=True),
                 pb.PromptSegment(text="\n")], max_new_tokens=1))  # fmt: skip


def served_mode(server: ServerProcess, model: str, prompts: list[DocumentPrompt], segments: bool, repair: int = 0
                ) -> ReuseMode:  # fmt: skip
    """Accuracy and time to first token of the prompts sent one after another; as segments, each
    document set's documents are sent first (untimed), so the timings are those of documents already
    cached (a set at a time: every set's documents at once could outgrow the cache)."""
    hits, ttfts, cached, reused = [], [], [], []
    for index, prompt in enumerate(prompts):
        if segments and (index == 0 or prompt.document_set != prompts[index - 1].document_set):
            warm(server, model, {d for p in prompts if p.document_set == prompt.document_set for d in p.reused})
        response = generate(server, request(model, prompt, segments, repair))
        answer = prompt.answer
        hits.append(sum(a == b for a, b in zip(response.text, answer, strict=False)) / len(answer))
        ttfts.append(response.timings.time_to_first_token_seconds)
        cached.append(response.usage.cached_prompt_tokens / response.usage.prompt_tokens)
        reused.append(response.usage.reused_prompt_tokens / response.usage.prompt_tokens)
    return {
        "accuracy": clustered_wilson(hits, [p.document_set for p in prompts]).as_dict(), "bpb": None,
        "teacher_forced": None, "ttft_s": statistics.median(ttfts), "cached_share": statistics.mean(cached),
        "reused_share": statistics.mean(reused),
    }  # fmt: skip


def fits(limit: int, prompts: list[DocumentPrompt]) -> bool:
    return not limit or all(len(p.text.encode()) + 1 + len(p.answer.encode()) <= limit for p in prompts)


def measure_documents(
    server: ServerProcess, model: str, declared: str, prompts: list[DocumentPrompt], cache: bool,
    repairs: tuple[int, ...],
) -> dict[str, ReuseMode]:  # fmt: skip
    """The modes one server measures: `full` without the cache; `prefix`, reuse and repairs with it."""
    if not cache:
        return {"full": served_mode(server, model, prompts, False)}
    modes = {"prefix": served_mode(server, model, prompts, False)}
    if declared == REUSE_RECOMPUTE:
        return modes
    modes[declared] = served_mode(server, model, prompts, True)
    for k in repairs:
        modes[f"repair:{k}"] = served_mode(server, model, prompts, True, k)
    return modes


def unserved() -> ReuseMode:
    """A mode's figures before anything is measured (an in-process mode the server does not offer)."""
    return {"accuracy": None, "bpb": None, "teacher_forced": None, "ttft_s": None, "cached_share": None,
            "reused_share": None}  # fmt: skip


def scored_form(
    scorer: AnswerScorer, declared: str, prompts: list[DocumentPrompt], document_bytes: int,
    served: dict[str, ReuseMode] | None, repairs: tuple[int, ...],
) -> DocumentsForm:  # fmt: skip
    """One form's modes: what the servers measured (`served`; None where the prompts do not fit the
    model, and every mode is None), with the answers' bits per byte in-process and their paired
    change from the full recompute. A further training seed is scored in-process only: `served` empty."""
    modes: dict[str, ReuseMode | None] = {}
    full_bits: list[float] = []
    clusters = [p.document_set for p in prompts]
    for name, placement, k in scored_modes(declared, repairs):
        mode = None if served is None or (name == SINK and scorer.split) else served.get(name, unserved())
        if mode is not None:
            scores = scorer.scores(prompts, placement, k)
            full_bits = full_bits or [s.bits for s in scores]  # "full" comes first
            mode["bpb"], mode["teacher_forced"] = cells(scores, clusters)
            mode["change"] = paired_change([s.bits for s in scores], full_bits, clusters)
        modes[name] = mode
    full = modes["full"]
    prefix = None if served is None else served.get("prefix")
    if prefix is not None and full is not None:  # the prefix cache's K/V is a fresh prefill's: full's answers
        prefix["bpb"], prefix["teacher_forced"] = full["bpb"], full["teacher_forced"]
    if prefix is not None:
        modes["prefix"] = prefix
    mean_bytes = statistics.mean(len(p.text.encode()) for p in prompts)
    return {"document_bytes": document_bytes, "prompt_bytes": mean_bytes, "trials": len(prompts), "modes": modes}


def scored_sample(scorer: AnswerScorer, declared: str, prompts: list[DocumentPrompt], limit: int,
                  repairs: tuple[int, ...]) -> dict[str, Cell | None] | None:  # fmt: skip
    """Another prompt sample's paired changes from the full recompute, every mode in-process (None:
    the prompts do not fit the model)."""
    if not fits(limit, prompts):
        return None
    clusters = [p.document_set for p in prompts]
    full_bits = [s.bits for s in scorer.scores(prompts, "full")]
    return {
        name: None if name == SINK and scorer.split
        else paired_change([s.bits for s in scorer.scores(prompts, placement, k)], full_bits, clusters)
        for name, placement, k in scored_modes(declared, repairs)
    }  # fmt: skip


@dataclass
class Served:
    """What the servers measured of every scheme, for the in-process scoring after them."""

    workloads: Workloads
    infos: dict[str, pb.ModelInfo]
    modes: dict[str, dict[str, dict[str, ReuseMode]]]  # scheme -> form -> mode -> figures
    loads: dict[bool, dict[str, dict[str, list[LoadFigures]]]]  # prefix cache -> scheme -> users -> rounds
    sizes: dict[str, tuple[int, int]]  # scheme -> shared prefix and tail bytes


def measure_served(
    repository: Path, threads: int, schemes: list[str], held_out: HeldOut, budget: Budget, results: Results,
    progress: tqdm,
) -> Served:  # fmt: skip
    """Both workloads on both server sets (the schemes' served models)."""
    loads: dict[bool, dict[str, dict[str, list[LoadFigures]]]] = {False: {}, True: {}}  # each round's
    served: dict[str, dict[str, dict[str, ReuseMode]]] = {s: {f: {} for f in budget.reuse_forms} for s in schemes}
    sizes: dict[str, tuple[int, int]] = {}
    admission = ("--ttft-slo-seconds", str(ADMISSION_TTFT_SLO_S))
    # Both sets run at once and each level measures a scheme without and with the cache back to back
    # (which first alternates), so the machine's drift over minutes does not land between the two
    # figures a ratio divides, as it did when one set was measured whole after the other.
    with (
        serving(repository, threads, schemes, *admission, *COMPUTED) as uncached,
        serving(repository, threads, schemes, *admission) as cached,
    ):
        sets = {False: uncached, True: cached}
        progress.set_postfix(part="reuse, shared prefix, prefix cache off and on")
        infos = {scheme: model_info(server, scheme, results) for scheme, server in cached.items()}
        train_context = next(iter(infos.values())).train_context
        workloads = Workloads.build(held_out, budget, train_context, budget.reuse_seeds[0])
        prompts = {scheme: workloads.shared_prompt(infos[scheme].max_positions) for scheme in schemes}
        for scheme, (prefix_bytes, tail_bytes, prompt) in prompts.items():
            sizes[scheme] = (prefix_bytes, tail_bytes)
            for servers in sets.values():
                # The prefix once before the levels: with the cache, every level then measures it held.
                request = pb.GenerateRequest(model=scheme, prompt=prompt(random.Random()), max_new_tokens=1)
                generate(servers[scheme], request)
        for round_index in range(budget.load_rounds):  # rounds as the load section's (loadtest/study/rounds.py)
            for turn, users in enumerate(budget.reuse_users):
                for index, scheme in enumerate(rotated(schemes, turn + round_index)):
                    for cache in (False, True) if (turn + index + round_index) % 2 == 0 else (True, False):
                        figures = measure_load(sets[cache][scheme], scheme, prompts[scheme][2], users,
                                               budget.reuse_seconds, SHARED_NEW_TOKENS)  # fmt: skip
                        loads[cache].setdefault(scheme, {}).setdefault(str(users), []).append(figures)
        for cache, servers in sets.items():
            progress.set_postfix(part=f"reuse, documents, prefix cache {'on' if cache else 'off'}")
            for scheme in rotated(schemes, int(cache)):
                declared = infos[scheme].segment_reuse
                for form, prompts_of_form in workloads.forms.items():
                    if fits(infos[scheme].max_positions, prompts_of_form):
                        served[scheme][form] |= measure_documents(
                            servers[scheme], scheme, declared, prompts_of_form, cache, budget.reuse_repairs
                        )
                progress.update()
    return Served(workloads, infos, served, loads, sizes)


def described(
    repository: Path, threads: int, schemes: list[str], held_out: HeldOut, budget: Budget, results: Results
) -> Served:
    """What scoring further training seeds needs of their schemes' served models, nothing measured:
    each one's limits and segment placement, and the run's prompts (`--seeds-only`)."""
    with serving(repository, threads, schemes) as servers:
        infos = {scheme: model_info(server, scheme, results) for scheme, server in servers.items()}
    train_context = next(iter(infos.values())).train_context if infos else 0
    workloads = Workloads.build(held_out, budget, train_context, budget.reuse_seeds[0])
    return Served(workloads, infos, {}, {False: {}, True: {}}, {})


def scored_reuse(
    repository: Path, threads: int, model: str, scheme: str, measured: Served, held_out: HeldOut, budget: Budget
) -> Reuse:
    """One model's answers' bits per byte in-process, on the served prompts (`model` a further training
    seed of `scheme`: in-process only) and, for the served model, on every further prompt sample."""
    info, declared = measured.infos[scheme], measured.infos[scheme].segment_reuse
    scorer = AnswerScorer(repository, model, threads)
    workloads = measured.workloads

    def served(form: str, prompts: list[DocumentPrompt]) -> dict[str, ReuseMode] | None:
        if not fits(info.max_positions, prompts):
            return None
        return measured.modes[scheme][form] if model == scheme else {}

    documents = {
        form: scored_form(scorer, declared, prompts, workloads.document_bytes[form], served(form, prompts),
                          budget.reuse_repairs)
        for form, prompts in workloads.forms.items()
    }  # fmt: skip
    samples: dict[str, dict[str, dict[str, Cell | None]]] = {}
    for seed in budget.reuse_seeds[1:] if model == scheme else ():
        other = Workloads.build(held_out, budget, info.train_context, seed)
        samples[str(seed)] = {
            form: found
            for form, prompts in other.forms.items()
            if (found := scored_sample(scorer, declared, prompts, info.max_positions, budget.reuse_repairs)) is not None
        }
    return {"segment_reuse": declared, "documents": documents, "seed": budget.reuse_seeds[0], "samples": samples}


def measure_reuse(
    repository: Path, threads: int, models: dict[str, list[str]], held_out: HeldOut, budget: Budget,
    results: Results, progress: tqdm,
) -> None:  # fmt: skip
    """Both workloads on both server sets for each scheme's served model (the first of `models`), then
    the answers' bits per byte in-process for every one of the scheme's models (its training seeds)."""
    schemes = list(models)
    if budget.seeds_only:
        schemes = [scheme for scheme in schemes if len(models[scheme]) > 1]
        measured = described(repository, threads, schemes, held_out, budget, results)
    else:
        measured = measure_served(repository, threads, schemes, held_out, budget, results, progress)
    for scheme in schemes:
        for model in models[scheme][1:] if budget.seeds_only else models[scheme]:
            progress.set_postfix(part="reuse, answers' bits per byte", model=model)
            results.reuse[model] = scored_reuse(repository, threads, model, scheme, measured, held_out, budget)
            progress.update()
        if budget.seeds_only:
            continue
        prefix_bytes, tail_bytes = measured.sizes[scheme]
        loads = {cache: measured.loads[cache][scheme] for cache in (False, True)}
        results.reuse[scheme]["shared_prefix"] = {
            "prefix_bytes": prefix_bytes, "tail_bytes": tail_bytes, "new_tokens": SHARED_NEW_TOKENS,
            "no_cache": medians(loads[False]), "cache": medians(loads[True]),
            "rounds": {"no_cache": loads[False], "cache": loads[True]},
        }  # fmt: skip
