"""GET /openapi.json: the HTTP API's OpenAPI 3.1 description, made from its types
(service.openai_api.types) by msgspec's JSON Schema, so it says what the parser reads and what the
answers hold; tests/service/test_openapi.py runs schemathesis against a real server over it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from service.openai_api import types

# A refusal's status and when it comes (every one carries types.ErrorResponse).
ERRORS = {
    400: "a field breaks a limit: `param` and the message name the field and the limit",
    401: "the server has tokens and the call carries none of them (Authorization: Bearer <token>)",
    404: "the model is not served here (the message lists the served ones)",
    413: "the body is over 16 MiB",
    429: "the model's queue is full, or the request would miss the time-to-first-token target (Retry-After)",
    503: "the server is starting or draining; retry",
}
GENERATION_ERRORS = (400, 401, 404, 413, 429, 503)
TOKENIZER_ERRORS = (400, 401, 404, 413, 503)
STREAM = "with `stream: true`: server-sent events, OpenAI's chunks, ending `data: [DONE]`"
# One server-sent event: its data is a chunk as JSON (a choice's new text, the usage, or an error in
# OpenAI's shape), or [DONE] last.
SSE_EVENT = {
    "type": "object",
    "description": STREAM,
    "properties": {"data": {"type": "string", "description": "a chunk as JSON, or [DONE]"}},
    "required": ["data"],
}


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    operation_id: str
    summary: str
    answer: type
    request: type | None = None
    errors: tuple[int, ...] = (401, 503)
    streams: bool = False
    public: bool = False  # no token needed


OPERATIONS = (
    Operation("post", "/v1/completions", "createCompletion", "Continue a prompt", types.Completion,
              types.CompletionRequest, GENERATION_ERRORS, streams=True),
    Operation("post", "/v1/chat/completions", "createChatCompletion", "Continue a conversation's text",
              types.ChatCompletion, types.ChatCompletionRequest, GENERATION_ERRORS, streams=True),
    Operation("get", "/v1/models", "listModels", "The served models and their limits", types.ModelList),
    Operation("post", "/tokenize", "tokenize", "A text's token ids, as the engine computes them", types.Tokenized,
              types.TokenizeRequest, TOKENIZER_ERRORS),
    Operation("post", "/detokenize", "detokenize", "The text of token ids", types.Detokenized,
              types.DetokenizeRequest, TOKENIZER_ERRORS),
    Operation("get", "/tokenizer_info", "tokenizerInfo", "The byte tokenizer", types.TokenizerInfo,
              errors=(401, 404, 503)),
    Operation("get", "/health", "health", "200 while serving, 503 while starting or draining", types.Health,
              errors=(), public=True),
)  # fmt: skip


def openapi() -> dict[str, Any]:
    """The whole document: every operation, every type it names under components.schemas."""
    named = [types.ErrorResponse, *(o.answer for o in OPERATIONS), *(o.request for o in OPERATIONS if o.request)]
    _, schemas = msgspec.json.schema_components(named, ref_template="#/components/schemas/{name}")
    paths: dict[str, dict[str, Any]] = {}
    for operation in OPERATIONS:
        paths.setdefault(operation.path, {})[operation.method] = _operation(operation)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "posenc-serve OpenAI-compatible HTTP API",
            "version": "1",
            "description": "OpenAI's completions and chat completions over byte-level code models; "
            "docs/http-api.md says what each field does and its limits.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def _ref(kind: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{kind.__name__}"}


def _operation(operation: Operation) -> dict[str, Any]:
    answer: dict[str, Any] = {"application/json": {"schema": _ref(operation.answer)}}
    if operation.streams:
        answer["text/event-stream"] = {"schema": SSE_EVENT}
    responses: dict[str, Any] = {"200": {"description": operation.summary, "content": answer}}
    if operation.public and operation.answer is types.Health:
        responses["503"] = {"description": "starting or draining", "content": answer}
    for status in operation.errors:
        responses[str(status)] = {
            "description": ERRORS[status],
            "content": {"application/json": {"schema": _ref(types.ErrorResponse)}},
        }
    body: dict[str, Any] = {"operationId": operation.operation_id, "summary": operation.summary, "responses": responses}
    if operation.request is not None:
        body["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(operation.request)}}}
    if operation.public:
        body["security"] = []
    return body


def document() -> bytes:
    return msgspec.json.encode(openapi())
