"""One /v1/completions stream as the load generators here send and time it: the request body, the
server-sent events measured as `loadtest.streaming` measures a GenerateStream call (whatever reads
the lines: Locust's gevent client, aiohttp, httpx), and the API's base URL."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from loadtest.streaming import StreamTiming

DEFAULT_HTTP_PORT = 8000  # the server's --http-port default


@dataclass
class SseTimer:
    """Feed it the stream's lines as they arrive; `timing` holds what `timed_stream` would report.

    Time to first token is taken at the first event that carries text or a finish reason (a chat
    stream's opening role-only chunk carries neither). Later events with text extend the decode
    time and count their bytes as tokens (the tokenizer is byte-level), as for gRPC chunks.
    """

    started: float
    timing: StreamTiming = field(default_factory=StreamTiming)
    error: str | None = None  # an error event the server sent inside the stream
    done: bool = False  # `data: [DONE]` arrived
    _first: float = 0.0

    def line(self, raw: bytes | str, now: float) -> None:
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
        if not text.startswith("data:"):
            return
        payload = text[len("data:") :].strip()
        if payload == "[DONE]":
            self.done = True
            return
        event: dict[str, Any] = json.loads(payload)
        if "error" in event:
            self.error = str(event["error"].get("message", event["error"]))
            return
        if event.get("usage"):
            self.timing.completion_tokens = int(event["usage"]["completion_tokens"])
        for choice in event.get("choices") or ():
            self._chunk(choice, now)

    def _chunk(self, choice: dict[str, Any], now: float) -> None:
        delta = choice.get("delta")
        content = (delta.get("content") if isinstance(delta, dict) else choice.get("text")) or ""
        size = len(content.encode("utf-8"))
        if self.timing.time_to_first_token is None:
            if not size and not choice.get("finish_reason"):
                return
            self.timing.time_to_first_token = now - self.started
            self._first = now
        elif size:
            self.timing.decode_seconds = now - self._first
            self.timing.decoded_tokens += size
        self.timing.received_bytes += size

    def finish(self, now: float) -> StreamTiming:
        self.timing.seconds = now - self.started
        return self.timing


def completion_body(
    model: str, prompt: str, max_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
    seed: int | None = None, ignore_eos: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """A streaming /v1/completions request as every load generator here sends it (usage in the last chunk)."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos,
    }  # fmt: skip
    if seed is not None:
        body["seed"] = seed
    return body


def http_base_url(options: Any, host: str | None) -> str:
    """The HTTP API's base URL from Locust's options: --http-host, else --host when it is a URL,
    else the default HTTP port on --host's machine."""
    if options is not None and options.http_host:
        return str(options.http_host).rstrip("/")
    host = host or "localhost"
    if host.startswith(("http://", "https://")):
        return host.rstrip("/")
    return f"http://{host.rpartition(':')[0] or host}:{DEFAULT_HTTP_PORT}"
