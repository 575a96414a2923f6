"""Input processing: defaults, validation and tokenization, in one place for every RPC.

Generate, GenerateStream and Score all pass through here (as vLLM v1's input processor), so a
default or a limit is written once and every error names the field and the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from contract.cache_policy import FIELD as POLICY_FIELD
from contract.cache_policy import FULL_POLICY, CachePolicy, CachePolicyError, parse_cache_policy
from contract.manifest import Manifest
from service.engine.messages import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_SEGMENTS,
    MAX_SPECULATIVE_TOKENS,
    MAX_STOP_CHARACTERS,
    MAX_STOP_STRINGS,
    ErrorKind,
    GenerateInput,
    PromptSegment,
    RequestError,
)
from service.engine.request import Request, SamplingParams


@dataclass(frozen=True)
class InputLimits:
    max_new_tokens_limit: int
    default_max_new_tokens: int
    max_sequence_tokens: int  # prompt (with BOS) + new tokens, for this model on this server
    default_speculative_tokens: int = 0  # guesses per step of a request that names none (--speculative-tokens)


class InputProcessor:
    """Turns one model's raw inputs into token ids and sampling parameters, or a RequestError."""

    def __init__(self, manifest: Manifest, limits: InputLimits, default_policy: CachePolicy = FULL_POLICY) -> None:
        self.manifest, self.limits = manifest, limits
        self.default_policy = default_policy
        tokenizer = manifest.tokenizer
        self.bos_token_id = int(tokenizer["bos_token_id"])  # type: ignore[call-overload]
        self.eos_token_id = int(tokenizer["eos_token_id"])  # type: ignore[call-overload]
        self.add_bos = bool(tokenizer.get("add_bos", True))

    def tokenize(self, text: str) -> list[int]:
        data = list(text.encode("utf-8"))
        return [self.bos_token_id, *data] if self.add_bos else data

    def _limit_name(self) -> str:
        if self.manifest.max_positions:
            return f"max_positions={self.manifest.max_positions} of model {self.manifest.name!r}"
        return f"max_sequence_tokens={self.limits.max_sequence_tokens} of this server"

    def cache_policy(self, text: str) -> CachePolicy:
        """The request's policy (its default when empty), or INVALID_ARGUMENT naming the field."""
        if not text.strip():
            return self.default_policy
        try:
            policy = parse_cache_policy(text, self.limits.max_sequence_tokens)
        except CachePolicyError as error:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, str(error)) from None
        if (missing := policy.missing(self.manifest)) is not None:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"{POLICY_FIELD}: model {self.manifest.name!r} {missing}")
        return policy

    def token_ids(self, ids: tuple[int, ...] | list[int], field: str = "prompt") -> list[int]:
        """A prompt given as token ids, taken as they are (no BOS added), each checked against the vocabulary."""
        vocab = self.manifest.vocab_size
        for index, token in enumerate(ids):
            if not 0 <= token < vocab:
                raise RequestError(
                    ErrorKind.INVALID_ARGUMENT,
                    f"{field}[{index}]: token id {token} is outside the vocabulary [0, {vocab}) of model "
                    f"{self.manifest.name!r}",
                )
        return list(ids)

    def logit_bias(self, pairs: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        """The request's (token id, bias) pairs, each id in the vocabulary once, each bias in range."""
        vocab, seen = self.manifest.vocab_size, set()
        for token, bias in pairs:
            if not 0 <= token < vocab:
                raise RequestError(
                    ErrorKind.INVALID_ARGUMENT,
                    f"logit_bias: token id {token} is outside the vocabulary [0, {vocab}) of model "
                    f"{self.manifest.name!r}",
                )
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
                raise RequestError(
                    ErrorKind.INVALID_ARGUMENT,
                    f"logit_bias: the bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias}",
                )
            if token in seen:
                raise RequestError(ErrorKind.INVALID_ARGUMENT, f"logit_bias: token id {token} is given twice")
            seen.add(token)
        return tuple((int(token), float(bias)) for token, bias in pairs)

    @staticmethod
    def check_logprobs(value: int | None, field: str) -> None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"{field}: must be in [0, {MAX_LOGPROBS}], got {value}")

    def request(self, raw: GenerateInput, request_id: str) -> Request:
        """The engine's Request of a generation input, built here alone: for a new request
        (Engine.submit) and for one resumed on a new core (CommandLoop.resume) alike, so a resumed
        request is the request it was (its reusable segments included)."""
        ids, params, policy = self.generate(raw)
        request = Request(request_id, raw.model, ids, params, self.eos_token_id, raw.deadline, policy)
        request.segments = segment_spans(raw.segments, self.add_bos)
        request.segment_repair_tokens = raw.segment_repair_tokens
        request.cache_salt = raw.cache_salt  # resumed too: it never reads another tenant's blocks
        request.tenant, request.priority = raw.tenant, raw.priority
        return request

    def generate(self, raw: GenerateInput) -> tuple[list[int], SamplingParams, CachePolicy]:
        if raw.prompt and raw.prompt_ids:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, "prompt: set either text or token ids, not both")
        if not raw.prompt and not raw.prompt_ids:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, "prompt: must not be empty")
        self.check_logprobs(raw.logprobs, "logprobs")
        self.check_logprobs(raw.prompt_logprobs, "prompt_logprobs")
        check_stop(raw.stop)
        if len(raw.segments) > MAX_SEGMENTS:
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT, f"segments: at most {MAX_SEGMENTS} in one prompt, got {len(raw.segments)}"
            )
        params = SamplingParams(
            max_new_tokens=self.limits.default_max_new_tokens if raw.max_new_tokens is None else raw.max_new_tokens,
            temperature=raw.temperature,
            top_k=raw.top_k,
            top_p=1.0 if raw.top_p is None else raw.top_p,
            seed=raw.seed,
            stop=raw.stop,
            ignore_eos=raw.ignore_eos,
            min_tokens=raw.min_tokens,
            logprobs=raw.logprobs,
            speculative_tokens=(
                self.limits.default_speculative_tokens if raw.speculative_tokens is None else raw.speculative_tokens
            ),
            logit_bias=self.logit_bias(raw.logit_bias),
        )
        self.check(params)
        policy = self.cache_policy(raw.cache_policy)
        ids = self.token_ids(raw.prompt_ids) if raw.prompt_ids else self.tokenize(raw.prompt)
        self.check_length(len(ids), params.max_new_tokens, policy)
        return ids, params, policy

    def check_length(self, prompt_tokens: int, new_tokens: int, policy: CachePolicy) -> None:
        """The tokens the policy keeps of prompt + new tokens must fit the sequence limit (under `full`
        all of them). A bounded policy holds at most its budget, so only a bounded position table
        limits its sequence (absolute positions keep counting: under `full` the same limit, as the
        sequence limit is max_positions where there is one); the prompt must fit the sequence limit."""
        total = prompt_tokens + new_tokens
        if policy.cached(total) > self.limits.max_sequence_tokens:
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT,
                f"prompt + max_new_tokens: {prompt_tokens} prompt tokens + {new_tokens} new tokens "
                f"= {total} exceeds {self._limit_name()}",
            )
        positions = self.manifest.max_positions
        if positions and total > positions:
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT,
                f"{POLICY_FIELD}: {policy} bounds the cache, not the positions: model {self.manifest.name!r} keeps "
                f"each token's absolute position, which ends at max_positions={positions}; {prompt_tokens} prompt "
                f"tokens + {new_tokens} new tokens = {total} exceeds it",
            )
        if prompt_tokens > self.limits.max_sequence_tokens:
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT,
                f"prompt: {prompt_tokens} tokens exceed max_sequence_tokens={self.limits.max_sequence_tokens} "
                "of this server",
            )

    def check(self, params: SamplingParams) -> None:
        limit = self.limits.max_new_tokens_limit
        if not 0 < params.max_new_tokens <= limit:
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT, f"max_new_tokens: must be in [1, {limit}], got {params.max_new_tokens}"
            )
        if not (params.temperature >= 0.0 and math.isfinite(params.temperature)):
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"temperature: must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"top_p: must be in (0, 1], got {params.top_p}")
        if params.top_k < 0:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"top_k: must be >= 0, got {params.top_k}")
        if not 0 <= params.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT,
                f"speculative_tokens: must be in [0, {MAX_SPECULATIVE_TOKENS}], got {params.speculative_tokens}",
            )
        if not 0 <= params.min_tokens <= params.max_new_tokens:
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT,
                f"min_tokens: must be in [0, max_new_tokens={params.max_new_tokens}], got {params.min_tokens}",
            )

    def score(
        self, text: str, cache_policy: str = "", token_ids: list[int] | None = None, top: int = 0, field: str = "text"
    ) -> tuple[list[int], CachePolicy]:
        """Token ids of a text to score (or the ids given) and the policy it streams through; its
        positions must fit like a generation's. `field`: the name errors give the text (echo's: prompt)."""
        if not text and not token_ids:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"{field}: must not be empty")
        self.check_logprobs(top, "prompt_logprobs" if field == "prompt" else "top")
        policy = self.cache_policy(cache_policy)
        ids = self.token_ids(token_ids, field) if token_ids else self.tokenize(text)
        scored = len(ids) - 1
        limit = self.manifest.max_positions or self.limits.max_sequence_tokens
        if scored > limit:
            what = "max_positions" if self.manifest.max_positions else "max_sequence_tokens"
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT,
                f"{field}: {scored} tokens to score exceed {what}={limit} of model {self.manifest.name!r}",
            )
        return ids, policy


def segment_spans(segments: tuple[PromptSegment, ...], add_bos: bool) -> tuple[tuple[int, int], ...]:
    """Token spans [start, end) of the reusable, non-empty segments of a byte-level prompt."""
    spans, offset = [], 1 if add_bos else 0
    for segment in segments:
        length = len(segment.text.encode("utf-8"))
        if segment.reusable and length:
            spans.append((offset, offset + length))
        offset += length
    return tuple(spans)


def check_stop(stop: tuple[str, ...]) -> None:
    """Stop strings are looked for after every token: their count and length are bounded."""
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(ErrorKind.INVALID_ARGUMENT, f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for index, text in enumerate(stop):
        if len(text) > MAX_STOP_CHARACTERS:
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT,
                f"stop: each string at most {MAX_STOP_CHARACTERS} characters, string {index} has {len(text)}",
            )
