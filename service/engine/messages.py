"""The process boundary between the front end and the engine core: every type that crosses it, and
the framing of the two pipes that carry them.

The front end (service.engine_client, the servicer, the server) imports this module, never the
engine itself, so it loads neither onnxruntime nor the model code. Messages are typed msgspec
structs sent as MessagePack arrays (vLLM v1's EngineCoreRequest / EngineCoreOutputs are the same
idea); each frame is a 4-byte little-endian length and the message.

front end -> core (`Command`)
    Add(request id, GenerateInput, produced)  answered by Reply(request id, error or None); `produced`:
        the tokens a request resumed on a restarted core had already produced (empty when new)
    Cancel(request id)
    Score(call, model, text, policy)     answered by ScoreReply(call, error or the scores)
    MetricsQuery(call)                   answered by MetricsReply(call, exposition text)
    Stop(grace seconds)                  answered by Stopped(finished, cut)
core -> front end (`Event`)
    Ready(model infos) or Failed(message), once, when the models are loaded
    Outputs([RequestOutput ...]): what each request produced since the last one (its text, and the
        token ids that text came from, held-back bytes included); a request's last entry carries its
        status and `final` (usage and times).
"""

from __future__ import annotations

import enum
import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec
import numpy as np

# ---------------------------------------------------------------------------- what a request is


class ErrorKind(enum.Enum):
    """Why a request was refused; each front end maps it to its own status code."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"


class RequestError(Exception):
    """`retry_after`: seconds after which the same request would likely be accepted (load shedding)."""

    def __init__(self, kind: ErrorKind, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.retry_after = kind, message, retry_after


class RequestStatus(enum.IntEnum):
    """Ordered: everything from FINISHED_LENGTH on is final."""

    WAITING = 0
    RUNNING = 1
    FINISHED_LENGTH = 2
    FINISHED_STOP = 3
    FINISHED_EOS = 4
    FINISHED_CANCELLED = 5
    FINISHED_DEADLINE = 6
    FINISHED_ERROR = 7
    FINISHED_SHUTDOWN = 8  # cancelled because the server stopped before it finished

    @property
    def finished(self) -> bool:
        return self >= FIRST_FINAL


# The first final status, as a module name: `status >= FIRST_FINAL` is what `finished` says, for hot
# loops (the property looks itself up on the enum class at every call).
FIRST_FINAL = RequestStatus.FINISHED_LENGTH


class PromptSegment(msgspec.Struct, frozen=True, array_like=True):
    """A piece of a prompt given as segments; a reusable one's K/V is computed on its own and reused."""

    text: str
    reusable: bool = False


class GenerateInput(msgspec.Struct, frozen=True, array_like=True):
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
    cache_policy: str = ""  # empty: the model's default
    ignore_eos: bool = False  # never end at EOS (its logit is masked)
    min_tokens: int = 0  # EOS cannot end the request before this many new tokens
    segments: tuple[PromptSegment, ...] = ()  # set: `prompt` is their concatenation
    segment_repair_tokens: int = 0  # leading tokens of each reused segment recomputed in context
    # Log-probabilities, only when asked (None: none, and none is computed): `logprobs` for each
    # generated token (its own and the top-N alternatives', N = the value, at most MAX_LOGPROBS);
    # `prompt_logprobs` for each prompt token given those before it (OpenAI's echo).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The prompt as token ids, taken as they are (no BOS added: the client's tokenizer decides), instead of `prompt`.
    prompt_ids: tuple[int, ...] = ()
    # Guesses a decode step may verify (speculative decoding; None: the server's --speculative-tokens, 0: none).
    speculative_tokens: int | None = None
    # Added to the logits before every draw, greedy too (OpenAI's logit_bias): (token id, bias) pairs,
    # ids in the vocabulary, each bias in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS].
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The prefix cache's salt (vLLM's cache_salt): prompts with different salts never share cached K/V.
    # The front end sets it from the caller's tenant and the client's own salt (service.security.cache_salt).
    cache_salt: str = ""
    # The caller's tenant (set by the front end from its token, never by the client; "" without
    # tokens) and the request's priority among its tenant's own (vLLM's field: lower is served first).
    tenant: str = ""
    priority: int = 0


