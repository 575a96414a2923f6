"""Locust users for the generation service (gRPC).

    locust -f loadtest/locustfile.py --headless -u 32 -r 8 -t 60s --host localhost:50051 --csv out/run
    python -m loadtest --headless ...     # the same; its --help also lists the scenario options

Every RPC fires Locust's request event once (name, response time, length, exception), so the
web UI, CSV output and distributed mode work unchanged and the Aggregated line counts RPCs, the
figure the server's posenc_requests_total counts: `ListModels` (once per user), `GenerateStream
<model>`, `Cancelled <model>` (streams the client cancels on purpose, --cancel-fraction) and
`Stopped <model>` (streams cut because Locust stopped the user; `--stop-timeout` lets them
finish). Time to first token and inter-token latency are not requests: they go to
`loadtest.token_latency`, which prints them at the end, writes them beside the CSV and shows
them in a web UI tab.

Scenario options (`loadtest/scenario.py`, also as LOCUST_* environment variables): --models,
--prompt-bytes, --max-new-tokens, --temperature, --top-p, --load-shape steady|step|poisson,
--target-rps, --step-users, --step-seconds, --request-timeout, --cancel-fraction.
"""

from __future__ import annotations

import random
import time
from functools import cache

import gevent
import grpc
import grpc.experimental.gevent as grpc_gevent
from gevent import GreenletExit
from locust import LoadTestShape, User, events, task

from loadtest.scenario import parse_mix, prompt_length_sampler
from loadtest.streaming import timed_stream
from loadtest.token_latency import LATENCY
from models.corpus import load_corpus
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.api.retry import MAX_RETRY_AFTER_SECONDS, RETRY_AFTER_KEY
from service.channel import open_channel

grpc_gevent.init_gevent()  # grpcio's blocking calls must yield to gevent


@cache
def held_out_bytes() -> bytes:
    """The corpus's test split as bytes (file separators dropped)."""
    return load_corpus().text_bytes("test")


@events.init.add_listener
def _preload(environment, **_kwargs) -> None:  # type: ignore[no-untyped-def]
    """Read the corpus before users spawn: it takes seconds and would stall the gevent loop."""
    held_out_bytes()


def held_out_prompt(rng: random.Random, length: int) -> str:
    data = held_out_bytes()
    start = rng.randrange(0, len(data) - length - 1)
    return data[start : start + length].decode("utf-8", errors="ignore") or "x"


class GenerationUser(User):
    """One client streaming generations; `host` is `HOST:PORT` of the gRPC service."""

    def wait_time(self) -> float:
        options = self.environment.parsed_options
        if options is not None and options.load_shape == "poisson":
            # Exponential gaps per user make the aggregate arrival process ~Poisson at the target rate.
            users = max(1, self.environment.runner.user_count if self.environment.runner else 1)
            return self._rng.expovariate(options.target_rps / users)
        return 0.0

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self._rng = random.Random(id(self))
        # The retry policy every client should carry: a draining replica's port closes (GOAWAY) and a
        # call refused with UNAVAILABLE before it started is sent again, elsewhere behind a proxy.
        self.channel = open_channel(self.host)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        models = self._list_models()
        self.limits = {m.name: m.max_positions for m in models}
        self.mix = parse_mix(options.models if options else "", sorted(self.limits))
        self.lengths = prompt_length_sampler(options.prompt_bytes if options else "64,256")
        self.max_new_tokens = options.max_new_tokens if options else 64
        self.temperature = options.temperature if options else 0.0
        self.top_p = options.top_p if options else 1.0
        self.timeout = options.request_timeout if options else 120.0
        self.cancel_fraction = options.cancel_fraction if options else 0.0

    def on_stop(self) -> None:
        self.channel.close()

    def _fire(self, request_type: str, name: str, seconds: float, length: int, exception: Exception | None) -> None:
        """Record one RPC: the only kind of entry in Locust's request statistics here."""
        self.environment.events.request.fire(
            request_type=request_type, name=name, response_time=seconds * 1000.0,
            response_length=length, exception=exception, context={},
        )  # fmt: skip

    def _list_models(self) -> list[pb.ModelInfo]:
        """The served models, recorded as the RPC it is (the server counts it too)."""
        started = time.perf_counter()
        try:
            response = self.stub.ListModels(pb.ListModelsRequest(), timeout=30)
        except grpc.RpcError as error:
            self._fire("grpc", "ListModels", time.perf_counter() - started, 0, error)
            raise
        self._fire("grpc", "ListModels", time.perf_counter() - started, response.ByteSize(), None)
        return list(response.models)

    @task
    def generate_stream(self) -> None:
        model = self._rng.choices(*self.mix)[0]
        length = self.lengths(self._rng)
        if self.limits[model]:  # a bounded model: keep prompt + output inside its positions
            length = max(1, min(length, self.limits[model] - self.max_new_tokens - 2))
        request = pb.GenerateRequest(
            model=model, prompt=held_out_prompt(self._rng, length), max_new_tokens=self.max_new_tokens,
            temperature=self.temperature, top_p=self.top_p, seed=self._rng.randrange(1 << 31),
        )  # fmt: skip
        started = time.perf_counter()
        try:
            if self._rng.random() < self.cancel_fraction:
                self._cancelled_stream(model, request, started)
                return
            timing = timed_stream(self.stub, request, self.timeout)
        except GreenletExit:
            # Locust stopped this user mid-stream (the run ended, or fewer users): the RPC happened
            # all the same, and on_stop's channel close cancels it on the server, which counts it.
            self._fire("cancel", f"Stopped {model}", time.perf_counter() - started, 0, None)
            raise
        self._fire("grpc", f"GenerateStream {model}", timing.seconds, timing.received_bytes, timing.error)
        if timing.error is not None and timing.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._back_off(timing.error)
            return
        if timing.time_to_first_token is not None and timing.error is None:
            LATENCY.record("TTFT", model, timing.time_to_first_token)
            if timing.mean_inter_token is not None:
                LATENCY.record("ITL", model, timing.mean_inter_token)

    def _back_off(self, error: grpc.RpcError) -> None:
        """Wait as long as the server's `retry-after-ms` asks (up to its longest hint): coming back
        sooner only buys another refusal, at the cost of a round trip on both sides."""
        hint = dict(error.trailing_metadata() or ()).get(RETRY_AFTER_KEY)  # type: ignore[attr-defined]
        if hint:
            gevent.sleep(min(MAX_RETRY_AFTER_SECONDS, int(hint) / 1000))

    def _cancelled_stream(self, model: str, request: pb.GenerateRequest, started: float) -> None:
        """Read a few chunks (maybe none), then cancel, as an impatient client does."""
        stream = self.stub.GenerateStream(request, timeout=self.timeout)
        error: Exception | None = None
        try:
            for _ in range(self._rng.randint(0, 4)):
                next(stream)
        except StopIteration:
            pass
        except grpc.RpcError as rpc_error:
            error = rpc_error
        stream.cancel()
        self._fire("cancel", f"Cancelled {model}", time.perf_counter() - started, 0, error)


class ScenarioShape(LoadTestShape):
    """steady: -u users throughout; step: +--step-users every --step-seconds up to -u;
    poisson: -u users whose waits give Poisson arrivals at --target-rps. -t ends the run."""

    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        users, rate = options.num_users or 1, options.spawn_rate or 1
        if options.run_time and self.get_run_time() >= options.run_time:
            return None
        if options.load_shape == "step":
            steps = int(self.get_run_time() // options.step_seconds) + 1
            return min(users, steps * options.step_users), rate
        return users, rate
