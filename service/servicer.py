"""posenc.v1.Generation: proto <-> engine types and status codes. Nothing else (every RPC is
counted by service.accounting, around this)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import grpc

from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.api.retry import RETRY_AFTER_KEY
from service.engine.messages import (
    ErrorKind,
    GenerateInput,
    ModelInfo,
    PromptSegment,
    RequestError,
    RequestStatus,
    TokenLogprob,
)
from service.engine.processing.streams import StreamEvent
from service.engine_client import EngineClient
from service.logprobs import TokenAligner, aligned
from service.request_handle import RequestHandle
from service.security import Tenants, cache_salt

FINISH_REASONS = {
    RequestStatus.FINISHED_LENGTH: pb.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_STOP: pb.FINISH_REASON_STOP,
    RequestStatus.FINISHED_EOS: pb.FINISH_REASON_EOS,
}
ERROR_CODES = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
ABORT_CODES = {
    RequestStatus.FINISHED_CANCELLED: grpc.StatusCode.CANCELLED,
    RequestStatus.FINISHED_DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    RequestStatus.FINISHED_ERROR: grpc.StatusCode.INTERNAL,
    RequestStatus.FINISHED_SHUTDOWN: grpc.StatusCode.UNAVAILABLE,
}


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after = code, message, retry_after

    def abort(self, context: grpc.ServicerContext) -> None:
        if self.retry_after is not None:
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(max(1, round(self.retry_after * 1000)))),))
        context.abort(self.code, self.message)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, tenants: Tenants | None = None) -> None:
        self.engine: EngineClient | None = None  # set once the engine core has loaded the models
        self.tenants = tenants or Tenants()  # the caller's token names its tenant: its prefix-cache salt

    def labels(self, model: str) -> dict[str, str]:
        """Metric labels of a model name; unknown names (and none) share one empty label set."""
        if self.engine is not None and model in self.engine.models:
            return {"model": model, "scheme": self.engine.models[model].scheme}
        return {"model": "", "scheme": ""}

    # ------------------------------------------------------------------ RPCs

    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        try:
            engine = self._engine(context)
        except _Aborted as aborted:
            aborted.abort(context)
        models = [model_info(info) for _, info in sorted(engine.models.items())]
        return pb.ListModelsResponse(models=models)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        try:
            handle = self._submit(request, context)
            while not handle.done.wait(0.5):  # no per-token wake-ups: only the end matters here
                if not context.is_active():
                    self.engine.cancel(handle)  # type: ignore[union-attr]
            self._raise_if_aborted(handle)
        except _Aborted as aborted:
            aborted.abort(context)
        return pb.GenerateResponse(
            text=handle.text,
            finish_reason=FINISH_REASONS[handle.status],
            usage=_usage(handle),
            timings=_timings(handle),
            logprobs=_logprobs(aligned(handle.text, handle.logprobs)),
            prompt_logprobs=_prompt_logprobs(handle),
        )

    def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateStreamResponse]:
        try:
            handle = self._submit(request, context)
            aligner = TokenAligner()
            prompt = _prompt_logprobs(handle)
            for event in self._events(handle, context):
                logprobs = _logprobs(aligner.take(event.text, event.logprobs)) if event.logprobs else []
                if event.status.finished:
                    self._raise_if_aborted(handle)
                    yield pb.GenerateStreamResponse(
                        text=event.text,
                        finish_reason=FINISH_REASONS[handle.status],
                        usage=_usage(handle),
                        timings=_timings(handle),
                        logprobs=logprobs,
                        prompt_logprobs=prompt,
                    )
                elif event.text or logprobs or prompt:
                    yield pb.GenerateStreamResponse(text=event.text, logprobs=logprobs, prompt_logprobs=prompt)
                else:
                    continue
                prompt = []
        except _Aborted as aborted:
            aborted.abort(context)

    def Score(self, request: pb.ScoreRequest, context: grpc.ServicerContext) -> pb.ScoreResponse:
        try:
            engine = self._engine(context)
            scored = self._call(
                lambda: engine.score(request.model, request.text, request.cache_policy, context.time_remaining())
            )
        except _Aborted as aborted:
            aborted.abort(context)
        logprobs = scored.logprobs
        total = float(logprobs.sum())
        return pb.ScoreResponse(
            token_logprobs=logprobs.astype(float).tolist(),
            total_logprob=total,
            tokens=len(logprobs),
            bits_per_byte=-total / math.log(2) / max(1, len(logprobs)),
            greedy_tokens=scored.greedy.tolist(),
        )

    # ------------------------------------------------------------------ helpers

    def _engine(self, context: grpc.ServicerContext) -> EngineClient:
        # No refusal while draining: once the port has closed (GOAWAY) gRPC itself turns new streams
        # away before any handler runs, so a proxy or a retry policy sends them elsewhere; a handler
        # that runs was accepted before that and is served (a refusal here reached clients without
        # retries through nginx, which cannot retry a status).
        if self.engine is None:
            raise _Aborted(grpc.StatusCode.UNAVAILABLE, "server is starting: models are loading; retry")
        return self.engine

    def _call(self, fn):  # type: ignore[no-untyped-def]
        try:
            return fn()
        except RequestError as error:
            raise _Aborted(ERROR_CODES[error.kind], error.message, error.retry_after) from None

    def _submit(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> RequestHandle:
        engine = self._engine(context)
        remaining = context.time_remaining()
        if request.segments and request.prompt:
            raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, "segments: set either prompt or segments, not both")
        if request.prompt_token_ids and (request.prompt or request.segments):
            raise _Aborted(
                grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: set either prompt_token_ids or prompt/segments"
            )
        segments = tuple(PromptSegment(s.text, s.reusable) for s in request.segments)
        tenant = self.tenant(context)
        raw = GenerateInput(
            model=request.model,
            prompt="".join(s.text for s in segments) if segments else request.prompt,
            max_new_tokens=request.max_new_tokens if request.HasField("max_new_tokens") else None,
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p if request.HasField("top_p") else None,
            seed=request.seed,
            stop=tuple(request.stop),
            deadline=time.monotonic() + remaining if remaining is not None else None,
            cache_policy=request.cache_policy,
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            segments=segments,
            segment_repair_tokens=request.segment_repair_tokens,
            logprobs=request.logprobs if request.HasField("logprobs") else None,
            prompt_logprobs=request.prompt_logprobs if request.HasField("prompt_logprobs") else None,
            prompt_ids=tuple(request.prompt_token_ids),
            speculative_tokens=request.speculative_tokens if request.HasField("speculative_tokens") else None,
            logit_bias=tuple(sorted(request.logit_bias.items())),
            cache_salt=self._call(lambda: cache_salt(tenant, request.cache_salt)),
            tenant=tenant,
            priority=request.priority,
        )
        handle: RequestHandle = self._call(lambda: engine.submit(raw))
        context.add_callback(lambda: engine.cancel(handle))
        return handle

    def tenant(self, context: grpc.ServicerContext) -> str:
        """The caller's tenant (its token's; the token was checked already): its prefix-cache salt
        and its flow in the fair scheduler."""
        authorization = dict(context.invocation_metadata() or ()).get("authorization", "")
        return self.tenants.tenant(str(authorization)) or ""

    def _events(self, handle: RequestHandle, context: grpc.ServicerContext) -> Iterator[StreamEvent]:
        """The request's new text as it comes; texts produced while we were sending are merged."""
        while True:
            event = handle.output.get(timeout=0.5)
            if event is None:
                if not context.is_active():
                    self.engine.cancel(handle)  # type: ignore[union-attr]
                continue
            yield event
            if event.status.finished:
                return

    def _raise_if_aborted(self, handle: RequestHandle) -> None:
        if handle.status in ABORT_CODES:
            raise _Aborted(ABORT_CODES[handle.status], handle.error or handle.status.name.lower())


