"""The server's configuration: one object, filled from flags whose defaults come from POSENC_* variables.

Kept apart from the server so its flags, their checks and their help read in one place.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.cli import HelpFormatter
from contract.paths import REPOSITORY_ROOT
from service.engine.messages import MAX_SPECULATIVE_TOKENS, SCHEDULING_POLICIES, EngineConfig
from service.engine.spec_decode.proposer import PROPOSERS
from service.security import Tenants, TenantTerms, read_token


@dataclass
class ServerConfig:
    model_repository: Path = REPOSITORY_ROOT / "model_repository"
    models: list[str] = field(default_factory=list)  # empty = every model in the repository
    host: str = "127.0.0.1"  # loopback unless configured (containers set 0.0.0.0)
    port: int = 50051
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464  # 0 = no metrics endpoint
    http_port: int = 8000  # the OpenAI-compatible HTTP API, on `host` (0 = none)
    grace_seconds: float = 10.0
    drain_delay_seconds: float = 0.0  # SIGTERM: NOT_SERVING but still serving this long, then GOAWAY
    final_scrape_seconds: float = 0.0  # drained: wait this long at most for a scrape of the final counters
    workers: int = 128
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # set: mutual TLS, clients need a certificate it signed
    # Tokens: every RPC but health needs `authorization: Bearer <token>` of a tenant (none: no token needed).
    tenants: Tenants = field(default_factory=Tenants)
    # Every tenant's limits unless its line in the token file sets its own (service.quota; None: no limit).
    tenant_limits: TenantTerms = field(default_factory=TenantTerms)
    engine: EngineConfig = field(default_factory=EngineConfig)


ENGINE_FLAGS = {
    "kv_cache_bytes": ("--kv-cache-bytes", int, "KV-cache budget per model, bytes: allocated K/V never exceed it"),
    "block_size": ("--block-size", int, "tokens per KV-cache block"),
    "max_batch_size": ("--max-batch-size", int, "sequences per running batch"),
    "max_queue": ("--max-queue", int, "waiting requests per model before RESOURCE_EXHAUSTED"),
    "prefill_tokens": ("--prefill-tokens", int, "prompt tokens per prefill call (longer prompts are chunked)"),
    "max_new_tokens_limit": ("--max-new-tokens-limit", int, "largest max_new_tokens accepted"),
    "default_max_new_tokens": ("--default-max-new-tokens", int, "max_new_tokens when a request leaves it unset"),
    "max_sequence_tokens": ("--max-sequence-tokens", int, "prompt + new tokens limit for unbounded schemes"),
    "device": ("--device", str, "auto | cpu | cuda"),
    "kv_backend": ("--kv-backend", str, "KV store arrays: auto (numpy on CPU, torch on CUDA) | numpy | torch"),
    "attention": (
        "--attention",
        str,
        "decode attention: auto (the fused GroupQueryAttention graph for full-cache rows where exported) | "
        "fused (refuse models without it) | explicit (the in-place serving graph only)",
    ),
    "prefill_nice": ("--prefill-nice", int, "nice value added to prefill worker threads (decode first; 0: off)"),
    "tail_prefill_tokens": (
        "--tail-prefill-tokens",
        int,
        "a prefix-cache hit with at most this many prompt tokens left to compute runs on a thread of its own "
        "at the decode thread's priority, not behind the prefill worker's lower one (0: off)",
    ),
    "light_prefill_tokens": (
        "--light-prefill-tokens",
        int,
        "fair scheduling: a whole prompt of at most this many tokens from a tenant with nothing else being "
        "computed, while another tenant's prompts are, runs on that thread too (0: off)",
    ),
    "stream_interval_ms": (
        "--stream-interval-ms",
        float,
        "the engine core sends a stream's next tokens at most this often, together (a first token and a "
        "stream's end go at once; 0: one message per decode step)",
    ),
    "threads": ("--threads", int, "threads per ONNX Runtime session (0: decode half the cores, prefill all)"),
    "ttft_slo_seconds": (
        "--ttft-slo-seconds",
        float,
        "time-to-first-token target: a request estimated to miss it (from measured prefill throughput and "
        "the queue ahead) is refused at once with RESOURCE_EXHAUSTED and a retry-after-ms hint (0: off)",
    ),
    "admission_trace": (
        "--admission-trace",
        str,
        "folder: write each model's admission measurements, decisions and realised times to first token to "
        "<folder>/<model>.jsonl (replayed by service.engine.sched.admission.replay; empty: off)",
    ),
    "speculative_tokens": (
        "--speculative-tokens",
        int,
        "speculative decoding: guesses (from --speculative-method's proposer) a decode step verifies in one "
        "graph call, for requests that name none (GenerateRequest.speculative_tokens overrides; 0: off)",
    ),
    "speculative_method": (
        "--speculative-method",
        str,
        f"the proposer of speculative guesses, by name: {', '.join(sorted(PROPOSERS))} (ngram: vLLM's n-gram "
        "prompt lookup, no model)",
    ),
    "ngram_prompt_lookup_min": ("--ngram-prompt-lookup-min", int, "shortest n-gram the proposer looks up"),
    "ngram_prompt_lookup_max": ("--ngram-prompt-lookup-max", int, "longest n-gram the proposer looks up"),
    "scheduling": (
        "--scheduling",
        str,
        "who is admitted next: fair (deficit round robin over tokens across the tenants of --auth-tokens-file, "
        "by their weights; each tenant's own requests by priority) | fcfs (first come, first served)",
    ),
    "speculative_max_batch": (
        "--speculative-max-batch",
        int,
        "no request guesses while more than this many sequences decode (a larger batch's step grows with "
        "the tokens it verifies, so guesses cost more than they save)",
    ),
}
SERVER_FLAGS = {
    "host": ("--host", str, "address to bind the gRPC port"),
    "port": ("--port", int, "gRPC port"),
    "http_port": (
        "--http-port",
        int,
        "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health), "
        "bound on --host beside gRPC with the same engine, token and TLS (0 disables)",
    ),
    "metrics_host": ("--metrics-host", str, "address to bind /metrics"),
    "metrics_port": ("--metrics-port", int, "Prometheus /metrics port (0 disables)"),
    "grace_seconds": (
        "--grace-seconds",
        float,
        "on SIGTERM, after --drain-delay-seconds: how long running requests may finish while the port "
        "accepts no new calls (GOAWAY)",
    ),
    "drain_delay_seconds": (
        "--drain-delay-seconds",
        float,
        "on SIGTERM: health says NOT_SERVING but new calls are still served this long, so proxies and "
        "Kubernetes readiness move new calls elsewhere before the port closes (0: close at once)",
    ),
    "final_scrape_seconds": (
        "--final-scrape-seconds",
        float,
        "once drained, keep /metrics up until one scrape has read the final counters (posenc_drained 1), at "
        "most this long: set it to the scrape interval so no count is lost across a restart (0: exit at once)",
    ),
    "workers": ("--workers", int, "gRPC handler threads"),
}


def _env(name: str) -> str:
    return "POSENC_" + name.upper()


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    """The server's configuration from flags, each defaulting to its POSENC_* variable, then checked."""
    parser = _parser(ServerConfig(), EngineConfig())
    args = vars(parser.parse_args(argv))
    engine = EngineConfig(
        **{attr: args[attr] for attr in ENGINE_FLAGS},
        default_cache_policies=tuple(args["default_cache_policies"]),
        prefix_cache=args["prefix_cache"],
    )
    _check_engine(parser, engine)
    _check_tls(parser, args)
    try:
        tenants = Tenants.read(read_token(args["auth_token"], args["auth_token_file"]), args["auth_tokens_file"])
    except (OSError, ValueError) as error:
        parser.error(f"--auth-tokens-file: {error}")
    return ServerConfig(
        tenant_limits=TenantTerms(
            max_concurrent=args["tenant_max_concurrent"] or None,
            tokens_per_minute=args["tenant_tokens_per_minute"] or None,
        ),
        model_repository=args["model_repository"],
        models=[m for m in args["models"] if m],
        tls_cert=args["tls_cert"],
        tls_key=args["tls_key"],
        tls_client_ca=args["tls_client_ca"],
        tenants=tenants,
        engine=engine,
        **{attr: args[attr] for attr in SERVER_FLAGS},
    )


