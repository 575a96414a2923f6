"""OpenAI's request and response shapes <-> the engine's GenerateInput, with no web framework.

Requests are checked here, field by field, so every 400 names the field and the limit as the gRPC
side does; what only the engine can check (prompt length against the model) comes back as its
RequestError, with its field names turned into this API's (`max_new_tokens` is `max_tokens`).

The chat template. These are byte-level code models trained on raw source files, never on dialogue,
so there is no chat format to honour: the prompt is the messages' contents joined with one newline
("\\n"), in order, whatever their roles (system, user, assistant), and the completion continues it.
Send the code to continue as the last message's content.

Reusable segments (extra body fields of /v1/completions, as gRPC's GenerateRequest has them): the
prompt as `segments: [{"text": str, "reusable": bool}, ...]`, in order, instead of `prompt` (omit
it, or send null or ""), and `segment_repair_tokens` (leading tokens of each reused segment
recomputed in context). The usage reports `prompt_tokens_details.cached_tokens` (the prefix cache's,
exact, as OpenAI and vLLM send it) and `prompt_tokens_details.reused_tokens` (an extra: segment
tokens whose K/V was reused, not computed in context); /v1/models gives each model's
`segment_reuse` (as_is, rotate or recompute).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from service.engine.messages import ErrorKind, GenerateInput, ModelInfo, PromptSegment, RequestError, RequestStatus

FINISH_REASONS = {
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_STOP: "stop",
    RequestStatus.FINISHED_EOS: "stop",
}
CHAT_ROLES = ("system", "user", "assistant", "developer")
# Fields OpenAI defines that these models cannot honour: accepted only at their neutral value.
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "best_of": 1, "echo": False}
SEGMENT_FIELDS = ("text", "reusable")
UINT32_MAX = 2**32 - 1  # gRPC's segment_repair_tokens is a uint32
_encode = msgspec.json.Encoder().encode


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
        429: "rate_limit_error", 500: "server_error", 503: "server_error",
    }  # fmt: skip

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        retry_after: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                 "param": self.param, "code": self.code}  # fmt: skip
        return _encode({"error": error})

    @classmethod
    def of(cls, error: RequestError) -> ApiError:
        """The engine's refusal, its field names as this API spells them."""
        message = error.message.replace("max_new_tokens", "max_tokens")
        head = message.partition(":")[0].split(" ", 1)[0]  # "prompt + max_tokens: ..." names the prompt
        param = head if head.isidentifier() else None
        if error.kind is ErrorKind.INVALID_ARGUMENT:
            return cls(400, message, param)
        if error.kind is ErrorKind.NOT_FOUND:
            return cls(404, message, param, "model_not_found")
        if error.kind is ErrorKind.RESOURCE_EXHAUSTED:
            return cls(429, message, None, "rate_limit_exceeded", error.retry_after or 1.0)
        return cls(503, message, None, "service_unavailable")


def invalid(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", field)


@dataclass(frozen=True)
class Generation:
    """One parsed /v1/completions or /v1/chat/completions request."""

    input: GenerateInput
    stream: bool
    include_usage: bool
    chat: bool


def _typed(body: dict[str, Any], field: str, kind: type | tuple[type, ...], default: Any, within: str = "") -> Any:
    """`body[field]` if of `kind`, `default` if absent or null; `within`: where `body` sits (its errors' name)."""
    value = body.get(field)
    if value is None:
        return default
    name = f"{within}.{field}" if within else field
    if isinstance(value, bool) and kind is not bool and kind != (bool,):
        raise invalid(name, f"must be {_kind_name(kind)}, got {value!r}")
    if kind is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, kind):
        raise invalid(name, f"must be {_kind_name(kind)}, got {value!r}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", dict: "an object"}
    return names.get(kind, str(kind)) if isinstance(kind, type) else " or ".join(names[k] for k in kind)


