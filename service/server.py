"""serve(): the generation service, standard health and reflection, /metrics, graceful stop.

Configuration comes from one object, filled from command-line flags whose defaults come from
POSENC_* environment variables (for containers).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import REGISTRY

from contract.cache_policy import CachePolicyError
from contract.cli import HelpFormatter
from contract.manifest import ManifestError
from contract.paths import REPOSITORY_ROOT
from service.accounting import RequestAccounting
from service.api import generation_pb2, generation_pb2_grpc
from service.engine.messages import MAX_SPECULATIVE_TOKENS, SCHEDULING_POLICIES, DrainReport, EngineConfig
from service.engine.spec_decode.proposer import PROPOSERS
from service.engine_client import EngineClient, EngineStartError
from service.malloc import return_freed_memory_to_the_os
from service.metrics import FRONT_END, ServiceMetrics
from service.metrics_endpoint import MetricsEndpoint
from service.openai_api.app import OpenAIApi
from service.openai_api.server import HttpServer
from service.quota import TenantQuota
from service.request_handle import ResumeObserver
from service.security import BearerTokenInterceptor, Tenants, TenantTerms, read_token, server_credentials, ssl_context
from service.servicer import GenerationServicer

logger = logging.getLogger(__name__)
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


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


class RunningServer:
    """Handles to everything serve() started."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServiceMetrics(REGISTRY, FRONT_END)  # the core records the rest
        self.health = ServiceHealth()
        self.servicer = GenerationServicer(config.tenants)
        # Accounting first (outermost): it also counts the calls the token check refuses.
        interceptors: list[grpc.ServerInterceptor] = [
            RequestAccounting(SERVICE_NAME, self.metrics, self.servicer.labels)
        ]
        if config.tenants.required:
            interceptors.append(BearerTokenInterceptor(config.tenants))
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.workers),
            interceptors=interceptors,
            options=[("grpc.so_reuseport", 0)],
        )
        self.engine: EngineClient | None = None
        self.metrics_endpoint: MetricsEndpoint | None = None
        self.http: HttpServer | None = None
        self.stopped = threading.Event()
        self._engine_went_down = False
        self._draining = False
        self._refusing_http = False  # SIGTERM, after the drain delay: the HTTP API answers 503 (nginx retries it)
        self.give_up = threading.Event()  # set when the engine core cannot be kept running
        self.gave_up: str | None = None  # why the engine core could not be kept running (exit non-zero)

    def start(self) -> None:
        self._configure_services()
        self._configure_metrics()
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert and self.config.tls_key:
            credentials = server_credentials(self.config.tls_cert, self.config.tls_key, self.config.tls_client_ca)
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        self.server.start()
        self._configure_http()
        self._load_models()

    def _configure_services(self) -> None:
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)

    def _configure_metrics(self) -> None:
        if self.config.metrics_port:
            self.metrics_endpoint = MetricsEndpoint(
                self.config.metrics_host, self.config.metrics_port, lambda: self.engine, self.metrics.drained
            )

    def _configure_http(self) -> None:
        """The OpenAI-compatible API on this process's engine client (one core, one KV budget, one admission)."""
        config = self.config
        if not config.http_port:
            return
        api = OpenAIApi(
            lambda: self.engine,
            lambda: self._refusing_http,
            self.metrics,
            self.servicer.labels,
            config.tenants,
            leaving=lambda: self._draining,
        )
        context = None
        if config.tls_cert and config.tls_key:
            context = ssl_context(config.tls_cert, config.tls_key, config.tls_client_ca)
        self.http = HttpServer(api, config.host, config.http_port, context)
        self.http.start()

    def _load_models(self) -> None:
        """Start the engine core process and wait for its models; health follows whether it serves."""
        resume = ResumeObserver(
            self.metrics.resumed_requests.inc, self.metrics.resume_failures.inc, self.metrics.resume_stall.observe
        )
        tenants = self.config.tenants
        engine = dataclasses.replace(self.config.engine, tenant_weights=tenants.weights())
        quota = TenantQuota(tenants.terms, self.config.tenant_limits, self.metrics)
        self.engine = EngineClient(
            self.config.model_repository, engine, self.config.models or None,
            on_serving=self._engine_serving, on_give_up=self._give_up, resume=resume, quota=quota,
        )  # fmt: skip
        self.servicer.engine = self.engine
        self.engine.start()
        logger.info(
            "serving %s on %s:%d (HTTP %s, metrics on %s:%d)", ", ".join(self.engine.models), self.config.host,
            self.port, self.http.port if self.http else "off", self.config.metrics_host, self.config.metrics_port,
        )  # fmt: skip

    def _engine_serving(self, serving: bool) -> None:
        if serving and self._engine_went_down:
            self.metrics.engine_restarts.inc()
        self._engine_went_down = not serving
        if not self._draining:
            up, down = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
            self._set_health(up if serving else down)

    def _give_up(self, reason: str) -> None:
        logger.error("giving up: %s; exiting non-zero", reason)
        self.gave_up = reason
        self.give_up.set()

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def stop(self, grace: float | None = None) -> DrainReport:
        """Drain without refusing a call: health says NOT_SERVING at once, while new calls are still
        served for `drain_delay_seconds` (proxies, Kubernetes readiness and clients that watch health
        move new calls elsewhere meanwhile); then the port stops accepting (GOAWAY: a proxy sends the
        call to another replica, a client's retry policy reconnects elsewhere) while running requests
        finish, up to `grace` seconds; what is left then is cut."""
        if self.stopped.is_set():
            return DrainReport()
        grace = self.config.grace_seconds if grace is None else grace
        delay = max(0.0, self.config.drain_delay_seconds) if grace > 0 else 0.0  # stop(0): at once
        if delay == 0:  # refused from the moment health says so (one HTTP call once slipped in between, in CI)
            self._refusing_http = True
        self._draining = True  # health stays NOT_SERVING whatever the engine core does
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if delay > 0:
            time.sleep(delay)
            self._refusing_http = True  # an HTTP handler that starts now (HTTP keeps its port) gets 503 and the reason
        started = time.monotonic()
        closed = self.server.stop(grace)  # running calls go on; new ones are not accepted
        # The engine serves until every call gRPC accepted has ended: a handler accepted just before the
        # port closed may not have submitted its request yet.
        report = self.engine.stop(grace, until=closed) if self.engine is not None else DrainReport()
        # Finished requests' handlers still send their last message: give them what is left of the grace.
        left = max(0.5, grace - (time.monotonic() - started))
        if self.http is not None:
            self.http.stop(left)
        closed.wait(left + 1)
        if self.metrics_endpoint is not None:
            linger = self.config.final_scrape_seconds
            if self.metrics_endpoint.serve_final_values(linger):
                logger.info("drained: a scrape read the final counters")
            elif linger > 0:
                logger.warning("drained: no scrape read the final counters within %g s", linger)
            self.metrics_endpoint.shutdown()
        self.metrics.unregister()
        self.stopped.set()
        return report