def _parser(defaults: ServerConfig, engine_defaults: EngineConfig) -> argparse.ArgumentParser:
    """Every flag: the hand-written ones (paths, lists, switches), then SERVER_FLAGS and ENGINE_FLAGS."""
    parser = argparse.ArgumentParser(
        prog="python -m service",
        description="posenc-serve gRPC generation service (flags also read POSENC_* env vars)",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--model-repository", type=Path,
        default=Path(os.environ.get(_env("model_repository"), defaults.model_repository)),
        help=f"folder of model folders written by `python -m export` (env {_env('model_repository')})",
    )  # fmt: skip
    parser.add_argument(
        "--models", nargs="*", default=[m for m in os.environ.get(_env("models"), "").split(",") if m],
        help=f"serve only these model names; by default every model except rope scaling variants, which are "
        f"served only when named here (env {_env('models')}, comma-separated)",
    )  # fmt: skip
    for attr, text in (
        ("tls_cert", "server certificate (PEM); with --tls-key enables TLS"),
        ("tls_key", "server private key (PEM)"),
        ("tls_client_ca", "CA (PEM) whose client certificates are required: mutual TLS"),
        ("auth_token_file", "file holding the bearer token clients must send"),
        (
            "auth_tokens_file",
            "file of tenants' bearer tokens, one TENANT:TOKEN[:WEIGHT] [max_concurrent=N] [tokens_per_minute=N] "
            "a line: each tenant's requests get a prefix cache of their own (a client's cache_salt is combined "
            "with its tenant's), a share of the server by WEIGHT (default 1) under --scheduling fair, and its limits",
        ),
    ):
        value = os.environ.get(_env(attr))
        parser.add_argument(f"--{attr.replace('_', '-')}", type=Path, default=Path(value) if value else None,
                            help=f"{text} (env {_env(attr)})")  # fmt: skip
    parser.add_argument(
        "--default-cache-policy", dest="default_cache_policies", action="append",
        default=[p for p in os.environ.get(_env("default_cache_policy"), "").split(",") if p],
        metavar="[MODEL=]POLICY",
        help="cache policy of requests that name none: full, window:W or sinks:S+window:W; MODEL=POLICY "
        f"sets one model's (repeatable; default full; env {_env('default_cache_policy')}, comma-separated)",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-cache", action=argparse.BooleanOptionalAction,
        default=os.environ.get(_env("prefix_cache"), "1").lower() not in ("0", "false", "no", "off"),
        help="keep the KV cache of prompts' full blocks inside the budget (evicted least recently used before "
        f"any request waits for room) and reuse it for prompts that start alike (env {_env('prefix_cache')})",
    )  # fmt: skip
    parser.add_argument(
        "--auth-token", default=os.environ.get(_env("auth_token")),
        help=f"bearer token clients must send (env {_env('auth_token')}; prefer --auth-token-file)",
    )  # fmt: skip
    for name, text in (
        ("max_concurrent", "requests in flight at once"),
        ("tokens_per_minute", "prompt and generated tokens over the last 60 s (charged prompt + max_new_tokens"
         " when accepted, what was used when done)"),
    ):  # fmt: skip
        parser.add_argument(
            f"--tenant-{name.replace('_', '-')}", type=int, default=int(os.environ.get(_env(f"tenant_{name}"), 0)),
            help=f"each tenant's limit of {text}, past which its requests get RESOURCE_EXHAUSTED (HTTP 429) naming "
            f"it; a tenant's line in --auth-tokens-file may set its own {name}=N "
            f"(0: none; env {_env(f'tenant_{name}')})",
        )  # fmt: skip
    for flags, source in ((SERVER_FLAGS, defaults), (ENGINE_FLAGS, engine_defaults)):
        for attr, (flag, kind, text) in flags.items():
            default = kind(os.environ.get(_env(attr), getattr(source, attr)))
            parser.add_argument(flag, type=kind, default=default, help=f"{text} (env {_env(attr)})")
    return parser


