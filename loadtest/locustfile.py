"""Locust users for the generation service: gRPC (`GenerationUser`) and the OpenAI-compatible HTTP
API (`HttpGenerationUser`), with the same scenario (prompts, model mix, sampling, back-off).

    locust -f loadtest/locustfile.py --headless -u 32 -r 8 -t 60s --host localhost:50051 --csv out/run
    locust -f loadtest/locustfile.py --headless -u 32 -r 8 -t 60s --api http --host http://localhost:8000
    python -m loadtest --headless ...     # the same; its --help also lists the scenario options

`--api grpc` (the default) runs the gRPC user, `--api http` the HTTP user, `--api both` half the
users each (the HTTP user then calls --http-host, by default port 8000 on --host's machine).
Naming user classes on the command line (`locust -f ... HttpGenerationUser`) overrides --api.
The KV-reuse workloads (loadtest/workloads.py) are gRPC users run only by name: `SharedPrefixUser`
(one long shared prefix, a unique tail) and `DocumentsUser` (documents in varying order as
reusable segments), their calls named `SharedPrefix <model>` and `Documents <model>`.

Every call fires Locust's request event once (name, response time, length, exception), so the
web UI, CSV output and distributed mode work unchanged and the Aggregated line counts calls, the
figure the server's posenc_requests_total counts (its `api` label tells the front ends apart):
`ListModels` or `GET /v1/models` (once per user), `GenerateStream <model>` or `POST /v1/completions
<model>` (an SSE stream), `Cancelled <model>` (streams the client cancels on purpose,
--cancel-fraction) and `Stopped <model>` (streams cut because Locust stopped the user;
`--stop-timeout` lets them finish; one cut while its request was still on its way never reaches
the server, which then counts one call fewer). A refusal for load (RESOURCE_EXHAUSTED, HTTP 429) counts as a
failure, and the user waits as long as its retry-after hint asks. Time to first token and
inter-token latency are not requests: they go to `loadtest.token_latency` under the model's name
(whichever API measured them), which prints them at the end, writes them beside the CSV and shows
them in a web UI tab.

Scenario options (`loadtest/scenario.py`, also as LOCUST_* environment variables): --models,
--prompt-bytes, --max-new-tokens, --temperature, --top-p, --ignore-eos, --api, --http-host,
--load-shape steady|step|poisson, --target-rps, --step-users, --step-seconds, --request-timeout,
--cancel-fraction.
"""

from __future__ import annotations

import random
import time
from functools import cache
from typing import Any

import gevent
import grpc
import grpc.experimental.gevent as grpc_gevent
from gevent import GreenletExit
from locust import FastHttpUser, LoadTestShape, User, events, task
from locust.contrib.fasthttp import ResponseContextManager
from locust.env import Environment
from locust.exception import StopUser
from locust.runners import Runner, WorkerRunner

from loadtest import workloads
from loadtest.scenario import parse_mix, prompt_length_sampler
from loadtest.sse import SseTimer, completion_body, http_base_url
from loadtest.streaming import StreamTiming, timed_stream
from loadtest.token_latency import LATENCY
from models.corpus import load_corpus
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.api.retry import MAX_RETRY_AFTER_SECONDS, RETRY_AFTER_KEY
from service.channel import open_channel
from service.routing import ROUTING_HEADER, routing_key, routing_metadata

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
    return workloads.held_out_slice(held_out_bytes(), rng, length) or "x"


class Scenario:
    """What every user sends, whichever API it calls: the model mix, prompt lengths, sampling and
    pacing of the scenario options, and how a stream's outcome is recorded."""

    environment: Environment

    def wait_time(self) -> float:
        options = self.environment.parsed_options
        if options is not None and options.load_shape == "poisson":
            # Exponential gaps per user make the aggregate arrival process ~Poisson at the target rate.
            users = max(1, self.environment.runner.user_count if self.environment.runner else 1)
            return self._rng.expovariate(options.target_rps / users)
        return 0.0

    def _configure(self, limits: dict[str, int]) -> None:
        """The options, once the served models and their position limits (0: none) are known."""
        options = self.environment.parsed_options
        self.limits = limits
        self.mix = parse_mix(options.models if options else "", sorted(self.limits))
        self.lengths = prompt_length_sampler(options.prompt_bytes if options else "64,256")
        self.max_new_tokens = options.max_new_tokens if options else 64
        self.temperature = options.temperature if options else 0.0
        self.top_p = options.top_p if options else 1.0
        self.ignore_eos = options.ignore_eos if options else False
        self.cancel_fraction = options.cancel_fraction if options else 0.0

    def _draw(self) -> tuple[str, str, int]:
        """The next request's model, prompt and seed."""
        model = self._rng.choices(*self.mix)[0]
        length = self.lengths(self._rng)
        if self.limits[model]:  # a bounded model: keep prompt + output inside its positions
            length = max(1, min(length, self.limits[model] - self.max_new_tokens - 2))
        return model, held_out_prompt(self._rng, length), self._rng.randrange(1 << 31)

    def _fire(self, request_type: str, name: str, seconds: float, length: int, exception: Exception | None) -> None:
        """Record one call: the only kind of entry in Locust's request statistics here."""
        self.environment.events.request.fire(
            request_type=request_type, name=name, response_time=seconds * 1000.0,
            response_length=length, exception=exception, context={},
        )  # fmt: skip

    @staticmethod
    def _record_latency(model: str, timing: StreamTiming) -> None:
        if timing.time_to_first_token is not None:
            LATENCY.record("TTFT", model, timing.time_to_first_token)
            if timing.mean_inter_token is not None:
                LATENCY.record("ITL", model, timing.mean_inter_token)

    @staticmethod
    def _back_off(seconds: float) -> None:
        """Wait as long as the server asks (up to its longest hint): coming back sooner only buys
        another refusal, at the cost of a round trip on both sides."""
        gevent.sleep(min(MAX_RETRY_AFTER_SECONDS, seconds))


