"""serve(): the generation service, standard health and reflection, /metrics, graceful stop.

Configuration comes from one object (`service.server_config`), filled from command-line flags whose
defaults come from POSENC_* environment variables (for containers).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import REGISTRY

from contract.cache_policy import CachePolicyError
from contract.manifest import ManifestError
from service.accounting import RequestAccounting
from service.api import generation_pb2, generation_pb2_grpc
from service.engine.messages import DrainReport
from service.engine_client import EngineClient, EngineStartError
from service.malloc import return_freed_memory_to_the_os
from service.metrics import FRONT_END, ServiceMetrics
from service.metrics_endpoint import MetricsEndpoint
from service.openai_api.app import OpenAIApi
from service.openai_api.server import HttpServer
from service.quota import TenantQuota
from service.request_handle import ResumeObserver
from service.security import BearerTokenInterceptor, server_credentials, ssl_context
from service.server_config import ServerConfig, parse_config
from service.servicer import GenerationServicer

logger = logging.getLogger(__name__)
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


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
        engine = dataclasses.replace(self.config.engine, tenant_weights=tenants.weights(), tenants=len(tenants.names))
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
