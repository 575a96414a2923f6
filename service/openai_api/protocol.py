"""OpenAI's request and response shapes <-> the engine's GenerateInput, with no web framework.

Requests are translated here, not checked: a body's shape and types are read (a 400 names the
field), and every sampling and limit field is checked once, for gRPC and HTTP alike, where the
engine client takes the request (service.engine.processing.fields); its RequestError comes back
with the engine's field names turned into this API's (`Generation.names`: `max_new_tokens` is
`max_tokens`).

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

import dataclasses
import functools
import re
import secrets
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgspec

from service.engine.messages import (
    ErrorKind,
    GenerateInput,
    ModelInfo,
    PromptSegment,
    RequestError,
    RequestStatus,
)
from service.openai_api.types import MAX_PROMPTS
from service.security import cache_salt

T = TypeVar("T")

FINISH_REASONS = {
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_STOP: "stop",
    RequestStatus.FINISHED_EOS: "stop",
}
CHAT_ROLES = ("system", "user", "assistant", "developer")
# Fields OpenAI defines that these models cannot honour: accepted only at their neutral value.
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "best_of": 1}
SEGMENT_FIELDS = ("text", "reusable")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_BIASED_TOKENS = 1024  # logit_bias entries (more than any vocabulary served here: the engine checks ids)
TOKEN_KEY = re.compile(r"0|[1-9][0-9]{0,9}")  # no leading zeros: "065" and "65" would name one token twice
PARAM = re.compile(r"[A-Za-z_]\w*(\[[0-9]+\])*")  # a field an error names: `max_tokens`, `prompt[3]`
# The engine's field names as /v1/completions spells them (chat: its own, Generation.names).
API_NAMES = {"max_new_tokens": "max_tokens", "prompt_logprobs": "echo"}
_encode = msgspec.json.Encoder().encode


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
        405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
        503: "server_error",
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
    def of(cls, error: RequestError, names: dict[str, str] | None = None) -> ApiError:
        """The engine's refusal, its field names as this API spells them (`names`: engine's -> API's)."""
        message = error.message
        for engine_name, api_name in (names or API_NAMES).items():
            message = re.sub(rf"\b{engine_name}\b", api_name, message)
        head = message.partition(":")[0].split(" ", 1)[0]  # "prompt + max_tokens: ..." names the prompt
        param = head if PARAM.fullmatch(head) else None
        if error.kind is ErrorKind.INVALID_ARGUMENT:
            return cls(400, message, param)
        if error.kind is ErrorKind.NOT_FOUND:
            return cls(404, message, param, "model_not_found")
        if error.kind is ErrorKind.RESOURCE_EXHAUSTED:
            return cls(429, message, None, "rate_limit_exceeded", error.retry_after or 1.0)
        return cls(503, message, None, "service_unavailable")


