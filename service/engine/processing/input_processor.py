"""Input processing in the engine: defaults, tokenization and what only the model can check.

Generate, GenerateStream and Score all pass through here. A generation's fields arrive checked
(service.engine.processing.fields, where the front end hands the request over); what is left to
check needs the model: its cache policy against the export, and the prompt's length once
tokenized. Every error names the field and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.cache_policy import FIELD as POLICY_FIELD
from contract.cache_policy import FULL_POLICY, CachePolicy, CachePolicyError, parse_cache_policy
from contract.manifest import Manifest
from service.engine.messages import EngineConfig, ErrorKind, GenerateInput, PromptSegment, RequestError
from service.engine.processing.fields import check_logprobs, check_token_ids
from service.engine.request import Request, SamplingParams


@dataclass(frozen=True)
class InputLimits:
    max_new_tokens_limit: int
    default_max_new_tokens: int
    max_sequence_tokens: int  # prompt (with BOS) + new tokens, for this model on this server
    default_speculative_tokens: int = 0  # guesses per step of a request that names none (--speculative-tokens)


def default_cache_policy(manifest: Manifest, config: EngineConfig) -> str:
    """The model's default policy string: its own MODEL=POLICY entry, else a bare POLICY, else full."""
    chosen = "full"
    for entry in config.default_cache_policies:
        name, sep, policy = entry.rpartition("=")
        if not sep:
            chosen = policy
    for entry in config.default_cache_policies:
        name, sep, policy = entry.rpartition("=")
        if sep and name == manifest.folder.name:
            chosen = policy
    return chosen


class InputProcessor:
    """Turns one model's raw inputs into token ids and sampling parameters, or a RequestError."""

    def __init__(self, manifest: Manifest, limits: InputLimits, default_policy: CachePolicy = FULL_POLICY) -> None:
        self.manifest, self.limits = manifest, limits
        self.default_policy = default_policy
        tokenizer = manifest.tokenizer
        self.bos_token_id = int(tokenizer["bos_token_id"])  # type: ignore[call-overload]
        self.eos_token_id = int(tokenizer["eos_token_id"])  # type: ignore[call-overload]
        self.add_bos = bool(tokenizer.get("add_bos", True))

    @classmethod
    def of(cls, manifest: Manifest, config: EngineConfig, max_tokens: int) -> InputProcessor:
        """The model's processor on this server, its default cache policy resolved (and refused) at start-up."""
        limits = InputLimits(
            config.max_new_tokens_limit, config.default_max_new_tokens, max_tokens, config.speculative_tokens
        )
        inputs = cls(manifest, limits)
        try:
            inputs.default_policy = inputs.cache_policy(default_cache_policy(manifest, config))
        except RequestError as error:
            raise CachePolicyError(f"--default-cache-policy for model {manifest.name!r}: {error}") from None
        return inputs

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
        """A text to score given as token ids, taken as they are (no BOS added), each in the vocabulary."""
        check_token_ids(ids, self.manifest.vocab_size, self.manifest.name, field)
        return list(ids)

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
        """Token ids, sampling parameters (the server's defaults for what the request leaves unset)
        and cache policy of an input whose fields were checked already (fields.check_fields, where
        the front end hands it over): here only what needs the model (its policy, its length)."""
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
            logit_bias=tuple((int(token), float(bias)) for token, bias in raw.logit_bias),
        )
        policy = self.cache_policy(raw.cache_policy)
        ids = list(raw.prompt_ids) if raw.prompt_ids else self.tokenize(raw.prompt)
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

    def score(
        self, text: str, cache_policy: str = "", token_ids: list[int] | None = None, top: int = 0, field: str = "text"
    ) -> tuple[list[int], CachePolicy]:
        """Token ids of a text to score (or the ids given) and the policy it streams through; its
        positions must fit like a generation's. `field`: the name errors give the text (echo's: prompt)."""
        if not text and not token_ids:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"{field}: must not be empty")
        check_logprobs(top, "prompt_logprobs" if field == "prompt" else "top")
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