# The most alternatives a token's log-probabilities may list (OpenAI's and vLLM's default limit).
MAX_LOGPROBS = 20
# The most speculative guesses a request's decode step may verify (service.engine.spec_decode).
MAX_SPECULATIVE_TOKENS = 16
# Stop strings: each is looked for after every token, so their count and length bound the work a
# request may ask for (10,000 of them once made a 1,024-token request 19x slower).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARACTERS = 256
# logit_bias values, as OpenAI bounds them: +100 all but forces a token, -100 all but bans it.
MAX_LOGIT_BIAS = 100.0
# A client's cache_salt, in characters (it only needs to be unguessable).
MAX_CACHE_SALT_CHARACTERS = 256
# Who the scheduler admits next (EngineConfig.scheduling; service.engine.sched.fair).
SCHEDULING_POLICIES = ("fair", "fcfs")
# A request's priority among its tenant's own (lower first): a 32-bit signed integer, as gRPC carries it.
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1
# Segments of one prompt (each is a lookup in the reuse cache).
MAX_SEGMENTS = 256


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """One token and its log-probability under the model (its log-softmax, before temperature, top-k
    and top-p: vLLM's default), with the likeliest tokens' ids and log-probabilities, likeliest first."""

    token_id: int
    logprob: float
    top_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)


@dataclass
class Scored:
    """A text scored teacher-forced: per token after the first, its log-probability and the token
    the model found most likely there (its greedy prediction); with `top` asked, each position's
    likeliest tokens and their log-probabilities, (T-1, top) each."""

    logprobs: np.ndarray  # (T-1,) float64
    greedy: np.ndarray  # (T-1,) int64
    top_ids: np.ndarray | None = None  # (T-1, top) int64
    top_logprobs: np.ndarray | None = None  # (T-1, top) float64

    def token_logprobs(self, token_ids: list[int]) -> list[TokenLogprob]:
        """Per scored token (`token_ids`: the text's; its first is not scored), as generation reports them."""
        empty: list[list] = [[] for _ in range(len(self.logprobs))]
        top_ids = empty if self.top_ids is None else self.top_ids.tolist()
        top_lp = empty if self.top_logprobs is None else self.top_logprobs.tolist()
        rows = zip(token_ids[1:], self.logprobs.tolist(), top_ids, top_lp, strict=True)
        return [TokenLogprob(token, logprob, ids, lps) for token, logprob, ids, lps in rows]


# ---------------------------------------------------------------------------- the engine's settings


@dataclass
class EngineConfig:
    kv_cache_bytes: int = 256 * 1024 * 1024  # per model: the K/V arrays never exceed it
    block_size: int = 16
    max_batch_size: int = 32
    max_queue: int = 128
    prefill_tokens: int = 512  # prompt tokens per prefill call (longer prompts are chunked)
    max_new_tokens_limit: int = 1024
    default_max_new_tokens: int = 64
    max_sequence_tokens: int = 4096  # prompt + new tokens, for schemes with no hard limit
    device: str = "auto"
    kv_backend: str = "auto"  # numpy (CPU) | torch (CUDA; on the CPU too, to run that path)
    attention: str = "auto"  # decode: fused (GroupQueryAttention graph) where exported | fused | explicit
    threads: int = 0  # intra-op threads per session (0: half the cores for decode, all for prefill)
    prefill_nice: int = 10  # OS priority drop of the prefill worker thread (0: none)
    # A prefix-cache hit with at most this many prompt tokens left to compute goes to a thread of
    # its own at normal priority (service.engine.prompts.prefill.TailWorker), not the prefill worker (0: never).
    tail_prefill_tokens: int = 128
    # Under fair scheduling, a whole prompt of at most this many tokens from a tenant with no other
    # prompt being computed, while the prefill worker computes another tenant's, goes to that thread
    # too: a quiet tenant's first token then does not wait for a noisy tenant's prompt call (0: never).
    light_prefill_tokens: int = 256
    # The engine core sends a stream's continuing tokens at most this often (first tokens and
    # finishes at once): each message wakes threads on the other core, which slows the decode step.
    stream_interval_ms: float = 4.0
    ttft_slo_seconds: float = 0.0  # refuse requests estimated to miss this time to first token (0: off)
    admission_trace: str = ""  # folder: admission's measurements, decisions and outcomes per model (JSON lines)
    # Cache policy of requests that name none: "POLICY" for every model, "MODEL=POLICY" for one.
    default_cache_policies: tuple[str, ...] = ()
    prefix_cache: bool = True  # keep prompts' full blocks and reuse them for prompts that start alike
    # Speculative decoding (service.engine.spec_decode): guesses per step of a request that names none
    # (0: off), the proposer by name (service.engine.spec_decode.proposer.PROPOSERS), the n-gram
    # proposer's shortest and longest lookup, and the running batch above
    # which no request guesses: on 2 CPU cores guessing already costs at 2 streams (0.88-0.93x of not
    # guessing, `python -m bench --sections speculative`), so by default only a lone stream guesses.
    speculative_tokens: int = 0
    speculative_method: str = "ngram"
    ngram_prompt_lookup_min: int = 3
    ngram_prompt_lookup_max: int = 12
    speculative_max_batch: int = 1
    # Who is admitted next (service.engine.sched.fair): "fair" (deficit round robin over tokens across
    # tenants) or "fcfs" (arrival order); tenants' weights by name (absent: 1); how many tenants
    # the tokens file names (with one, no prompt takes the light lane, so none is opened for it).
    scheduling: str = "fair"
    tenant_weights: dict[str, float] = field(default_factory=dict)
    tenants: int = 1