def _check_engine(parser: argparse.ArgumentParser, engine: EngineConfig) -> None:
    """Refuse engine settings out of range with a usage error, before any model is loaded."""
    if not 0 <= engine.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        parser.error(f"--speculative-tokens must be in [0, {MAX_SPECULATIVE_TOKENS}] (got {engine.speculative_tokens})")
    if engine.speculative_method not in PROPOSERS:
        names = ", ".join(sorted(PROPOSERS))
        parser.error(f"--speculative-method must be one of {names} (got {engine.speculative_method!r})")
    if not 1 <= engine.ngram_prompt_lookup_min <= engine.ngram_prompt_lookup_max:
        parser.error("--ngram-prompt-lookup-min must be >= 1 and at most --ngram-prompt-lookup-max")
    if engine.tail_prefill_tokens < 0:
        parser.error(f"--tail-prefill-tokens must be >= 0 (got {engine.tail_prefill_tokens})")
    if engine.light_prefill_tokens < 0:
        parser.error(f"--light-prefill-tokens must be >= 0 (got {engine.light_prefill_tokens})")
    if engine.scheduling not in SCHEDULING_POLICIES:
        parser.error(f"--scheduling must be one of {', '.join(SCHEDULING_POLICIES)} (got {engine.scheduling!r})")
    if not 0 <= engine.stream_interval_ms <= 1000:
        parser.error(f"--stream-interval-ms must be between 0 and 1000 (got {engine.stream_interval_ms:g})")


def _check_tls(parser: argparse.ArgumentParser, args: dict[str, Any]) -> None:
    """A certificate needs its key, and a client CA (mutual TLS) needs both."""
    if (args["tls_cert"] is None) != (args["tls_key"] is None):
        parser.error("--tls-cert and --tls-key go together")
    if args["tls_client_ca"] is not None and args["tls_cert"] is None:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