def parse_generation(body: Any, models: dict[str, ModelInfo], chat: bool) -> Generation:
    """The engine's input from an OpenAI request body, or an ApiError naming the field and the limit."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body: must be a JSON object")
    model = _typed(body, "model", str, None)
    if model is None:
        raise invalid("model", "required (GET /v1/models lists the served ones)")
    if model not in models:
        served = ", ".join(sorted(models)) or "none yet"
        raise ApiError(404, f"model: {model!r} is not served here; served models: {served}", "model", "model_not_found")
    info = models[model]
    segments, repair = prompt_segments(body, chat)
    if chat:
        prompt = chat_prompt(body.get("messages"))
    else:
        prompt = "".join(s.text for s in segments) if segments else completion_prompt(body.get("prompt"))
    limit = info.max_new_tokens_limit
    max_tokens = _typed(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
                        int, None)  # fmt: skip
    if max_tokens is not None and not 1 <= max_tokens <= limit:
        raise invalid("max_tokens", f"must be in [1, {limit}], got {max_tokens}")
    min_tokens = _typed(body, "min_tokens", int, 0)
    if max_tokens is not None and not 0 <= min_tokens <= max_tokens:
        raise invalid("min_tokens", f"must be in [0, max_tokens={max_tokens}], got {min_tokens}")
    n = _typed(body, "n", int, 1)
    if n != 1:
        raise invalid("n", f"only 1 is supported, got {n}")
    _check_unsupported(body, chat)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise invalid("stop", f"must be a string or a list of strings, got {stop!r}")
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", dict, {})
    if options and not stream:
        raise invalid("stream_options", "only allowed with stream: true")
    top_k = _typed(body, "top_k", int, 0)
    seed = _typed(body, "seed", int, None)
    raw = GenerateInput(
        model=model,
        prompt=prompt,
        max_new_tokens=max_tokens,
        temperature=_typed(body, "temperature", float, 1.0),  # OpenAI's default, not gRPC's greedy 0
        top_k=0 if top_k == -1 else top_k,  # vLLM's -1: no filter
        top_p=_typed(body, "top_p", float, None),
        seed=secrets.randbits(63) if seed is None else seed % 2**64,  # OpenAI: no seed, no reproducibility
        stop=tuple(s for s in stop or () if s),
        cache_policy=_typed(body, "cache_policy", str, ""),
        ignore_eos=_typed(body, "ignore_eos", bool, False),
        min_tokens=min_tokens,
        segments=segments,
        segment_repair_tokens=repair,
    )
    return Generation(raw, stream, bool(options.get("include_usage")), chat)


def completion_prompt(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        raise invalid("prompt", "arrays (several prompts, or token ids) are not supported: send one string")
    raise invalid("prompt", f"required, a string; got {prompt!r}")


def prompt_segments(body: dict[str, Any], chat: bool) -> tuple[tuple[PromptSegment, ...], int]:
    """The extras `segments` and `segment_repair_tokens` (module docstring), checked as gRPC checks
    them: segments instead of a prompt, never both; an empty list is no segments."""
    for field in ("segments", "segment_repair_tokens") if chat else ():
        if body.get(field) is not None:
            raise invalid(field, "only on /v1/completions (send the prompt there as segments)")
    raw, repair = body.get("segments"), _typed(body, "segment_repair_tokens", int, 0)
    if not 0 <= repair <= UINT32_MAX:
        raise invalid("segment_repair_tokens", f"must be in [0, {UINT32_MAX}], got {repair}")
    if raw is None:
        return (), repair
    if not isinstance(raw, list):
        raise invalid("segments", f"must be a list of {{text, reusable}} objects, got {raw!r}")
    if raw and body.get("prompt") not in (None, ""):
        raise invalid("segments", "set either prompt or segments, not both")
    segments = []
    for index, segment in enumerate(raw):
        field = f"segments[{index}]"
        if not isinstance(segment, dict) or not set(segment) <= set(SEGMENT_FIELDS):
            raise invalid(field, f"must be an object with only the fields {', '.join(SEGMENT_FIELDS)}, got {segment!r}")
        text, reusable = _typed(segment, "text", str, "", field), _typed(segment, "reusable", bool, False, field)
        segments.append(PromptSegment(text, reusable))
    return tuple(segments), repair


def chat_prompt(messages: Any) -> str:
    """The chat template (module docstring): the contents joined with newlines, roles unmarked."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "required, a non-empty list of {role, content} objects")
    texts = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise invalid(f"messages[{index}]", f"must be an object with a role in {', '.join(CHAT_ROLES)}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise invalid(f"messages[{index}].content", "only text parts are supported")
            content = "".join(str(part.get("text", "")) for part in content)
        if not isinstance(content, str):
            raise invalid(f"messages[{index}].content", f"must be a string, got {content!r}")
        texts.append(content)
    return "\n".join(texts)


def _check_unsupported(body: dict[str, Any], chat: bool) -> None:
    logprobs = body.get("logprobs")
    if logprobs not in (None, False) and not (not chat and logprobs == 0):
        raise invalid("logprobs", "not supported by this server (the engine returns no per-token log-probabilities)")
    if body.get("top_logprobs") not in (None, 0):
        raise invalid("top_logprobs", "not supported by this server")
    for field, neutral in NEUTRAL.items():
        if body.get(field) not in (None, neutral):
            raise invalid(field, f"not supported: only {neutral!r}, got {body[field]!r}")
    if body.get("suffix"):
        raise invalid("suffix", "not supported (no fill-in-the-middle)")


# ---------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class Usage:
    """A request's token counts. `cached_tokens`: prompt tokens served from the prefix cache (their
    output is the same as without it); `reused_tokens`: tokens of reusable segments whose K/V was
    reused, not computed in this prompt's context (an approximation; gRPC's reused_prompt_tokens)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reused_tokens: int = 0

    def body(self) -> dict[str, Any]:
        details = {"cached_tokens": self.cached_tokens, "reused_tokens": self.reused_tokens}
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": total, "prompt_tokens_details": details}  # fmt: skip


class Shapes:
    """One response's objects: the whole answer, or its stream's chunks as SSE lines (`data: ...`)."""

    def __init__(self, generation: Generation) -> None:
        self.chat = generation.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = generation.input.model
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        head = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        # A chunk is this prefix, the JSON-escaped text, and the suffix: one encode per chunk.
        empty = {"delta": {"content": ""}} if self.chat else {"text": ""}
        prefix, suffix = _encode({**head, "choices": [{"index": 0, **empty}]}).split(b'""', 1)
        self._prefix = prefix
        self._suffix = suffix[:-3] + b',"logprobs":null,"finish_reason":null}]}\n\n'  # past the text's closing
        self._prefix = b"data: " + self._prefix
        self._head = head

    def whole(self, text: str, status: RequestStatus, usage: Usage) -> bytes:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=FINISH_REASONS[status])
        obj = "chat.completion" if self.chat else "text_completion"
        return _encode({**self._head, "object": obj, "choices": [choice],
                        "usage": usage.body()})  # fmt: skip

    def first(self) -> bytes:
        """Chat streams open with the assistant's role (as OpenAI's do); completions need nothing."""
        if not self.chat:
            return b""
        delta = {"role": "assistant", "content": ""}
        return self._event({**self._head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                        "finish_reason": None}]})  # fmt: skip

    def chunk(self, text: str) -> bytes:
        return self._prefix + _encode(text) + self._suffix

    def last(self, text: str, status: RequestStatus) -> bytes:
        """The finishing chunk (with any text still held back, e.g. a stop-string prefix)."""
        reason = FINISH_REASONS[status]
        choice: dict[str, Any] = {"index": 0}
        choice.update({"delta": {"content": text} if text else {}} if self.chat else {"text": text})
        choice.update(logprobs=None, finish_reason=reason)
        return self._event({**self._head, "choices": [choice]})

    def usage_chunk(self, usage: Usage) -> bytes:
        """stream_options.include_usage: one more chunk, no choices, the usage (as OpenAI sends it)."""
        return self._event({**self._head, "choices": [], "usage": usage.body()})

    @staticmethod
    def _event(obj: dict[str, Any]) -> bytes:
        return b"data: " + _encode(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def models_list(models: dict[str, ModelInfo], created: int) -> bytes:
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "posenc-serve",
         "max_model_len": info.max_positions or info.max_sequence_tokens, "segment_reuse": info.segment_reuse}
        for name, info in sorted(models.items())
    ]  # fmt: skip
    return _encode({"object": "list", "data": data})