@dataclass(frozen=True)
class DrainReport:
    """Requests in flight when a stop began: how many finished within the grace period, how many were cut."""

    finished: int = 0
    cut: int = 0


class ModelInfo(msgspec.Struct, frozen=True):
    """What the front end knows of a served model (ListModels, metric labels), as the core loaded it."""

    name: str
    scheme: str
    max_positions: int  # 0: no hard limit
    train_context: int
    kv_cache_bytes_per_token: int
    n_layers: int
    n_heads: int
    head_dim: int
    dtype: str
    max_new_tokens_limit: int
    max_sequence_tokens: int
    kv_cache_capacity_bytes: int
    cache_policies: list[str]
    default_cache_policy: str
    eviction_positions: str
    segment_reuse: str = "recompute"  # contract.manifest.SegmentReuse.mode
    # The byte tokenizer (token id == byte value below 256; the specials after), for the front ends'
    # tokenizer endpoints and log-probabilities' token strings.
    vocab_size: int = 259
    bos_token_id: int = 256
    eos_token_id: int = 257
    add_bos: bool = True
    # The store's row layout (KVLayout): a float row's bytes are this per token plus the fixed
    # local columns of a split hybrid (0 for whole rows), so hybrids are not counted as whole rows.
    kv_cache_bytes_per_sequence: int = 0
    default_max_new_tokens: int = 64  # a request that sets none (--default-max-new-tokens)
    random_weights: bool = False  # random from a fixed seed, not trained (contract.manifest.Manifest.random_weights)

    def prompt_ids(self, text: str) -> list[int]:
        """A text prompt's token ids, as the engine tokenizes it (service.engine.processing.input_processor)."""
        data = list(text.encode("utf-8"))
        return [self.bos_token_id, *data] if self.add_bos else data


@dataclass
class CoreConfig:
    """Everything the core process needs to start (pickled onto its stdin by the front end)."""

    repository: Path
    engine: EngineConfig
    names: list[str] | None
    commands_fd: int  # read end of the front end's commands
    events_fd: int  # write end of our events
    log_level: int = logging.INFO
    environment: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------- commands


class Add(msgspec.Struct, tag=1, array_like=True):
    """`produced`: a resumed request's tokens so far (every id its RequestOutputs carried): the core
    continues it from there, its text from the first byte the client has not seen."""

    request_id: str
    input: GenerateInput
    produced: list[int] = msgspec.field(default_factory=list)


class Cancel(msgspec.Struct, tag=2, array_like=True):
    request_id: str


class Score(msgspec.Struct, tag=3, array_like=True):
    """`ids`: the text as token ids instead (taken as they are); `top`: alternatives per position."""

    call: int
    model: str
    text: str
    cache_policy: str
    ids: list[int] = msgspec.field(default_factory=list)
    top: int = 0
    field: str = "text"  # what an error calls the text (echo's: prompt)


class MetricsQuery(msgspec.Struct, tag=4, array_like=True):
    call: int


class Stop(msgspec.Struct, tag=5, array_like=True):
    grace: float


Command = Add | Cancel | Score | MetricsQuery | Stop

# ---------------------------------------------------------------------------- events


class Refusal(msgspec.Struct, array_like=True):
    """A RequestError on the wire (kind "INTERNAL": a bug, not the request's fault)."""

    kind: str
    message: str
    retry_after: float | None = None

    @classmethod
    def of(cls, error: RequestError) -> Refusal:
        return cls(error.kind.value, error.message, error.retry_after)

    def error(self) -> Exception:
        if self.kind == "INTERNAL":
            return RuntimeError(self.message)
        return RequestError(ErrorKind(self.kind), self.message, self.retry_after)