class GenerationUser(Scenario, User):
    """One client streaming generations; `host` is `HOST:PORT` of the gRPC service."""

    api = "grpc"
    label = "GenerateStream"  # the calls' name in Locust's statistics: "<label> <model>"

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self._rng = random.Random(id(self))
        # The retry policy every client should carry: a draining replica's port closes (GOAWAY) and a
        # call refused before it started (UNAVAILABLE, or gRPC core's CANCELLED at shutdown) is sent
        # again, elsewhere behind a proxy.
        self.channel = open_channel(self.host)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        models = self._list_models()
        self.train_contexts = {m.name: m.train_context for m in models}
        self._configure({m.name: m.max_positions for m in models})
        self.timeout = options.request_timeout if options else 120.0

    def on_stop(self) -> None:
        self.channel.close()

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

    def _request(self) -> tuple[str, pb.GenerateRequest]:
        """The next request and its model."""
        model, prompt, seed = self._draw()
        return model, self._sampled(model, seed, prompt=prompt)

    def _sampled(self, model: str, seed: int, **prompt: Any) -> pb.GenerateRequest:
        """A request with the scenario's sampling; `prompt`: its prompt= or segments=."""
        return pb.GenerateRequest(
            model=model, max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            seed=seed, ignore_eos=self.ignore_eos, **prompt,
        )  # fmt: skip

    @task
    def generate_stream(self) -> None:
        model, request = self._request()
        started = time.perf_counter()
        try:
            if self._rng.random() < self.cancel_fraction:
                self._cancelled_stream(model, request, started)
                return
            timing = timed_stream(self.stub, request, self.timeout)
        except GreenletExit:
            # Locust stopped this user mid-stream (the run ended, or fewer users): on_stop's channel
            # close cancels the RPC on the server, which counts it, if it had got there.
            self._fire("cancel", f"Stopped {model}", time.perf_counter() - started, 0, None)
            raise
        self._fire("grpc", f"{self.label} {model}", timing.seconds, timing.received_bytes, timing.error)
        if timing.error is not None and timing.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            hint = dict(timing.error.trailing_metadata() or ()).get(RETRY_AFTER_KEY)  # type: ignore[attr-defined]
            if hint:
                self._back_off(int(hint) / 1000)
            return
        if timing.error is None:
            self._record_latency(model, timing)

    def _cancelled_stream(self, model: str, request: pb.GenerateRequest, started: float) -> None:
        """Read a few chunks (maybe none), then cancel, as an impatient client does."""
        stream = self.stub.GenerateStream(request, timeout=self.timeout, metadata=routing_metadata(request))
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


class SharedPrefixUser(GenerationUser):
    """The shared-prefix workload (loadtest/workloads.py): every request the same long prefix of
    held-out text and a unique tail, scaled down for a model with fewer positions; the prefix cache's
    case. Run by name: `locust -f loadtest/locustfile.py SharedPrefixUser --max-new-tokens 32 ...`."""

    api = "workload"  # never picked by --api: named on the command line
    label = "SharedPrefix"

    def _draw(self) -> tuple[str, str, int]:
        model = self._rng.choices(*self.mix)[0]
        prefix_bytes, tail_bytes = workloads.shared_prefix_sizes(self.limits[model], self.max_new_tokens)
        data = held_out_bytes()
        prompt = workloads.shared_prefix_text(data, prefix_bytes) + workloads.held_out_slice(
            data, self._rng, tail_bytes
        )
        return model, prompt, self._rng.randrange(1 << 31)


@cache
def documents(train_context: int) -> list[str]:
    """The documents every DocumentsUser draws from: the same in every user, sized to the training context."""
    return workloads.document_set(
        held_out_bytes(), random.Random(workloads.SHARED_PREFIX_SEED), workloads.short_document_bytes(train_context)
    )


