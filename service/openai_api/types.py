"""The HTTP API's requests and answers as types: what GET /openapi.json describes (service.openai_api.
openapi builds it from these with msgspec's JSON Schema), and what tests hold the parser and the
answers to (tests/service/test_openapi.py: the parser reads no field these lack, and schemathesis
checks every real answer against them). Static limits are declared here (minimum, maximum, lengths)
and are the limits the server enforces, though not here: a body is held only to these types' shapes
(protocol.conform), and each limit is checked once, by the parser or, for every sampling and limit
field, by service.engine.processing.fields for gRPC and HTTP alike. The server's own flags
(--max-new-tokens-limit, the model's positions) come on top, and a request past those gets 400
naming them.
"""

from __future__ import annotations

import sys
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from service.engine.messages import (
    MAX_CACHE_SALT_CHARACTERS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PRIORITY,
    MAX_SEGMENTS,
    MAX_SPECULATIVE_TOKENS,
    MAX_STOP_CHARACTERS,
    MAX_STOP_STRINGS,
    MIN_PRIORITY,
)

MAX_PROMPTS = 64  # prompts in one /v1/completions request (each is one engine request)
TOKEN_ID = "a token id of the model's vocabulary (/v1/models)"  # the served description bounds it by the vocabulary
TokenId = Annotated[int, Meta(ge=0, le=2**32 - 1, description=TOKEN_ID)]
StopString = Annotated[str, Meta(max_length=MAX_STOP_CHARACTERS)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)]
Bias = Annotated[float, Meta(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
BIAS_KEY = "a token id, in decimal"  # the served description bounds it by the vocabulary
BiasKey = Annotated[str, Meta(pattern="^(0|[1-9][0-9]{0,9})$", description=BIAS_KEY)]
Logprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
FinishReason = Literal["stop", "length"]
Prompt = str | TokenId | list[TokenId]  # an item of a prompt list: all strings, all ids, or all id lists


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class Segment(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str = ""
    reusable: bool = False


class GenerationFields(msgspec.Struct, kw_only=True):
    """What /v1/completions and /v1/chat/completions share. OpenAI's fields this service cannot honour
    are accepted at their neutral value only (n, best_of, the penalties)."""

    model: Annotated[str, Meta(description="a model /v1/models lists")]
    max_tokens: Annotated[int, Meta(ge=0, description="at most --max-new-tokens-limit (1024)")] | None = None
    min_tokens: Annotated[int, Meta(ge=0, description="at most max_tokens")] | None = None
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(ge=sys.float_info.min, le=1, description="in (0, 1]")] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2**63 - 1, description="-1 or 0: no filter")] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1, le=1)] | None = None
    presence_penalty: Annotated[float, Meta(ge=0, le=0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=0, le=0)] | None = None
    repetition_penalty: Annotated[float, Meta(ge=1, le=1)] | None = None
    logit_bias: dict[BiasKey, Bias] | None = None
    cache_policy: Annotated[str, Meta(description="a form /v1/models lists; empty: the model's default")] | None = None
    cache_salt: Annotated[str, Meta(max_length=MAX_CACHE_SALT_CHARACTERS)] | None = None
    ignore_eos: bool | None = None
    priority: (
        Annotated[
            int,
            Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY, description="among the tenant's own requests: lower first (vLLM's)"),
        ]
        | None
    ) = None
    speculative_tokens: Annotated[int, Meta(ge=0, le=MAX_SPECULATIVE_TOKENS)] | None = None
    user: str | None = None


class CompletionRequest(GenerationFields, kw_only=True):
    """`prompt`: a string, token ids, a list of strings or a list of token-id lists (at most 64
    prompts); null or "" only with `segments`, the prompt given in pieces instead."""

    # Required without segments, null or "" with them (the description says: service.openai_api.openapi).
    prompt: str | Annotated[list[Prompt], Meta(min_length=1)] | None = None
    echo: bool | None = None
    logprobs: Logprobs | None = None
    best_of: Annotated[int, Meta(ge=1, le=1)] | None = None
    suffix: Annotated[str, Meta(max_length=0)] | None = None
    segments: Annotated[list[Segment], Meta(max_length=MAX_SEGMENTS)] | None = None
    segment_repair_tokens: Annotated[int, Meta(ge=0, le=2**32 - 1)] | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]
    text: Annotated[str, Meta(min_length=1)]


class ChatMessage(msgspec.Struct, kw_only=True):
    """`content`: not empty (its text, or its parts' text joined)."""

    role: Literal["system", "user", "assistant", "developer"]
    content: Annotated[str, Meta(min_length=1)] | Annotated[list[ContentPart], Meta(min_length=1)]


class ChatCompletionRequest(GenerationFields, kw_only=True):
    """The messages' contents joined with newlines are the prompt (docs/http-api.md, chat template)."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1, description="at most --max-new-tokens-limit (1024)")] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    prompt: str
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


# ---------------------------------------------------------------------------- answers


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int
    reused_tokens: int


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob, kw_only=True):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"]
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Model(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    segment_reuse: Literal["as_is", "rotate", "recompute"]
    random_weights: bool = False  # random from a fixed seed, not trained (python -m export --size small)


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"]
    data: list[Model]


class Tokenized(msgspec.Struct, kw_only=True):
    tokens: list[int]
    count: int
    max_model_len: int


class Detokenized(msgspec.Struct, kw_only=True):
    prompt: str


class TokenizerInfo(msgspec.Struct, kw_only=True):
    tokenizer_class: str
    vocab_size: int
    add_bos_token: bool
    bos_token: str
    eos_token: str
    pad_token: str | None
    bos_token_id: int
    eos_token_id: int
    model_max_length: int


class Health(msgspec.Struct, kw_only=True):
    status: Literal["serving", "not serving"]


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every refusal, in OpenAI's shape; `param` names the field a 400 is about."""

    error: ErrorDetail