class Final(msgspec.Struct, array_like=True):
    """How a request ended: its usage and times (the core's time.monotonic(); one clock per host)."""

    prompt_tokens: int
    completion_tokens: int
    arrival_time: float
    first_token_time: float | None
    scheduled_time: float | None
    finish_time: float | None
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    reused_prompt_tokens: int = 0  # tokens of reusable segments whose K/V was reused, not computed here


class RequestOutput(msgspec.Struct, array_like=True):
    """The text one request produced since its last entry; `status` (and `final`) on its last.
    `token_ids`: the tokens delivered since its last entry, in order (not on a final entry); text
    the detokenizer holds back (part of a character, a possible stop string) follows later, so a
    front end that keeps every id can resume the request exactly where its client is."""

    request_id: str
    text: str
    status: int | None = None
    error: str | None = None
    final: Final | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    # With log-probabilities asked: one per token delivered since its last entry (a final entry
    # carries those of the tokens delivered since, whose ids it does not repeat).
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)


class Ready(msgspec.Struct, tag=11, array_like=True):
    models: list[ModelInfo]


class Failed(msgspec.Struct, tag=12, array_like=True):
    message: str


class Reply(msgspec.Struct, tag=13, array_like=True):
    request_id: str
    refusal: Refusal | None = None


class ScoreReply(msgspec.Struct, tag=14, array_like=True):
    call: int
    refusal: Refusal | None = None
    logprobs: bytes = b""  # little-endian float64
    greedy: bytes = b""  # little-endian int64
    top_ids: bytes = b""  # little-endian int64, (tokens, top) row-major
    top_logprobs: bytes = b""  # little-endian float64, likewise

    @classmethod
    def of(cls, call: int, scored: Scored) -> ScoreReply:
        top_ids = b"" if scored.top_ids is None else scored.top_ids.astype("<i8").tobytes()
        top_lp = b"" if scored.top_logprobs is None else scored.top_logprobs.astype("<f8").tobytes()
        logprobs, greedy = scored.logprobs.astype("<f8").tobytes(), scored.greedy.astype("<i8").tobytes()
        return cls(call, None, logprobs, greedy, top_ids, top_lp)

    def scored(self) -> Scored:
        logprobs = np.frombuffer(self.logprobs, dtype="<f8").copy()
        top_ids = top_lp = None
        if self.top_ids:
            top_ids = np.frombuffer(self.top_ids, dtype="<i8").reshape(len(logprobs), -1).copy()
            top_lp = np.frombuffer(self.top_logprobs, dtype="<f8").reshape(len(logprobs), -1).copy()
        return Scored(logprobs, np.frombuffer(self.greedy, dtype="<i8").copy(), top_ids, top_lp)


class MetricsReply(msgspec.Struct, tag=15, array_like=True):
    call: int
    exposition: bytes


class Outputs(msgspec.Struct, tag=16, array_like=True):
    entries: list[RequestOutput]


class Stopped(msgspec.Struct, tag=17, array_like=True):
    finished: int
    cut: int


Event = Ready | Failed | Reply | ScoreReply | MetricsReply | Outputs | Stopped

# ---------------------------------------------------------------------------- framing

_HEADER = struct.Struct("<I")
M = TypeVar("M")


class MessageWriter:
    """Frames messages onto a pipe. One per writer, kept with its buffer: a message costs one
    encode into a reused buffer and one write, with no allocation (the decode loop sends one every
    few milliseconds). Not thread-safe: callers that share it hold a lock."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer = bytearray()

    def send(self, message: msgspec.Struct) -> None:
        buffer = self._buffer
        self._encoder.encode_into(message, buffer, _HEADER.size)
        _HEADER.pack_into(buffer, 0, len(buffer) - _HEADER.size)
        write_all(self.fd, buffer)


def write_all(fd: int, data: bytes | bytearray) -> None:
    """One frame onto a pipe (a blocking write may still return short when a signal interrupts it)."""
    with memoryview(data) as view:
        while view:
            view = view[os.write(fd, view) :]


def read_messages(fd: int, kind: type[M]) -> Iterator[M]:
    """Every message written to the pipe `fd`, decoded as `kind`, until its writer closes it (or dies)."""
    decoder = msgspec.msgpack.Decoder(kind)
    buffer = bytearray()
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            return
        if not data:
            return
        buffer += data
        start, size = 0, len(buffer)
        messages = []
        while size - start >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer, start)
            end = start + _HEADER.size + length
            if size < end:
                break
            messages.append(decoder.decode(bytes(buffer[start + _HEADER.size : end])))
            start = end
        del buffer[:start]
        yield from messages
