"""Every sampling and limit field of a generation request, checked in one function (`check_fields`)
on the typed request both front ends build (GenerateInput), as vLLM's input processor validates a
request once. EngineClient.submit calls it for gRPC and HTTP alike, before any work (an echo's
prompt scoring included); the front ends only translate their wire shapes, and the HTTP layer
renames the engine's field names to OpenAI's in the message (`max_new_tokens` is `max_tokens`).

What only the model's engine can check stays there (service.engine.processing.input_processor):
the cache policy against the export, and the prompt's length once tokenized. A field added to
GenerateInput gets its check here, its translation in service/servicer.py and
service/openai_api/protocol.py, and nothing else (docs/engine.md, "A request field").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from service.engine.messages import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PRIORITY,
    MAX_SEGMENTS,
    MAX_SPECULATIVE_TOKENS,
    MAX_STOP_CHARACTERS,
    MAX_STOP_STRINGS,
    MIN_PRIORITY,
    ErrorKind,
    GenerateInput,
    ModelInfo,
    RequestError,
)

UINT32_MAX = 2**32 - 1  # gRPC's segment_repair_tokens
UINT64_MAX = 2**64 - 1  # gRPC's seed


@dataclass(frozen=True)
class FieldLimits:
    """What the checks read of one served model."""

    model: str
    max_new_tokens_limit: int
    default_max_new_tokens: int
    vocab_size: int

    @classmethod
    def of(cls, info: ModelInfo) -> FieldLimits:
        return cls(info.name, info.max_new_tokens_limit, info.default_max_new_tokens, info.vocab_size)


def refuse(field: str, message: str) -> RequestError:
    """INVALID_ARGUMENT, the message opening with the field's name."""
    return RequestError(ErrorKind.INVALID_ARGUMENT, f"{field}: {message}")


def check_fields(raw: GenerateInput, limits: FieldLimits) -> None:
    """Each field in its range, or a RequestError naming the field and the limit (the first found)."""
    check_prompt(raw, limits)
    check_lengths(raw, limits)
    check_sampling(raw)
    check_logprobs(raw.logprobs, "logprobs")
    check_logprobs(raw.prompt_logprobs, "prompt_logprobs")
    check_stop(raw.stop)
    check_logit_bias(raw.logit_bias, limits)
    if raw.speculative_tokens is not None and not 0 <= raw.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise refuse("speculative_tokens", f"must be in [0, {MAX_SPECULATIVE_TOKENS}], got {raw.speculative_tokens}")
    if not MIN_PRIORITY <= raw.priority <= MAX_PRIORITY:
        raise refuse("priority", f"must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {raw.priority}")


def check_prompt(raw: GenerateInput, limits: FieldLimits) -> None:
    """Text or token ids (each in the vocabulary), not both; its segments bounded."""
    if raw.prompt and raw.prompt_ids:
        raise refuse("prompt", "set either text or token ids, not both")
    if not raw.prompt and not raw.prompt_ids:
        raise refuse("prompt", "must not be empty")
    check_token_ids(raw.prompt_ids, limits.vocab_size, limits.model)
    if len(raw.segments) > MAX_SEGMENTS:
        raise refuse("segments", f"at most {MAX_SEGMENTS} in one prompt, got {len(raw.segments)}")
    if not 0 <= raw.segment_repair_tokens <= UINT32_MAX:
        raise refuse("segment_repair_tokens", f"must be in [0, {UINT32_MAX}], got {raw.segment_repair_tokens}")


def check_lengths(raw: GenerateInput, limits: FieldLimits) -> None:
    """max_new_tokens in range (0 only where the prompt's log-probabilities are all that is asked;
    unset, the server's default), min_tokens within the same limit: past max_new_tokens it means only
    that EOS never ends the request (a relation of two fields, which the HTTP API's description could
    not state, so a request it calls valid would be refused)."""
    limit = limits.max_new_tokens_limit
    new_tokens = limits.default_max_new_tokens if raw.max_new_tokens is None else raw.max_new_tokens
    lowest = 0 if raw.prompt_logprobs is not None else 1
    if not lowest <= new_tokens <= limit:
        alone = "" if lowest == 0 else " (0 only with prompt_logprobs: the prompt's log-probabilities alone)"
        raise refuse("max_new_tokens", f"must be in [{lowest}, {limit}]{alone}, got {new_tokens}")
    if not 0 <= raw.min_tokens <= limit:
        raise refuse("min_tokens", f"must be in [0, {limit}], got {raw.min_tokens}")


def check_sampling(raw: GenerateInput) -> None:
    if not (raw.temperature >= 0.0 and math.isfinite(raw.temperature)):
        raise refuse("temperature", f"must be >= 0, got {raw.temperature}")
    if raw.top_p is not None and not 0.0 < raw.top_p <= 1.0:
        raise refuse("top_p", f"must be in (0, 1], got {raw.top_p}")
    if raw.top_k < 0:
        raise refuse("top_k", f"must be >= 0, got {raw.top_k}")
    if not 0 <= raw.seed <= UINT64_MAX:
        raise refuse("seed", f"must be in [0, {UINT64_MAX}], got {raw.seed}")


def check_logprobs(value: int | None, field: str) -> None:
    """Alternatives per token (None: no log-probabilities)."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise refuse(field, f"must be in [0, {MAX_LOGPROBS}], got {value}")


def check_token_ids(ids: tuple[int, ...] | list[int], vocab: int, model: str, field: str = "prompt") -> None:
    for index, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise refuse(f"{field}[{index}]", _outside(token, vocab, model))


def _outside(token: int, vocab: int, model: str) -> str:
    return f"token id {token} is outside the vocabulary [0, {vocab}) of model {model!r}"


def check_stop(stop: tuple[str, ...]) -> None:
    """Stop strings are looked for after every token: their count and length are bounded."""
    if len(stop) > MAX_STOP_STRINGS:
        raise refuse("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for index, text in enumerate(stop):
        if len(text) > MAX_STOP_CHARACTERS:
            limit = f"each string at most {MAX_STOP_CHARACTERS} characters"
            raise refuse("stop", f"{limit}, string {index} has {len(text)}")


def check_logit_bias(pairs: tuple[tuple[int, float], ...], limits: FieldLimits) -> None:
    """(token id, bias) pairs: each id in the vocabulary once, each bias in range."""
    vocab, seen = limits.vocab_size, set()
    for token, bias in pairs:
        if not 0 <= token < vocab:
            raise refuse("logit_bias", _outside(token, vocab, limits.model))
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
            bounds = f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            raise refuse("logit_bias", f"the bias of token {token} must be in {bounds}, got {bias}")
        if token in seen:
            raise refuse("logit_bias", f"token id {token} is given twice")
        seen.add(token)