class DocumentsUser(GenerationUser):
    """Documents in varying order (loadtest/workloads.py): 4 of 8 held-out documents in a random
    order as reusable segments, a fresh passkey planted in one and asked for at the end, each prompt
    within the model's training context. Run by name: `locust -f loadtest/locustfile.py DocumentsUser ...`."""

    api = "workload"
    label = "Documents"

    def _request(self) -> tuple[str, pb.GenerateRequest]:
        model = self._rng.choices(*self.mix)[0]
        prompt = workloads.document_prompt(documents(self.train_contexts[model]), self._rng)
        segments = [pb.PromptSegment(text=text, reusable=reusable) for text, reusable in prompt.segments()]
        request = self._sampled(model, self._rng.randrange(1 << 31), segments=segments)
        if self.limits[model]:  # a bounded model: keep prompt + output inside its positions
            request.max_new_tokens = max(
                1, min(self.max_new_tokens, self.limits[model] - len(prompt.text.encode()) - 1)
            )
        return model, request


class HttpGenerationUser(Scenario, FastHttpUser):
    """The same scenario through the OpenAI-compatible API: `POST /v1/completions` streamed as
    server-sent events, timed as the gRPC user times GenerateStream."""

    api = "http"

    def __init__(self, environment: Environment) -> None:
        options = environment.parsed_options
        self.host = http_base_url(options, self.host)  # FastHttpUser checks and binds it in __init__
        # geventhttpclient's timeout is per read, not per call: the closest to gRPC's deadline.
        self.network_timeout = options.request_timeout if options else 120.0
        super().__init__(environment)

    def on_start(self) -> None:
        self._rng = random.Random(id(self))
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as response:
            models = response.json()["data"] if response.status_code == 200 else []
        if not models:
            raise StopUser()
        self._configure({model["id"]: int(model["max_model_len"]) for model in models})

    @task
    def generate_stream(self) -> None:
        model, prompt, seed = self._draw()
        body = completion_body(
            model, prompt, self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, seed=seed,
            ignore_eos=self.ignore_eos,
        )  # fmt: skip
        cancel = self._rng.random() < self.cancel_fraction
        started = time.perf_counter()
        timer = SseTimer(started)
        response: ResponseContextManager | None = None
        try:
            with self.client.post(
                "/v1/completions",
                json=body,
                name=f"/v1/completions {model}",
                stream=True,
                catch_response=True,
                headers={ROUTING_HEADER: routing_key(prompt)},  # prefix affinity behind HAProxy
            ) as response:
                if cancel:  # read a few events (maybe none), then hang up, as an impatient client does
                    self._read_events(response, timer, self._rng.randint(0, 4))
                    response.request_meta.update(request_type="cancel", name=f"Cancelled {model}")
                elif response.status_code == 200:
                    self._read_events(response, timer, None)
                    if timer.error is not None or not timer.done:
                        response.failure(timer.error or "stream ended without [DONE]")
                elif response.status_code:
                    response.content  # noqa: B018  (read the error body: the connection stays usable)
                timing = timer.finish(time.perf_counter())
                response.request_meta["response_time"] = timing.seconds * 1000.0  # the whole stream, as gRPC's
                response.request_meta["response_length"] = 0 if cancel else timing.received_bytes
        except GreenletExit:
            # Locust stopped this user mid-call: closing the connection below cancels the call on the
            # server, which counts it, unless it was stopped before its request got there (connecting).
            self._fire("cancel", f"Stopped {model}", time.perf_counter() - started, 0, None)
            raise
        finally:
            if response is not None:
                _hang_up(response)
        if response.status_code == 429:
            retry_after = response.headers.get("retry-after-ms")
            self._back_off(int(retry_after) / 1000 if retry_after else float(response.headers.get("Retry-After", 1)))
        elif not cancel and response.status_code == 200 and timer.error is None and timer.done:
            self._record_latency(model, timing)

    @staticmethod
    def _read_events(response: ResponseContextManager, timer: SseTimer, limit: int | None) -> None:
        """Feed the stream's lines to the timer as they arrive (Locust's iter_content waits for full
        blocks, which would blur the timings); stop after `limit` events or at the end."""
        raw = response._response  # geventhttpclient's response: reads lines as they come
        events = 0
        while limit is None or events < limit:
            line = raw.readline(b"\n")
            if not line:
                return
            if line.startswith(b"data:"):
                timer.line(line, time.perf_counter())
                events += 1
                if timer.done:
                    return


def _hang_up(response: ResponseContextManager) -> None:
    """Release the connection: back to the pool when the body was read to its end, else closed
    (which is how an HTTP client cancels its request)."""
    raw = getattr(response, "_response", None)
    if raw is not None:
        raw.release()


@events.init.add_listener
def _pick_users(environment: Environment, runner: Runner | None = None, **_kwargs: Any) -> None:
    """--api picks the user classes, unless the command line named them (workers spawn what the master asks)."""
    options = environment.parsed_options
    if options is None or options.user_classes or isinstance(runner, WorkerRunner):
        return
    wanted = ("grpc", "http") if options.api == "both" else (options.api,)
    environment.user_classes[:] = [cls for cls in environment.user_classes if getattr(cls, "api", None) in wanted]


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