def invalid(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", field)


def shown(value: Any, limit: int = 80) -> str:
    """A value as an error quotes it: its repr, cut short (a refused field may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Generation:
    """One parsed /v1/completions or /v1/chat/completions request: one engine input per prompt
    (a completion's prompt may be a list: n prompts give n choices, in index order). `logprobs`:
    alternatives per token where log-probabilities are asked (None: none); `echo`: the prompt, with
    its tokens' log-probabilities when asked, comes before the completion."""

    inputs: tuple[GenerateInput, ...]
    stream: bool
    include_usage: bool
    chat: bool
    logprobs: int | None = None
    echo: bool = False
    # The engine's field names -> this request's, for its errors (ApiError.of).
    names: dict[str, str] = dataclasses.field(default_factory=lambda: API_NAMES)

    @property
    def input(self) -> GenerateInput:
        return self.inputs[0]


def _typed(body: dict[str, Any], field: str, kind: type | tuple[type, ...], default: Any, within: str = "") -> Any:
    """`body[field]` if of `kind`, `default` if absent or null; `within`: where `body` sits (its errors' name)."""
    value = body.get(field)
    if value is None:
        return default
    name = f"{within}.{field}" if within else field
    if isinstance(value, bool) and kind is not bool and kind != (bool,):
        raise invalid(name, f"must be {_kind_name(kind)}, got {shown(value)}")
    if kind is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, kind):
        raise invalid(name, f"must be {_kind_name(kind)}, got {shown(value)}")
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:  # what the engine's messages carry
        raise invalid(name, f"must be a 64-bit integer, in [{INT64_MIN}, {INT64_MAX}], got {shown(value)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", dict: "an object"}
    return names.get(kind, str(kind)) if isinstance(kind, type) else " or ".join(names[k] for k in kind)


def conform(body: Any, kind: type, parse: Callable[[dict[str, Any]], T]) -> T:
    """`parse(body)`, then the body's shape checked against the request's type (service.openai_api.
    types, which the OpenAPI description is made from): every field of the type the description
    gives it, nested objects' fields included, with 400 naming the field. Only shapes and types: the
    limits the types state (ranges, lengths, patterns) are the description's words for checks made
    once elsewhere, with the message naming the field and the limit: by the parser for what only
    this API has (n, the penalties, a prompt list's shapes), by the engine client for every sampling
    and limit field (service.engine.processing.fields, gRPC's and HTTP's alike). JSON Schema's
    integers include 6.0: integral numbers are taken as integers. Unknown fields are ignored, as the
    description allows them."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body: must be a JSON object")
    body = _integral(body)
    parsed = parse(body)
    try:
        msgspec.convert(body, shape_of(kind), strict=True)
    except msgspec.ValidationError as error:
        message = str(error)
        where = message.rpartition(" - at `$.")[2].rstrip("`") if " - at `$." in message else None
        field = re.match(r"\w+", where or "")
        expected = message.partition(" - at ")[0]
        raise ApiError(400, f"{where or 'request body'}: {expected}", field[0] if field else None) from None
    return parsed


@functools.cache
def shape_of(kind: Any) -> Any:
    """`kind` without its constraints (msgspec's Meta: ranges, lengths, patterns): its types and
    shapes alone, Structs rebuilt field by field (conform's check)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Annotated:
        return shape_of(args[0])
    if origin is typing.Union or origin is types.UnionType:
        return typing.Union[tuple(shape_of(arg) for arg in args)]  # noqa: UP007 (built from a tuple)
    if origin in (list, dict):
        return origin[tuple(shape_of(arg) for arg in args)] if args else origin
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        config = kind.__struct_config__
        fields = [(f.name, shape_of(f.type), _default(f)) for f in msgspec.structs.fields(kind)]
        return msgspec.defstruct(
            kind.__name__, fields, kw_only=True, forbid_unknown_fields=config.forbid_unknown_fields
        )
    return kind


def _default(field: msgspec.structs.FieldInfo) -> Any:
    if field.default_factory is not msgspec.NODEFAULT:
        return msgspec.field(default_factory=field.default_factory)
    return field.default  # NODEFAULT: required


def _integral(value: Any) -> Any:
    """Floats with an integral value (6.0) as integers, anywhere in a decoded JSON value."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, dict):
        return {key: _integral(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral(item) for item in value]
    return value


def parse_generation(body: Any, models: dict[str, ModelInfo], chat: bool, tenant: str = "") -> Generation:
    """The engine's input from an OpenAI request body, or an ApiError naming the field and the limit;
    `tenant`: the caller's (its token's), which salts its prompts in the prefix cache."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body: must be a JSON object")
    model = _typed(body, "model", str, None)
    if model is None:
        raise invalid("model", "required (GET /v1/models lists the served ones)")
    if model not in models:
        served = ", ".join(sorted(models)) or "none yet"
        message = f"model: {shown(model)} is not served here; served models: {served}"
        raise ApiError(404, message, "model", "model_not_found")
    segments, repair = prompt_segments(body, chat)
    prompts: list[str | tuple[int, ...]]
    if chat:
        prompts = [chat_prompt(body.get("messages"))]
    else:
        prompts = ["".join(s.text for s in segments)] if segments else completion_prompts(body.get("prompt"))
    logprobs, echo = requested_logprobs(body, chat)
    lengths = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
    given = [field for field in lengths if body.get(field) is not None]
    if len(given) == 2:  # chat: one length, or the other's limits would go unchecked
        raise invalid("max_tokens", "set either max_tokens or max_completion_tokens, not both")
    tokens_field = given[0] if given else "max_tokens"
    max_tokens = _typed(body, tokens_field, int, None)
    names = {**API_NAMES, "max_new_tokens": tokens_field, **({"logprobs": "top_logprobs"} if chat else {})}
    n = _typed(body, "n", int, 1)
    if n != 1:
        raise invalid("n", f"only 1 is supported, got {n}")
    _check_unsupported(body, chat)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise invalid("stop", f"must be a string or a list of strings, got {shown(stop)}")
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", dict, {})
    if options and not stream:
        raise invalid("stream_options", "only allowed with stream: true")
    top_k = _typed(body, "top_k", int, 0)
    seed = _typed(body, "seed", int, None)
    try:
        salt = cache_salt(tenant, _typed(body, "cache_salt", str, ""))
    except RequestError as error:
        raise ApiError.of(error, names) from None
    raw = GenerateInput(
        model=model,
        prompt="",
        max_new_tokens=max_tokens,
        temperature=_typed(body, "temperature", float, 1.0),  # OpenAI's default, not gRPC's greedy 0
        top_k=0 if top_k == -1 else top_k,  # vLLM's -1: no filter
        top_p=_typed(body, "top_p", float, None),
        seed=secrets.randbits(63) if seed is None else seed % 2**64,  # OpenAI: no seed, no reproducibility
        stop=tuple(s for s in stop or () if s),
        cache_policy=_typed(body, "cache_policy", str, ""),
        ignore_eos=_typed(body, "ignore_eos", bool, False),
        min_tokens=_typed(body, "min_tokens", int, 0),
        segments=segments,
        segment_repair_tokens=repair,
        logprobs=logprobs,
        speculative_tokens=_typed(body, "speculative_tokens", int, None),
        logit_bias=logit_bias(body.get("logit_bias")),
        cache_salt=salt,
        tenant=tenant,
        priority=_priority(body),
        # echo with max_tokens 0 scores the prompt even when no log-probabilities are shown: its
        # length is checked like any scored text, and nothing is generated.
        prompt_logprobs=None if not echo else logprobs if logprobs is not None else 0 if max_tokens == 0 else None,
    )
    inputs = tuple(
        msgspec.structs.replace(raw, prompt=p) if isinstance(p, str) else msgspec.structs.replace(raw, prompt_ids=p)
        for p in prompts
    )
    return Generation(inputs, stream, bool(options.get("include_usage")), chat, logprobs, echo, names)


def _priority(body: dict[str, Any]) -> int:
    """vLLM's `priority`: among the tenant's own waiting requests, lower first (its range: fields.py)."""
    return _typed(body, "priority", int, 0)


def logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` (JSON keys are strings) as (id, bias) pairs; each id in the
    model's vocabulary and each bias in [-100, 100] is checked with the other fields (fields.py)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("logit_bias", f"must be an object of token id -> bias, got {shown(value)}")
    if len(value) > MAX_BIASED_TOKENS:
        raise invalid("logit_bias", f"at most {MAX_BIASED_TOKENS} tokens, got {len(value)}")
    pairs = []
    for key, bias in value.items():
        if not TOKEN_KEY.fullmatch(key):
            raise invalid(
                "logit_bias", f"keys must be token ids (decimal integers, no leading zeros), got {shown(key)}"
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise invalid("logit_bias", f"the bias of token {key} must be a number, got {shown(bias)}")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def completion_prompts(prompt: Any) -> list[str | tuple[int, ...]]:
    """A completion's prompts as OpenAI takes them: a string, a list of strings, a list of token ids,
    or a list of such lists; token ids are taken as they are (no BOS added: the client tokenized)."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        shapes = "a string, a list of strings, a token-id list or a list of those"
        raise invalid("prompt", f"required: {shapes}; got {shown(prompt)}")
    if len(prompt) > MAX_PROMPTS and not all(_is_token(t) for t in prompt):
        raise invalid("prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
    if all(_is_token(t) for t in prompt):
        return [tuple(prompt)]
    prompts: list[str | tuple[int, ...]] = []
    for index, item in enumerate(prompt):
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            prompts.append(tuple(item))
        else:
            raise invalid(f"prompt[{index}]", f"must be a string or a non-empty list of token ids, got {shown(item)}")
    return prompts


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def requested_logprobs(body: dict[str, Any], chat: bool) -> tuple[int | None, bool]:
    """(alternatives per token, or None for no log-probabilities; echo). Completions: `logprobs` an
    integer in [0, 20] and `echo`; chat: `logprobs` a boolean and `top_logprobs` in [0, 20] with it."""
    if chat:
        if body.get("echo") not in (None, False):
            raise invalid("echo", "only on /v1/completions")
        wanted = _typed(body, "logprobs", bool, False)
        top = _typed(body, "top_logprobs", int, None)
        if top is not None and not wanted:
            raise invalid("top_logprobs", "needs logprobs: true")
        return (top or 0) if wanted else None, False
    if body.get("top_logprobs") is not None:
        raise invalid("top_logprobs", "only on /v1/chat/completions (completions take logprobs: N)")
    logprobs = _typed(body, "logprobs", int, None)
    return logprobs, _typed(body, "echo", bool, False)


def prompt_segments(body: dict[str, Any], chat: bool) -> tuple[tuple[PromptSegment, ...], int]:
    """The extras `segments` and `segment_repair_tokens` (module docstring), checked as gRPC checks
    them: segments instead of a prompt, never both; an empty list is no segments."""
    for field in ("segments", "segment_repair_tokens") if chat else ():
        if body.get(field) is not None:
            raise invalid(field, "only on /v1/completions (send the prompt there as segments)")
    raw, repair = body.get("segments"), _typed(body, "segment_repair_tokens", int, 0)
    if raw is None:
        return (), repair
    if not isinstance(raw, list):
        raise invalid("segments", f"must be a list of {{text, reusable}} objects, got {shown(raw)}")
    if raw and body.get("prompt") not in (None, ""):
        raise invalid("segments", "set either prompt or segments, not both")
    segments = []
    for index, segment in enumerate(raw):
        field = f"segments[{index}]"
        if not isinstance(segment, dict) or not set(segment) <= set(SEGMENT_FIELDS):
            fields = ", ".join(SEGMENT_FIELDS)
            raise invalid(field, f"must be an object with only the fields {fields}, got {shown(segment)}")
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
            if not content or not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise invalid(f"messages[{index}].content", "a non-empty list of text parts (only text is supported)")
            if not all(isinstance(p.get("text"), str) and p["text"] for p in content):
                raise invalid(f"messages[{index}].content", "each text part needs a non-empty `text` string")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise invalid(f"messages[{index}].content", f"must be a string, got {shown(content)}")
        if not content:  # as the description says: an empty message would make an empty prompt alone
            raise invalid(f"messages[{index}].content", "must not be empty")
        texts.append(content)
    return "\n".join(texts)


def _check_unsupported(body: dict[str, Any], chat: bool) -> None:
    for field, neutral in NEUTRAL.items():
        if body.get(field) not in (None, neutral):
            raise invalid(field, f"not supported: only {neutral!r}, got {shown(body[field])}")
    if body.get("suffix"):
        raise invalid("suffix", "not supported (no fill-in-the-middle)")
