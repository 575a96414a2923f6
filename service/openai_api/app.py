"""The OpenAI-compatible HTTP API (aiohttp), on the gRPC server's engine client: one engine core,
one KV budget and one admission control for both front ends.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, the tokenizer's (POST
/tokenize, POST /detokenize, GET /tokenizer_info), GET /openapi.json (their OpenAPI description), GET
/health (200 while serving, 503 while starting, restarting or draining; no token needed, as gRPC's
health, nor for /openapi.json). Every other path needs `Authorization: Bearer <token>` of a tenant
when the server has tokens (service.security). Streams are server-sent events as OpenAI sends them, ending
`data: [DONE]`. A client that goes away (its connection closes) cancels its request in the engine.
Each call is counted in posenc_requests_total{api="http"} with its path as `method` and the gRPC
name of its outcome as `code` (CANCELLED for a client that left).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from aiohttp import web

from service.engine.messages import GenerateInput, ModelInfo, RequestError, RequestStatus
from service.engine_client import EngineClient
from service.logprobs import TokenAligner, aligned, token_string
from service.metrics import ServiceMetrics
from service.openai_api import openapi, types
from service.openai_api.protocol import ApiError, Generation, conform, parse_generation, shown
from service.openai_api.responses import DONE, Choice, Shapes, Usage, models_list
from service.openai_api.stream import AsyncOutputStream
from service.request_handle import RequestHandle
from service.security import Tenants

logger = logging.getLogger(__name__)

# The outcome of a call as the gRPC side names it (one `code` vocabulary in posenc_requests_total).
CODES = {
    200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "UNIMPLEMENTED",
    429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}  # fmt: skip
ABORTS = {
    RequestStatus.FINISHED_CANCELLED: ApiError(499, "request cancelled", code="cancelled"),
    RequestStatus.FINISHED_DEADLINE: ApiError(504, "deadline exceeded", code="deadline_exceeded"),
    RequestStatus.FINISHED_ERROR: ApiError(500, "inference failed", code="internal_error"),
    RequestStatus.FINISHED_SHUTDOWN: ApiError(503, "server shut down", code="service_unavailable"),
}
PUBLIC = ("/health", "/openapi.json")
MAX_JSON_DEPTH = 32  # request bodies: the deepest this API's shapes nest is 4 (a chat message's content part)
Labels = Callable[[str], dict[str, str]]


class OpenAIApi:
    """The handlers, over whatever engine client the server holds now (None while it starts)."""

    def __init__(
        self, engine: Callable[[], EngineClient | None], draining: Callable[[], bool], metrics: ServiceMetrics,
        labels: Labels, tenants: Tenants | None = None, submit_threads: int = 64,
        leaving: Callable[[], bool] | None = None,
    ) -> None:  # fmt: skip
        """`draining`: new calls are refused (503); `leaving`: /health says 503 (from the start of a
        drain, while new calls are still served for the drain delay, so proxies move away first)."""
        self._engine, self._draining, self._metrics, self._labels = engine, draining, metrics, labels
        self._leaving = leaving or draining
        self._tenants = tenants or Tenants()
        # EngineClient.submit blocks until the core accepts or refuses (a pipe round trip): off the loop.
        self._submitter = ThreadPoolExecutor(submit_threads, thread_name_prefix="http-submit")
        self._created = int(time.time())
        self._openapi_documents: dict[tuple[str, ...], bytes] = {}  # by the served models' names

    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._account, self._errors, self._authorize], client_max_size=16 << 20)
        app.router.add_post("/v1/completions", lambda request: self._generate(request, chat=False))
        app.router.add_post("/v1/chat/completions", lambda request: self._generate(request, chat=True))
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/tokenizer_info", self._tokenizer_info)
        app.router.add_get("/health", self._health)
        app.router.add_get("/openapi.json", self._openapi)
        return app

    def close(self) -> None:
        self._submitter.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ middlewares (outermost first)

    @web.middleware
    async def _account(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        """Count the call once, with the code its client saw (a client that left: CANCELLED)."""
        started, code = time.monotonic(), "UNKNOWN"
        try:
            response = await handler(request)
            code = request.get("code") or CODES.get(response.status, "UNKNOWN")
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            code = "CANCELLED"
            raise
        finally:
            if request.path != "/health":
                labels = self._labels(request.get("model", ""))
                method = request.path if request.match_info.route.resource is not None else "unknown"
                self._metrics.requests.labels(**labels, method=method, code=code, api="http").inc()
                self._metrics.request_duration.labels(**labels, method=method, api="http").observe(
                    time.monotonic() - started
                )

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        """Every refusal in OpenAI's error shape."""
        try:
            return await handler(request)
        except ApiError as error:
            return error_response(error)
        except web.HTTPException as error:  # unknown path or method
            if error.status < 400:
                raise
            response = error_response(ApiError(error.status, f"{request.method} {request.path}: {error.reason}"))
            if isinstance(error, web.HTTPMethodNotAllowed):  # RFC 9110: a 405 says which methods the path takes
                response.headers["Allow"] = ", ".join(sorted(error.allowed_methods))
            return response

    @web.middleware
    async def _authorize(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        """The caller's tenant (its token's; "" without tokens) goes with the request."""
        if request.path not in PUBLIC:
            tenant = self._tenants.tenant(request.headers.get("Authorization", ""))
            if tenant is None:
                raise ApiError(401, "authorization: missing or invalid bearer token", code="invalid_api_key")
            request["tenant"] = tenant
        return await handler(request)

    # ------------------------------------------------------------------ routes

    async def _health(self, request: web.Request) -> web.Response:
        engine = self._engine()
        serving = engine is not None and engine.serving and not self._leaving()
        return web.json_response({"status": "serving" if serving else "not serving"}, status=200 if serving else 503)

    async def _openapi(self, request: web.Request) -> web.Response:
        """The served description: the served models' names and limits in the request schemas."""
        engine = self._engine()
        models = engine.models if engine is not None else {}
        key = tuple(sorted(models))
        if key not in self._openapi_documents:
            self._openapi_documents[key] = openapi.document(models, secured=self._tenants.required)
        return web.Response(body=self._openapi_documents[key], content_type="application/json")

    async def _models(self, request: web.Request) -> web.Response:
        engine = self._serving_engine()
        return web.Response(body=models_list(engine.models, self._created), content_type="application/json")

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        engine = self._serving_engine()
        body = await _json_body(request)
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            request["model"] = body["model"]
        kind = types.ChatCompletionRequest if chat else types.CompletionRequest
        generation = conform(body, kind, lambda body: parse_generation(body, engine.models, chat, request["tenant"]))
        loop = asyncio.get_running_loop()
        handles: list[RequestHandle] = []
        outputs: list[AsyncOutputStream] = []
        try:
            for raw in generation.inputs:  # n prompts: n engine requests, all accepted or none kept
                output = AsyncOutputStream(loop)
                try:
                    handles.append(await loop.run_in_executor(self._submitter, engine.submit, raw, output))
                except RequestError as error:
                    raise ApiError.of(error, generation.names) from None
                outputs.append(output)
            shapes = Shapes(generation, engine.models[generation.input.model])
            if generation.stream:
                return await self._stream(request, generation, shapes, handles, outputs)
            return await self._whole(generation, shapes, handles, outputs)
        finally:
            for handle in handles:
                if not handle.status.finished:  # the client left (or the response failed): free its cache
                    engine.cancel(handle)
                    request["code"] = "CANCELLED"

    async def _whole(
        self, generation: Generation, shapes: Shapes, handles: list[RequestHandle], outputs: list[AsyncOutputStream]
    ) -> web.Response:
        for output in outputs:
            while True:
                event = await output.next()
                if event is not None and event.status.finished:
                    break
        for handle in handles:
            if handle.status in ABORTS:
                raise _abort(handle)
        choices = []
        for raw, handle in zip(generation.inputs, handles, strict=True):
            echoed = _echo(raw, handle) if generation.echo else Choice("", None, [])
            generated = [(t.token_id, t) for t in aligned(handle.text, handle.logprobs)]
            logprobs = echoed.logprobs + generated if echoed.logprobs is not None else None  # type: ignore[operator]
            choices.append(Choice(echoed.text + handle.text, handle.status, logprobs))
        body = shapes.whole(choices, _usage(handles))
        return web.Response(body=body, content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        generation: Generation,
        shapes: Shapes,
        handles: list[RequestHandle],
        outputs: list[AsyncOutputStream],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        first = shapes.first()
        if first:
            await response.write(first)
        plain = len(handles) == 1 and generation.logprobs is None and not generation.echo
        streams = (self._plain_choice if plain else self._choice)(response, generation, shapes, handles, outputs)
        await asyncio.gather(*streams)
        aborted = [handle for handle in handles if handle.status in ABORTS]
        if aborted:  # the stream has begun: the error goes in it, as vLLM sends it
            error = _abort(aborted[0])
            request["code"] = CODES[error.status]
            await response.write(b"data: " + error.body() + b"\n\n")
        elif generation.include_usage:
            await response.write(shapes.usage_chunk(_usage(handles)))
        await response.write(DONE)
        await response.write_eof()
        return response

    @staticmethod
    def _plain_choice(
        response: web.StreamResponse, generation: Generation, shapes: Shapes, handles: list[RequestHandle],
        outputs: list[AsyncOutputStream],
    ) -> list[Awaitable[None]]:  # fmt: skip
        """One prompt, no log-probabilities: every chunk preformatted (the common, cheapest case)."""

        async def stream() -> None:
            (handle,), (output,) = handles, outputs
            while True:
                event = await output.next()
                if event is None:
                    continue
                if event.status.finished:
                    break
                if event.text:
                    await response.write(shapes.chunk(event.text))
            if handle.status not in ABORTS:
                await response.write(shapes.last(event.text, handle.status))

        return [stream()]

    @staticmethod
    def _choice(
        response: web.StreamResponse, generation: Generation, shapes: Shapes, handles: list[RequestHandle],
        outputs: list[AsyncOutputStream],
    ) -> list[Awaitable[None]]:  # fmt: skip
        """Each prompt's chunks, index by index as they come, with their tokens' log-probabilities."""
        wanted = generation.logprobs is not None

        async def stream(index: int, raw: GenerateInput, handle: RequestHandle, output: AsyncOutputStream) -> None:
            if generation.echo:
                await response.write(shapes.choice_chunk(index, _echo(raw, handle)))
            aligner = TokenAligner()
            while True:
                event = await output.next()
                if event is None:
                    continue
                tokens = aligner.take(event.text, event.logprobs) if wanted else []
                logprobs = [(t.token_id, t) for t in tokens] if wanted else None
                if event.status.finished:
                    if handle.status not in ABORTS:
                        await response.write(shapes.choice_chunk(index, Choice(event.text, handle.status, logprobs)))
                    return
                if event.text or tokens:
                    await response.write(shapes.choice_chunk(index, Choice(event.text, None, logprobs)))

        rows = zip(generation.inputs, handles, outputs, strict=True)
        return [stream(index, raw, handle, output) for index, (raw, handle, output) in enumerate(rows)]

    # ------------------------------------------------------------------ tokenizer (vLLM's shapes)

    async def _tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize {"prompt", "add_special_tokens" (default true), "model" (optional)}: the ids
        the engine computes a text prompt as (BOS first when added); no special is parsed out of text."""
        engine = self._serving_engine()
        info, prompt, special = conform(
            await _json_body(request), types.TokenizeRequest, lambda body: _tokenize_fields(engine, body)
        )
        ids = info.prompt_ids(prompt) if special else list(prompt.encode("utf-8"))
        limit = info.max_positions or info.max_sequence_tokens
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": limit})

    async def _detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize {"tokens", "model" (optional)}: the text of the byte tokens (specials skipped)."""
        engine = self._serving_engine()
        tokens = conform(
            await _json_body(request), types.DetokenizeRequest, lambda body: _detokenize_fields(engine, body)
        )
        text = bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
        return web.json_response({"prompt": text})

    async def _tokenizer_info(self, request: web.Request) -> web.Response:
        """GET /tokenizer_info: what lm-evaluation-harness's remote tokenizer reads (vLLM's endpoint)."""
        engine = self._serving_engine()
        info = _tokenizer_model(engine, dict(request.query))
        return web.json_response({
            "tokenizer_class": "ByteLevel", "vocab_size": info.vocab_size, "add_bos_token": info.add_bos,
            "bos_token": token_string(info.bos_token_id, info), "eos_token": token_string(info.eos_token_id, info),
            "pad_token": None, "bos_token_id": info.bos_token_id, "eos_token_id": info.eos_token_id,
            "model_max_length": info.max_positions or info.max_sequence_tokens,
        })  # fmt: skip

    def _serving_engine(self) -> EngineClient:
        if self._draining():
            raise ApiError(503, "server is draining (stopping): running requests finish, new ones go elsewhere; retry",
                           code="service_unavailable")  # fmt: skip
        engine = self._engine()
        if engine is None or not engine.models:
            raise ApiError(503, "server is starting: models are loading; retry", code="service_unavailable")
        return engine


def _usage(handles: list[RequestHandle]) -> Usage:
    """The request's usage: its prompts' added up (OpenAI's for several prompts)."""
    return Usage(
        sum(h.prompt_tokens for h in handles),
        sum(h.completion_tokens for h in handles),
        sum(h.cached_prompt_tokens for h in handles),
        sum(h.reused_prompt_tokens for h in handles),
    )


def _echo(raw: GenerateInput, handle: RequestHandle) -> Choice:
    """The prompt a completion echoes: its text and, where asked, each token's log-probability."""
    text = raw.prompt if not raw.prompt_ids else bytes(t for t in raw.prompt_ids if t < 256).decode("utf-8", "replace")
    if handle.prompt_logprobs is None:
        return Choice(text, None, None)
    return Choice(text, None, list(zip(handle.prompt_ids, handle.prompt_logprobs, strict=True)))


async def _json_body(request: web.Request) -> Any:
    """The body's JSON, nested at most MAX_JSON_DEPTH deep (a deeper one is refused, not decoded by
    recursion until the stack gives out)."""
    raw = await request.read()
    too_deep = ApiError(400, f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as error:
        raise ApiError(400, f"request body: not valid JSON ({error})") from None
    except RecursionError:
        raise too_deep from None
    # Only a body with more brackets than the limit can be nested past it: the walk is rarely needed.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and json_depth(body) > MAX_JSON_DEPTH:
        raise too_deep
    return body


def json_depth(value: Any) -> int:
    """How deep containers nest in a decoded JSON value (a scalar: 0), without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _tokenize_fields(engine: EngineClient, body: dict[str, Any]) -> tuple[ModelInfo, str, bool]:
    """POST /tokenize's model, prompt and add_special_tokens, or the refusal naming the field."""
    info = _tokenizer_model(engine, body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, f"prompt: required, a string; got {shown(prompt)}", "prompt")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise ApiError(400, f"add_special_tokens: must be a boolean, got {shown(special)}", "add_special_tokens")
    return info, prompt, special


def _detokenize_fields(engine: EngineClient, body: dict[str, Any]) -> list[int]:
    """POST /detokenize's token ids, each in the vocabulary, or the refusal naming the field."""
    info = _tokenizer_model(engine, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(400, f"tokens: required, a list of token ids; got {shown(tokens)}", "tokens")
    bad = [t for t in tokens if not 0 <= t < info.vocab_size]
    if bad:
        raise ApiError(400, f"tokens: token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})", "tokens")
    return tokens


def _tokenizer_model(engine: EngineClient, body: Any) -> ModelInfo:
    """The model a tokenizer call names (`model`), or the first served: every scheme shares the byte tokenizer."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body: must be a JSON object")
    name = body.get("model")
    if name is None:
        return engine.models[sorted(engine.models)[0]]
    if not isinstance(name, str):
        raise ApiError(400, f"model: must be a string, got {shown(name)}", "model")
    if name not in engine.models:
        raise ApiError(404, f"model: {shown(name)} is not served here", "model", "model_not_found")
    return engine.models[name]


def _abort(handle: RequestHandle) -> ApiError:
    template = ABORTS[handle.status]
    return ApiError(template.status, handle.error or template.message, code=template.code)


def error_response(error: ApiError) -> web.Response:
    headers = {}
    if error.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(error.retry_after + 0.499)))  # whole seconds, rounded up
        headers["retry-after-ms"] = str(max(1, round(error.retry_after * 1000)))
    return web.Response(status=error.status, body=error.body(), content_type="application/json", headers=headers)
