"""Locust users for the generation service (gRPC).

    locust -f loadtest/locustfile.py --headless -u 32 -r 8 -t 60s --host localhost:50051 --csv out/run

Every call fires Locust's request event (name, response time, length, exception), so the web UI,
CSV output and distributed mode work unchanged. Streams also report time to first token
(`TTFT <model>`) and their mean inter-token latency (`ITL <model>`) as entries of their own.

Scenario options (also as LOCUST_* environment variables): --models (mix, e.g. `alibi:2,rope:1`),
--prompt-bytes (e.g. `64,256,1024` or `uniform:64:2048`), --max-new-tokens, --temperature,
--top-p, --load-shape steady|step|poisson, --target-rps (poisson), --step-users and
--step-seconds (step). Prompts are drawn from the held-out (test) split of the corpus.
"""

from __future__ import annotations

import random
import time
from functools import cache

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import LoadTestShape, User, events, task

from loadtest.streaming import timed_stream
from models.corpus import load_corpus
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc

grpc_gevent.init_gevent()  # grpcio's blocking calls must yield to gevent


@events.init_command_line_parser.add_listener
def _options(parser) -> None:  # type: ignore[no-untyped-def]
    group = parser.add_argument_group("posenc-serve scenario")
    group.add_argument(
        "--models", default="", env_var="LOCUST_MODELS", help="model mix, e.g. alibi:2,rope:1 (default: all)"
    )
    group.add_argument("--prompt-bytes", default="64,256,1024", env_var="LOCUST_PROMPT_BYTES")
    group.add_argument("--max-new-tokens", type=int, default=64, env_var="LOCUST_MAX_NEW_TOKENS")
    group.add_argument("--temperature", type=float, default=0.0, env_var="LOCUST_TEMPERATURE")
    group.add_argument("--top-p", type=float, default=1.0, env_var="LOCUST_TOP_P")
    group.add_argument(
        "--load-shape", default="steady", choices=["steady", "step", "poisson"], env_var="LOCUST_LOAD_SHAPE"
    )
    group.add_argument("--target-rps", type=float, default=4.0, env_var="LOCUST_TARGET_RPS", help="poisson arrivals/s")
    group.add_argument("--step-users", type=int, default=8, env_var="LOCUST_STEP_USERS")
    group.add_argument("--step-seconds", type=float, default=30.0, env_var="LOCUST_STEP_SECONDS")
    group.add_argument("--request-timeout", type=float, default=120.0, env_var="LOCUST_REQUEST_TIMEOUT")
    group.add_argument(
        "--cancel-fraction", type=float, default=0.0, env_var="LOCUST_CANCEL_FRACTION",
        help="share of streams the client cancels after a few chunks (reported as 'Cancelled <model>')",
    )  # fmt: skip


def parse_mix(text: str, available: list[str]) -> tuple[list[str], list[float]]:
    """`alibi:2,rope:1` -> (names, weights); empty means every available model equally."""
    if not text:
        return available, [1.0] * len(available)
    names, weights = [], []
    for part in text.split(","):
        name, _, weight = part.partition(":")
        if name not in available:
            raise ValueError(f"--models: unknown model {name!r} (serving: {', '.join(available)})")
        names.append(name)
        weights.append(float(weight or 1))
    return names, weights


def prompt_length_sampler(text: str):  # type: ignore[no-untyped-def]
    """`64,256,1024` picks one of the values; `uniform:LOW:HIGH` draws between them."""
    if text.startswith("uniform:"):
        _, low, high = text.split(":")
        return lambda rng: rng.randint(int(low), int(high))
    choices = [int(v) for v in text.split(",")]
    return lambda rng: rng.choice(choices)


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
        self.channel = grpc.insecure_channel(self.host)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        models = self.stub.ListModels(pb.ListModelsRequest(), timeout=30).models
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
        self.environment.events.request.fire(
            request_type=request_type, name=name, response_time=seconds * 1000.0,
            response_length=length, exception=exception, context={},
        )  # fmt: skip

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
        if self._rng.random() < self.cancel_fraction:
            self._cancelled_stream(model, request)
            return
        timing = timed_stream(self.stub, request, self.timeout)
        self._fire("grpc", f"GenerateStream {model}", timing.seconds, timing.received_bytes, timing.error)
        if timing.time_to_first_token is not None and timing.error is None:
            self._fire("ttft", f"TTFT {model}", timing.time_to_first_token, 0, None)
            if timing.mean_inter_token is not None:
                self._fire("itl", f"ITL {model}", timing.mean_inter_token, 0, None)

    def _cancelled_stream(self, model: str, request: pb.GenerateRequest) -> None:
        """Read a few chunks (maybe none), then cancel, as an impatient client does."""
        started = time.perf_counter()
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
