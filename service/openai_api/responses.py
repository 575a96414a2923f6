"""The OpenAI-compatible API's response bodies: usage, choices, whole and streamed shapes, the
model list (what the requests parsed in protocol.py are answered with)."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from service.engine.messages import ModelInfo, RequestStatus, TokenLogprob
from service.logprobs import token_bytes, token_string
from service.openai_api.protocol import FINISH_REASONS, Generation

_encode = msgspec.json.Encoder().encode


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


@dataclass
class Choice:
    """One prompt's answer as a response shows it: the text after what was already sent, how it
    ended, and the log-probabilities of the tokens that made it (`logprobs`: (token id, its entry or
    None for a prompt's first token)); an echo's text and tokens come first."""

    text: str
    status: RequestStatus | None = None
    logprobs: list[tuple[int, TokenLogprob | None]] | None = None


class Shapes:
    """One response's objects: the whole answer, or its stream's chunks as SSE lines (`data: ...`)."""

    def __init__(self, generation: Generation, info: ModelInfo | None = None) -> None:
        self.chat = generation.chat
        self.info = info
        self.top = generation.logprobs
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
        self._offsets: dict[int, int] = {}  # completions' text_offset so far, by choice

    def whole(self, choices: list[Choice], usage: Usage) -> bytes:
        bodies = []
        for index, choice in enumerate(choices):
            assert choice.status is not None
            if self.chat:
                body: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": choice.text}}
            else:
                body = {"index": index, "text": choice.text}
            body.update(logprobs=self._logprobs(index, choice), finish_reason=FINISH_REASONS[choice.status])
            bodies.append(body)
        obj = "chat.completion" if self.chat else "text_completion"
        return _encode({**self._head, "object": obj, "choices": bodies, "usage": usage.body()})

    def first(self) -> bytes:
        """Chat streams open with the assistant's role (as OpenAI's do); completions need nothing."""
        if not self.chat:
            return b""
        delta = {"role": "assistant", "content": ""}
        return self._event({**self._head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                        "finish_reason": None}]})  # fmt: skip

    def chunk(self, text: str) -> bytes:
        """The common chunk (one prompt, no log-probabilities): preformatted around the text."""
        return self._prefix + _encode(text) + self._suffix

    def choice_chunk(self, index: int, choice: Choice) -> bytes:
        """A chunk of choice `index`, finishing it when `choice.status` is set."""
        body: dict[str, Any] = {"index": index}
        if self.chat:
            body["delta"] = {"content": choice.text} if choice.text or choice.status is None else {}
        else:
            body["text"] = choice.text
        reason = None if choice.status is None else FINISH_REASONS[choice.status]
        body.update(logprobs=self._logprobs(index, choice), finish_reason=reason)
        return self._event({**self._head, "choices": [body]})

    def last(self, text: str, status: RequestStatus) -> bytes:
        """The finishing chunk (with any text still held back, e.g. a stop-string prefix)."""
        return self.choice_chunk(0, Choice(text, status))

    def usage_chunk(self, usage: Usage) -> bytes:
        """stream_options.include_usage: one more chunk, no choices, the usage (as OpenAI sends it)."""
        return self._event({**self._head, "choices": [], "usage": usage.body()})

    def _logprobs(self, index: int, choice: Choice) -> dict[str, Any] | None:
        if choice.logprobs is None or self.top is None:
            return None
        info = self.info
        assert info is not None
        if self.chat:
            return {"content": [self._chat_token(token, entry, info) for token, entry in choice.logprobs if entry]}
        offset = self._offsets.get(index, 0)
        tokens, values, tops, offsets = [], [], [], []
        for token, entry in choice.logprobs:
            tokens.append(token_string(token, info))
            offsets.append(offset)
            offset += _characters(token)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(entry.logprob)
            top = {token_string(i, info): v for i, v in zip(entry.top_ids, entry.top_logprobs, strict=True)}
            top.setdefault(token_string(token, info), entry.logprob)  # vLLM's: the chosen token is always listed
            tops.append(top)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _chat_token(token: int, entry: TokenLogprob, info: ModelInfo) -> dict[str, Any]:
        top = [
            {"token": token_string(i, info), "logprob": v, "bytes": token_bytes(i)}
            for i, v in zip(entry.top_ids, entry.top_logprobs, strict=True)
        ]
        return {"token": token_string(token, info), "logprob": entry.logprob, "bytes": token_bytes(token),
                "top_logprobs": top}  # fmt: skip

    @staticmethod
    def _event(obj: dict[str, Any]) -> bytes:
        return b"data: " + _encode(obj) + b"\n\n"


def _characters(token: int) -> int:
    """Characters a token adds to the text: a byte that starts a UTF-8 character one, a continuation
    byte or a special none (text_offset counts characters of the text, as Python and JavaScript index it)."""
    return 1 if token < 0x80 or 0xC0 <= token < 0x100 else 0


DONE = b"data: [DONE]\n\n"


def models_list(models: dict[str, ModelInfo], created: int) -> bytes:
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "posenc-serve",
         "max_model_len": info.max_positions or info.max_sequence_tokens, "segment_reuse": info.segment_reuse,
         "random_weights": info.random_weights}
        for name, info in sorted(models.items())
    ]  # fmt: skip
    return _encode({"object": "list", "data": data})
