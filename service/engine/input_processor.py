"""Input processing: defaults, validation and tokenization, in one place for every RPC.

Generate, GenerateStream and Score all pass through here (as vLLM v1's input processor), so a
default or a limit is written once and every error names the field and the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from contract.manifest import Manifest
from service.engine.errors import ErrorKind, RequestError
from service.engine.request import SamplingParams


@dataclass(frozen=True)
class InputLimits:
    max_new_tokens_limit: int
    default_max_new_tokens: int
    max_sequence_tokens: int  # prompt (with BOS) + new tokens, for this model on this server


@dataclass(frozen=True)
class GenerateInput:
    """A generation request as the caller gave it: None means "not set, use the default"."""

    model: str
    prompt: str
    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float | None = None
    seed: int = 0
    stop: tuple[str, ...] = ()
    deadline: float | None = None  # time.monotonic() seconds


class InputProcessor:
    """Turns one model's raw inputs into token ids and sampling parameters, or a RequestError."""

    def __init__(self, manifest: Manifest, limits: InputLimits) -> None:
        self.manifest, self.limits = manifest, limits
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

    def generate(self, raw: GenerateInput) -> tuple[list[int], SamplingParams]:
        if not raw.prompt:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, "prompt: must not be empty")
        params = SamplingParams(
            max_new_tokens=self.limits.default_max_new_tokens if raw.max_new_tokens is None else raw.max_new_tokens,
            temperature=raw.temperature,
            top_k=raw.top_k,
            top_p=1.0 if raw.top_p is None else raw.top_p,
            seed=raw.seed,
            stop=raw.stop,
        )
        self.check(params)
        ids = self.tokenize(raw.prompt)
        total = len(ids) + params.max_new_tokens
        if total > self.limits.max_sequence_tokens:
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT,
                f"prompt + max_new_tokens: {len(ids)} prompt tokens + {params.max_new_tokens} new tokens "
                f"= {total} exceeds {self._limit_name()}",
            )
        return ids, params

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

    def score(self, text: str) -> list[int]:
        """Token ids of a text to score; its positions must fit like a generation's."""
        if not text:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, "text: must not be empty")
        ids = self.tokenize(text)
        limit = self.manifest.max_positions or self.limits.max_sequence_tokens
        if len(ids) - 1 > limit:
            what = "max_positions" if self.manifest.max_positions else "max_sequence_tokens"
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT,
                f"text: {len(ids) - 1} tokens to score exceed {what}={limit} of model {self.manifest.name!r}",
            )
        return ids