def model_info(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        name=info.name,
        scheme=info.scheme,
        max_positions=info.max_positions,
        train_context=info.train_context,
        kv_cache_bytes_per_token=info.kv_cache_bytes_per_token,
        n_layers=info.n_layers,
        n_heads=info.n_heads,
        head_dim=info.head_dim,
        dtype=info.dtype,
        max_new_tokens_limit=info.max_new_tokens_limit,
        max_sequence_tokens=info.max_sequence_tokens,
        kv_cache_capacity_bytes=info.kv_cache_capacity_bytes,
        cache_policies=info.cache_policies,
        default_cache_policy=info.default_cache_policy,
        eviction_positions=info.eviction_positions,
        segment_reuse=info.segment_reuse,
        vocab_size=info.vocab_size,
        bos_token_id=info.bos_token_id,
        eos_token_id=info.eos_token_id,
        add_bos=info.add_bos,
        kv_cache_bytes_per_sequence=info.kv_cache_bytes_per_sequence,
        random_weights=info.random_weights,
    )


def _logprobs(logprobs: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob, top_token_ids=t.top_ids, top_logprobs=t.top_logprobs)
        for t in logprobs
    ]


def _prompt_logprobs(handle: RequestHandle) -> list[pb.TokenLogprob]:
    """Every prompt token's, the first with no log-probability (nothing precedes it)."""
    if handle.prompt_logprobs is None:
        return []
    out = [pb.TokenLogprob(token_id=handle.prompt_ids[0])] if handle.prompt_ids else []
    return out + _logprobs([t for t in handle.prompt_logprobs if t is not None])


def _usage(handle: RequestHandle) -> pb.Usage:
    prompt, completion = handle.prompt_tokens, handle.completion_tokens
    return pb.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        cached_prompt_tokens=handle.cached_prompt_tokens,
        reused_prompt_tokens=handle.reused_prompt_tokens,
    )


def _timings(handle: RequestHandle) -> pb.Timings:
    end = handle.finish_time or time.monotonic()
    first = handle.first_token_time or end
    queued = (handle.scheduled_time or first) - handle.arrival_time
    return pb.Timings(
        time_to_first_token_seconds=first - handle.arrival_time,
        total_seconds=end - handle.arrival_time,
        queue_seconds=max(0.0, queued),
    )
