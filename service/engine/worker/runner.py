"""ONNX Runtime execution for one model: its sessions (the graph calls) plus the KV store.

Every call binds its inputs and outputs by data pointer to arrays of the store's backend
(model_session.py). Decode runs the in-place serving graph (float32, or float16 on a GPU) once per capacity
class of the store: the graph reads each class's cache where it lies and returns only the new
token's K/V, which the store writes into the next column of each row on the same device.

Rows of `+int8` cache policies live in int8 classes of the store and decode through the
serving-int8 graph (int8 K/V and their per-token scales in, float32 out; a decode session of its
own). Prompts run in float32 as any prompt; their cache is quantized as it is written into the row.
A scored text goes through an int8 row one token at a time (each token sees the int8 cache).

Where the export has the fused decode graph (serving-fused: one GroupQueryAttention kernel per
layer, export/fused.py) and `attention` allows it, classes of full float32 rows decode through it
instead: it reads the same buffers and writes each new token's K/V into them itself (its present
outputs are bound to the past buffers), so the store only advances lengths and masks. Classes
holding a bounded or int8 row keep the explicit graph, which the fused kernel cannot express.

Prompts enter through three methods: `prefill` (a prompt's chunks, or a batch of whole prompts, into
rows), `continue_logits` (every logit of what follows a computed prompt) and `score`; which graph
call serves them (one padded batch, chunks, in place through the fused graph, a split row's local
window, a bounded policy's stream) is decided here. They run in sessions of their own
(prompt_sessions.py: the prefill worker's, in its own thread, and the tail worker's) and touch no store
state; their caches are written into the rows the scheduler reserved, on the engine thread. Where the
export has the fused prompt graph (prefill-fused: one GroupQueryAttention per layer over the prompt's
tokens, no score or mask tensor in the graph) and `attention` allows it, prompts run through it: its
batches are right-padded, and it returns the whole cache (past and new), so a chunk's result is the
next chunk's past without a copy here.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from contract.cache_policy import CachePolicy
from contract.graph import left_pad_batch, right_pad_batch
from contract.graph import target_logprobs as log_probabilities
from contract.manifest import Manifest, serving_variant
from service.engine.kv import Array, CapacityClass, KVStore, SplitKV, make_backend
from service.engine.kv.arrays import NumpyArrays
from service.engine.kv.prefix import CachedPast
from service.engine.kv.scratch import ScratchArray
from service.engine.messages import Scored
from service.engine.prompts.prompt import PrefilledPrompt, PromptRun, StreamedPrompt, chunk_inputs
from service.engine.sampler import log_softmax, top_logprobs
from service.engine.spec_decode.verifier import BlockVerifier
from service.engine.worker.decode_plan import DecodeCall, DecodeCalls, DecodePlan
from service.engine.worker.model_session import (
    GraphBinder,
    LocalPast,
    ModelSession,
    cache_graphs,
    default_threads,
    serving_plan,
    serving_prompt_graph,
)
from service.engine.worker.policy_stream import PolicyStream
from service.engine.worker.prompt_sessions import Lane, PromptLane, PromptSessions
from service.engine.worker.split_prompts import SplitPrompts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreConfig:
    budget_bytes: int
    block_size: int
    max_tokens: int


@dataclass
class RunnerTimings:
    """Seconds spent in decode graph calls and in cache handling on the engine thread (writes, joins)."""

    graph: float = 0.0
    cache: float = 0.0


# A text scored on a split layout goes through the prompt graph in chunks of this many tokens.
SCORE_CHUNK_TOKENS = 512


class ModelRunner:
    """One model's graph calls and its KV store: prompts and scoring on any thread, the store's writes
    and the decode steps on the engine thread."""

    def __init__(
        self,
        manifest: Manifest,
        store: StoreConfig,
        device: str = "auto",
        threads: int = 0,
        backend: str = "auto",
        open_prefill_session: bool = True,
        attention: str = "auto",
    ) -> None:
        self.manifest = manifest
        plan = serving_plan(manifest, device, attention, store.block_size)
        self.providers, self.on_gpu, self.dtype = plan.providers, plan.on_gpu, plan.dtype
        self.variant = serving_variant(self.dtype)
        manifest.verify_all()
        self.backend = make_backend(self.on_gpu, backend)
        # The fused graphs, where exported and `attention` allows them: decode of full float rows, prompts.
        self.fused, self.prompt_variant, self.local_cache = plan.fused, plan.prompt_variant, plan.local_cache
        self.layout = plan.layout
        self.eviction = manifest.cache_eviction
        rotary = None if self.eviction is None else self.eviction.rotary_inv_freq
        self.store = KVStore(self.layout, store.budget_bytes, store.block_size, store.max_tokens, self.backend, rotary)
        # A split layout's prompt path (KVLayout.local: the local layers' window kept apart); None for any other.
        window, in_place = self.layout.local, self._prompt_in_place
        self.split_prompts = (
            None if window is None else SplitPrompts(self.layout, window, self.backend, self.dtype, in_place)
        )
        # By storage kind; split rows are float rows only (their int8 policies are refused: CachePolicy.missing).
        self.graphs = cache_graphs(manifest, self.layout, int8=self.local_cache is None)
        self.binder = GraphBinder(self.backend, self.layout, manifest.vocab_size, self.graphs)
        self.threads = threads or default_threads()
        self.prefill_threads = threads or os.cpu_count() or 1
        # The decode calls (engine thread), one session per storage kind.
        self.sessions = {kind: self._session(self.threads, True, graph.variant) for kind, graph in self.graphs.items()}
        self.session = self.sessions[self.dtype]
        self.fused_session = self._session(self.threads, True, self.fused.variant) if self.fused else None
        # Prompts and scoring (prefill worker, tail worker, gRPC threads); the worker opens its own on its thread.
        tail_scratch = ScratchArray() if isinstance(self.backend, NumpyArrays) else None  # kv/scratch.py
        serving_prompts = serving_prompt_graph(manifest, self.dtype)
        self.prompt_sessions = PromptSessions(
            self._session, self.graphs, self.dtype, self.prompt_variant, serving_prompts, self.prefill_threads,
            tail_scratch, self._release_arena,
        )  # fmt: skip
        if open_prefill_session:
            self.prompt_sessions.open()
        self.prompt_graph = str(manifest.onnx_path(self.prompt_variant or serving_prompts))  # (for profiling it)
        self.pad_token_id = int(manifest.tokenizer["pad_token_id"])  # type: ignore[call-overload]
        self.timings = RunnerTimings()
        fused_rows = self.layout.storage(self.fused.dtype) if self.fused else None
        self.calls = DecodeCalls(self.binder, self.sessions, self.fused_session, fused_rows)
        self.policy_stream = PolicyStream(self.binder, rotary, self._prompt_forward)
        self.verifier = BlockVerifier(
            self.store, self.binder, self.calls, self.sessions, self.pad_token_id, self.timings,
            self._verify_session,
        )  # fmt: skip
        # Chaos testing only: a prompt containing these bytes makes its prefill call fail.
        marker = os.environ.get("POSENC_FAULT_INJECTION_MARKER")
        self._fault_marker = marker.encode() if marker else None

    def _verify_session(self) -> ModelSession | None:
        """The fused prompt graph's session for fused rows' speculative blocks (spec/verifier.py), or None."""
        return self._session(self.threads, True, self.prompt_variant) if self.fused and self.prompt_variant else None

    def _release_arena(self) -> None:
        """A one-token call whose run options shrink the prefill worker session's arena after it
        (PromptSessions.release)."""
        ids = np.full((1, 1), self.pad_token_id, dtype=np.int64)
        self._prompt_forward(ids, np.ones_like(ids), np.zeros_like(ids), None, last_only=True, release=True)

    def _session(self, threads: int, arena: bool, variant: str) -> ModelSession:
        path = str(self.manifest.onnx_path(variant))
        return ModelSession(path, self.providers, threads, arena, self.backend)

    # ------------------------------------------------------------------ prompts (any thread)

    def _prompt_call(
        self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: Array | None, last_only: bool
    ) -> tuple[np.ndarray, Array]:
        """One prompt call: host logits (B, T or 1, vocab) and the new tokens' K/V (2L, B, heads, T, hd;
        a split layout's `SplitKV` of the whole call)."""
        logits, cache = self._prompt_forward(ids, mask, positions, past, last_only)
        if isinstance(cache, SplitKV):
            return logits, cache
        return logits, cache[:, :, :, cache.shape[3] - ids.shape[1] :]

    def _prompt_forward(
        self,
        ids: np.ndarray,
        mask: np.ndarray,
        positions: np.ndarray,
        past: Array | None,
        last_only: bool,
        release: bool = False,
    ) -> tuple[np.ndarray, Array]:
        """One prompt call: host logits (B, T or 1, vocab; with `last_only` each row's last token's) and
        the whole cache, past and new, (2L, B, heads, P + T, hd). Batches come padded as
        `_pad_batch` pads them (the fused prompt graph: on the right)."""
        session = self.prompt_sessions.worker
        assert session is not None, "prompt_sessions.open() first"
        backend, layout = self.backend, self.layout
        batch = ids.shape[0]
        if past is None:
            past = backend.zeros((layout.tensors, batch, layout.n_heads, 0, layout.head_dim), self.dtype)
        inputs = [backend.upload(ids), backend.upload(mask), backend.upload(positions)]
        if self.prompt_variant is None:
            binding, logits, new_kv = self.binder.bind(session, *inputs, [past], self.dtype)
            session.run(binding, release_arena=release)
            self.prompt_sessions.held = self.prompt_sessions.worker_arena and not release
            cache = new_kv if past.shape[3] == 0 else backend.concatenate([past, new_kv], axis=3)
            host_logits = backend.download(logits[:, -1:] if last_only else logits)
            return host_logits.astype(np.float32), cache
        split = self.split_prompts
        local = None if split is None else split.fresh_local(inputs[1], ids.shape[1], past)
        binding, logits, cache = self.binder.bind_prompt(session, *inputs, past, local)
        session.run(binding, release_arena=release)
        if local is not None:
            cache = SplitKV(cache, local.present)
        self.prompt_sessions.held = not release
        if not last_only:
            return backend.download(logits).astype(np.float32), cache
        last = mask.sum(axis=1) - past.shape[3] - 1  # each row's last token among the new columns
        rows = [backend.download(logits[row, int(column) : int(column) + 1]) for row, column in enumerate(last)]
        return np.stack(rows).astype(np.float32), cache

    def _row_cache(self, cache: Array, row: int, columns: slice) -> Array:
        """One row's cache of a batched prompt call: its columns (a split layout's: SplitPrompts.row_cache)."""
        if not isinstance(cache, SplitKV):
            return cache[:, row, :, columns]
        assert self.split_prompts is not None, "a split cache comes from a split layout's prompt call"
        return self.split_prompts.row_cache(cache, row, columns)

    def _pad_batch(self, prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[slice]]:
        """(input_ids, attention_mask, position_ids) of prompts in one call, and each row's columns:
        left-padded for the explicit graph, right-padded for the fused prompt graph."""
        if self.prompt_variant is None:
            ids, mask, positions = left_pad_batch(prompts, self.pad_token_id)
            return ids, mask, positions, [slice(ids.shape[1] - len(p), ids.shape[1]) for p in prompts]
        ids, mask, positions = right_pad_batch(prompts, self.pad_token_id)
        return ids, mask, positions, [slice(0, len(p)) for p in prompts]

    def _check_fault(self, prompts: list[list[int]]) -> None:
        if self._fault_marker and any(self._fault_marker in bytes(t for t in ids if t < 256) for ids in prompts):
            raise RuntimeError("injected fault (POSENC_FAULT_INJECTION_MARKER)")

    def prefill(
        self, runs: list[PromptRun], chunk_tokens: int, lane: Lane = Lane.WORKER
    ) -> Iterator[list[PrefilledPrompt] | None]:
        """The one way to compute prompts into rows: yields None after every chunk but the last (the
        caller may do other work, or give up, in between), then the computed prompts in order. Whole
        prompts of up to `chunk_tokens` with no past (several: the prefill worker's batch) take one
        padded call. Otherwise one prompt at a time: streamed through its policy where that keeps
        fewer tokens than the prompt (PolicyStream), else in chunks of `chunk_tokens` (bounding the
        score tensors) after its past, each chunk attending to the cache of the ones before (through
        the fused prompt graph in place, where there is one). `lane`: the session (Lane)."""
        if lane is Lane.WORKER and all(not run.streams and self._whole(run, chunk_tokens) for run in runs):
            self._check_fault([run.token_ids for run in runs])
            yield self._batch(runs)
            return
        (run,) = runs
        if run.streams:
            assert run.policy is not None
            for streamed in self._stream_through_policy(run.request_id, run.token_ids, run.policy, chunk_tokens):
                yield None if streamed is None else [streamed]
            return
        self._check_fault([run.token_ids])
        for prompt in self._chunks(run, chunk_tokens, self.prompt_sessions.lane(lane)):
            yield None if prompt is None else [prompt]

    @staticmethod
    def _whole(run: PromptRun, chunk_tokens: int) -> bool:
        return run.past is None and len(run.token_ids) <= chunk_tokens

    def _batch(self, runs: list[PromptRun]) -> list[PrefilledPrompt]:
        """Whole prompts in one padded call; each row's cache comes back without padding."""
        prompts = [run.token_ids for run in runs]
        ids, mask, positions, columns = self._pad_batch(prompts)
        logits, cache = self._prompt_forward(ids, mask, positions, None, last_only=True)
        return [
            PrefilledPrompt(run.request_id, logits[row, -1], self._row_cache(cache, row, columns[row]), len(p))
            for row, (run, p) in enumerate(zip(runs, prompts, strict=True))
        ]

    def _chunks(self, run: PromptRun, chunk_tokens: int, lane: PromptLane) -> Iterator[PrefilledPrompt | None]:
        """One prompt after its past in chunks; None after every chunk but the last."""
        if self.prompt_variant is not None:  # one cache array for the whole prompt, every chunk in place
            yield from self._chunks_in_place(run, chunk_tokens, lane)
            return
        token_ids, past = run.token_ids, run.past
        for end, ids, mask, positions in chunk_inputs(token_ids, run.done, chunk_tokens):
            past = past.assemble() if isinstance(past, CachedPast) else past
            logits, past = self._prompt_forward(ids, mask, positions, past, last_only=True)
            yield PrefilledPrompt(run.request_id, logits[0, -1], past[:, 0], end) if end == len(token_ids) else None

    def _chunks_in_place(self, run: PromptRun, chunk_tokens: int, lane: PromptLane) -> Iterator[PrefilledPrompt | None]:
        """`_chunks` through the fused prompt graph: the cache array is made once, with room
        for the whole prompt (the past, if any, in its first columns), and each chunk's call reads
        the columns before it and writes its own after them, in place (the kernel's shared-buffer
        mode takes a buffer longer than the call's tokens; the mask says how many count). No chunk
        copies the past into a new array, and no call allocates a cache. `lane.scratch`: the calling
        thread's kept host memory to assemble a cached past into (the tail worker's)."""
        if self.split_prompts is not None:
            yield from self.split_prompts.chunks(run, chunk_tokens, lane)
            return
        token_ids, done, past = run.token_ids, run.done, run.past
        room = len(token_ids) - done
        if isinstance(past, CachedPast):
            cache = past.assemble(room, lane.scratch)
        else:
            layout = self.layout
            shape = (layout.tensors, 1, layout.n_heads, len(token_ids), layout.head_dim)
            cache = self.backend.zeros(shape, self.dtype)
            if past is not None:
                cache[:, :, :, :done] = past
        for end, ids, mask, positions in chunk_inputs(token_ids, done, chunk_tokens):
            logits, cache = self._prompt_in_place(ids, mask, positions, cache, lane.session)
            yield PrefilledPrompt(run.request_id, logits[0, -1], cache[:, 0], end) if end == len(token_ids) else None

    def _prompt_in_place(
        self,
        ids: np.ndarray,
        mask: np.ndarray,
        positions: np.ndarray,
        cache: Array,
        session: ModelSession | None = None,
        local: tuple[np.ndarray, Array] | None = None,
        last_only: bool = True,
    ) -> tuple[np.ndarray, Array]:
        """One row's chunk through the fused prompt graph with its past in place: `cache`
        (2L, 1, heads, N, hd), N >= P + S, the past in its first P columns (P + S: the mask's
        width), gets the chunk's K/V in the S columns after them. Host logits of the chunk's last token
        (1, 1, vocab; with `last_only` False every token's, (1, S, vocab)) and the cache. `session`: the
        prefill worker's unless given; `local`: a split layout's local mask and buffer (bound in place
        the same way)."""
        session = session or self.prompt_sessions.worker
        assert session is not None, "prompt_sessions.open() first"
        backend = self.backend
        inputs = [backend.upload(ids), backend.upload(mask), backend.upload(positions)]
        local_past = None if local is None else LocalPast(backend.upload(local[0]), local[1])
        binding, logits = self.binder.bind_prompt_in_place(session, *inputs, cache, local_past)
        session.run(binding)
        if session is self.prompt_sessions.worker:  # the tail session's small arena is kept (not released when idle)
            self.prompt_sessions.held = True
        return backend.download(logits[:, -1:] if last_only else logits).astype(np.float32), cache

    def score(self, token_ids: list[int], policy: CachePolicy | None = None, top: int = 0) -> Scored:
        """Teacher-forced log-probabilities of token_ids[1:] and the greedy prediction at each
        position (one call, outside the store; a text longer than a bounded policy's budget
        streams through it, one token at a time past the budget; under an int8 policy every token
        after the first, so each sees the int8 cache of the ones before it); `top`: each position's
        likeliest tokens and their log-probabilities too (echo's alternatives)."""
        inputs = token_ids[:-1]
        if not inputs:  # one token: nothing precedes it to score it by (a graph call of length 0 fails)
            empty = Scored(np.zeros(0), np.zeros(0, dtype=np.int64))
            if top:
                empty.top_ids, empty.top_logprobs = np.zeros((0, top), dtype=np.int64), np.zeros((0, top))
            return empty
        if policy is not None and len(inputs) > (head := policy.exact_tokens(len(inputs))):
            *_, streamed = self._stream_through_policy("score", inputs, policy, len(inputs), True, head)
            assert streamed is not None and streamed.all_logits is not None
            logits = streamed.all_logits
        elif self.split_prompts is not None:  # in chunks: the local layers never hold more than a window and a chunk
            logits = self.split_prompts.logits(PromptRun("score", inputs), SCORE_CHUNK_TOKENS)
        else:
            ids = np.asarray([inputs], dtype=np.int64)
            positions = np.arange(ids.shape[1], dtype=np.int64)[None]
            logits = self._prompt_call(ids, np.ones_like(ids), positions, None, last_only=False)[0][0]
        scored = Scored(log_probabilities(logits, token_ids[1:]), np.asarray(logits).argmax(-1))
        if top:
            scored.top_ids, scored.top_logprobs = top_logprobs(log_softmax(np.asarray(logits)), top)
        return scored

    def continue_logits(self, token_ids: list[int], done: int, past: Array | None, chunk_tokens: int) -> np.ndarray:
        """Every logit (len(token_ids) - done, vocab) of a prompt's tokens after its first `done`, whose K/V
        are `past` ((2 x layers, 1, heads, done, head_dim); a split layout's one-row `SplitKV`), in chunks
        of `chunk_tokens`: what follows a computed prompt, scored without a row of the store."""
        run = PromptRun("score", token_ids, past)
        assert run.done == done, f"a past of {run.done} tokens continued after {done}"
        if self.split_prompts is not None:
            return self.split_prompts.logits(run, chunk_tokens)
        kept: list[np.ndarray] = []
        for _, ids, mask, positions in chunk_inputs(token_ids, done, chunk_tokens):
            logits, past = self._prompt_forward(ids, mask, positions, past, last_only=False)
            kept.append(logits[0])
        return np.concatenate(kept)

    def _stream_through_policy(
        self,
        request_id: str,
        token_ids: list[int],
        policy: CachePolicy,
        chunk_tokens: int,
        keep_logits: bool = False,
        head_tokens: int | None = None,
    ) -> Iterator[StreamedPrompt | None]:
        """A prompt longer than a bounded policy's budget, as the policy sees it (PolicyStream.stream)."""
        session = self.prompt_sessions.by_kind.get(self.layout.kind_of(policy))
        assert session is not None, "prompt_sessions.open() first"
        yield from self.policy_stream.stream(
            request_id, token_ids, policy, session, chunk_tokens, keep_logits, head_tokens
        )

    # ------------------------------------------------------------------ the store (engine thread)

    def join(self, prompts: list[PrefilledPrompt]) -> None:
        """Computed prompts are written into the rows the scheduler reserved for them."""
        started = time.perf_counter()
        for prompt in prompts:
            self.store.write(prompt.request_id, prompt.cache, prompt.length, prompt.policy)
        self.timings.cache += time.perf_counter() - started

    def decode(self, tokens: dict[str, int]) -> dict[str, np.ndarray]:
        """One step for every member of the store: the token each feeds -> its logits (vocab,),
        copies (the engine steps through a kept `DecodePlan` instead)."""
        members = self.store.members()
        logits = self.decode_planned(self.plan_decode(members), [tokens[member] for member in members])
        return dict(zip(members, np.array(logits), strict=True))

    def plan_decode(self, ids: list[str]) -> DecodePlan:
        """The decode calls for these sequences, which must be every member of the store."""
        index = {sequence: position for position, sequence in enumerate(ids)}
        parts: list[tuple[CapacityClass, DecodeCall, list[int] | None]] = []
        members: list[str] = []
        for klass in self.store.batches():
            picks = [index.get(member, -1) for member in klass.members]
            if -1 in picks:
                missing = klass.members[picks.index(-1)]
                raise ValueError(f"a decode step feeds every member of the store: {missing!r} is not fed")
            in_order = picks == list(range(len(members), len(members) + len(picks)))
            parts.append((klass, self.calls.get(klass), None if in_order and len(picks) == len(ids) else picks))
            members += klass.members
        if len(members) != len(ids):
            raise ValueError(f"a decode step feeds every member of the store: {len(members)}, not {len(ids)}")
        order = None
        if members != ids:
            row_of = {member: row for row, member in enumerate(members)}
            order = np.fromiter((row_of[sequence] for sequence in ids), dtype=np.int64, count=len(ids))
        return DecodePlan(ids, parts, order)

    def decode_planned(self, plan: DecodePlan, tokens: list[int]) -> np.ndarray:
        """One step of the plan's sequences, `tokens` fed in its order: their logits (n, vocab)
        float32 in that order. A view of the graph's output buffer when one class holds them all in
        order: good until the next step (the engine samples at once)."""
        parts = []
        for klass, call, picks in plan.parts:
            fed = tokens if picks is None else [tokens[position] for position in picks]
            started = time.perf_counter()
            self.binder.set_ids(klass.input_ids[: len(fed), 0], fed)
            call.session.run(call.binding)
            after_graph = time.perf_counter()
            klass.append_step(call.new_kv)
            logits = self.backend.download(call.logits[:, -1])
            parts.append(logits if logits.dtype == np.float32 else logits.astype(np.float32))
            self.timings.cache += time.perf_counter() - after_graph
            self.timings.graph += after_graph - started
        if len(parts) == 1 and plan.order is None:
            return parts[0]
        stacked = np.concatenate(parts)
        return stacked if plan.order is None else stacked[plan.order]

    def forget_calls(self, everything: bool = False) -> None:
        """Drop the bindings (and output buffers) of classes that no longer exist, or all of them."""
        self.calls.forget(self.store.has_class, everything)
        self.verifier.forget(self.store.has_class, everything)
