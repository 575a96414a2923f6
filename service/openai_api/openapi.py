"""GET /openapi.json: the HTTP API's OpenAPI 3.1 description, made from its types
(service.openai_api.types) by msgspec's JSON Schema, so it says what the parser reads and what the
answers hold; tests/service/test_openapi.py runs schemathesis against a real server over it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from service.engine.messages import ModelInfo
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


def openapi(models: dict[str, ModelInfo] | None = None, secured: bool = True) -> dict[str, Any]:
    """The whole document: every operation, every type it names under components.schemas; with the
    served `models`, their names and the limits every one of them holds in the request schemas;
    `secured`: the server takes bearer tokens (without, no operation asks for one)."""
    named = [types.ErrorResponse, *(o.answer for o in OPERATIONS), *(o.request for o in OPERATIONS if o.request)]
    _, schemas = msgspec.json.schema_components(named, ref_template="#/components/schemas/{name}")
    _relate_completion_fields(schemas["CompletionRequest"])
    # Chat's top_logprobs needs logprobs: true; max_tokens or max_completion_tokens, not both.
    asked = {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}}
    lengths = ("max_tokens", "max_completion_tokens")
    both = {"required": list(lengths), "properties": {field: {"type": "integer"} for field in lengths}}
    schemas["ChatCompletionRequest"]["allOf"] = [
        {"if": asked, "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        {"not": both},
    ]
    # Both: stream_options (any option set) only with stream: true.
    options = {"required": ["stream_options"], "properties": {"stream_options": {"type": "object", "minProperties": 1}}}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schemas[name]["allOf"].append(
            {"if": options, "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
        )
    if models:
        for operation in OPERATIONS:
            if operation.request is not None:
                _serve(schemas[operation.request.__name__], models)
    paths: dict[str, dict[str, Any]] = {}
    for operation in OPERATIONS:
        paths.setdefault(operation.path, {})[operation.method] = _operation(operation)
    document = {
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
    if not secured:
        del document["security"], document["components"]["securitySchemes"]
        for item in paths.values():
            for operation in item.values():
                operation.pop("security", None)
                operation["responses"].pop("401", None)
    return document


def _relate_completion_fields(schema: dict[str, Any]) -> None:
    """What /v1/completions checks across fields, which the types cannot say: a prompt's shapes (a
    string; token ids; or at most MAX_PROMPTS strings and token-id lists), segments instead of a prompt
    (never both, and one of them), max_tokens 0 only with echo."""
    token = {"type": "integer", "minimum": 0, "maximum": 2**32 - 1, "description": types.TOKEN_ID}
    ids = {"type": "array", "items": token, "minItems": 1}
    prompts = {"type": "array", "items": {"anyOf": [{"type": "string", "minLength": 1}, ids]}, "minItems": 1,
               "maxItems": types.MAX_PROMPTS}  # fmt: skip
    schema["properties"]["prompt"] = {"anyOf": [{"type": "string"}, ids, prompts, {"type": "null"}]}
    segmented = {"required": ["segments"], "properties": {"segments": {"type": "array", "minItems": 1}}}
    some_text = {"contains": {"required": ["text"], "properties": {"text": {"minLength": 1}}}}  # a non-empty prompt
    no_echo = {"not": {"required": ["echo"], "properties": {"echo": {"const": True}}}}
    schema["allOf"] = [
        {
            "if": segmented,
            "then": {"properties": {"prompt": {"anyOf": [{"type": "null"}, {"const": ""}]}, "segments": some_text}},
            "else": {
                "required": ["prompt"],
                "properties": {"prompt": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array"}]}},
            },
        },
        {"if": no_echo, "then": {"properties": {"max_tokens": {"anyOf": [{"type": "null"}, {"minimum": 1}]}}}},
    ]


def _serve(schema: dict[str, Any], models: dict[str, ModelInfo]) -> None:
    """A request schema with what the served models allow: `model` one of their names, token ids
    below the smallest vocabulary, new tokens at most the smallest limit."""
    properties = schema.get("properties", {})
    for string in schema_nodes(properties.get("model", {})):
        if string.get("type") == "string":
            string["enum"] = sorted(models)
    vocabulary = min(info.vocab_size for info in models.values())
    for node in schema_nodes(properties):
        if node.get("description") == types.TOKEN_ID:
            node["maximum"] = vocabulary - 1
    for node in schema_nodes(properties.get("logit_bias", {})):
        if node.get("description") == types.BIAS_KEY:
            node["pattern"] = f"^{integers(0, vocabulary - 1)}$"
    policies = _policies(models)
    for node in schema_nodes(properties.get("cache_policy", {})):
        if node.get("type") == "string":
            node["pattern"] = policies
    limit = min(info.max_new_tokens_limit for info in models.values())
    for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
        for node in schema_nodes(properties.get(field, {})):
            if node.get("type") == "integer":
                node["maximum"] = limit


def _policies(models: dict[str, ModelInfo]) -> str:
    """A pattern of the cache policies every served model takes (empty: the default), each number
    within what the shortest sequence limit leaves for sinks and window together."""
    forms = set.intersection(*(set(info.cache_policies) for info in models.values()))
    most = min(info.max_positions or info.max_sequence_tokens for info in models.values()) // 2
    number = f"0*{integers(1, most)}"
    written = sorted(re.escape(form).replace("W", number).replace("S", number) for form in forms)
    return f"^({'|'.join(written)})?$"


def integers(low: int, high: int) -> str:
    """A regular expression of the decimal integers in [low, high], low 0 or 1, without leading zeros."""
    top = str(high)
    shorter = [f"[{low}-9]" if len(top) > 1 else f"[{low}-{top}]"]
    shorter += [f"[1-9][0-9]{{{digits - 1}}}" for digits in range(2, len(top))]
    same = [top] if len(top) > 1 else []
    for index in range(len(top) if len(top) > 1 else 0):
        first = 1 if index == 0 else 0
        if int(top[index]) > first:
            rest = f"[0-9]{{{len(top) - index - 1}}}" if index < len(top) - 1 else ""
            same.append(f"{top[:index]}[{first}-{int(top[index]) - 1}]{rest}")
    return f"({'|'.join(shorter + same)})"


def schema_nodes(schema: Any) -> list[dict[str, Any]]:
    """Every schema object inside `schema` (itself included)."""
    if isinstance(schema, list):
        return [node for item in schema for node in schema_nodes(item)]
    if not isinstance(schema, dict):
        return []
    return [schema, *(node for value in schema.values() for node in schema_nodes(value))]


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


def document(models: dict[str, ModelInfo] | None = None, secured: bool = True) -> bytes:
    return msgspec.json.encode(openapi(models, secured))