class ServiceHealth(health.HealthServicer):
    """grpcio's health service plus `List` (every service's status), which reflection advertises."""

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, int] = {}
        self._statuses_lock = threading.Lock()

    def set(self, service: str, status: int) -> None:
        with self._statuses_lock:
            self._statuses[service] = status
        super().set(service, status)

    def List(
        self, request: health_pb2.HealthListRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthListResponse:
        with self._statuses_lock:
            statuses = dict(self._statuses)
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()}
        )


def serve(config: ServerConfig) -> RunningServer:
    running = RunningServer(config)
    running.start()
    return running


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return_freed_memory_to_the_os()
    config = parse_config(argv)
    # Handlers first: health says SERVING inside serve(), and a SIGTERM that follows at once must
    # drain, not kill the process with the default action.
    stop_requested = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_requested.set())
    try:
        running = serve(config)
    except (ManifestError, CachePolicyError, EngineStartError, RuntimeError, OSError) as error:
        logger.error("refusing to start: %s", error)
        return 2
    while not stop_requested.wait(0.5):
        if running.give_up.is_set():
            running.stop(0)
            return 1
    logger.info(
        "stopping: health NOT_SERVING; new calls served for %g s more, then the port closes and running "
        "requests have up to %g s to finish",
        config.drain_delay_seconds,
        config.grace_seconds,
    )
    started = time.monotonic()
    report = running.stop()
    logger.info(
        "stopped after %.1f s: %d in-flight request(s) finished, %d cut at the end of the grace period",
        time.monotonic() - started, report.finished, report.cut,
    )  # fmt: skip
    return 0
