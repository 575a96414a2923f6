"""Chaos run: Locust load through nginx on two replicas while faults are injected on a schedule.

    python -m loadtest.chaos --repository model_repository --duration 180 --users 32 --out out/chaos

Faults (at fixed fractions of --duration): kill -9 of replica A's engine core three times; SIGTERM
of replica B and its restart on the same ports; a client cancellation storm; the KV budget
exhausted by long prompts. Everything is measured from the outside: each call's outcome as its
client saw it (accepted: a first message arrived; finished; failed, by code), the replicas'
/metrics (requests by code, resumed requests, restarts), and text mismatches: every finished
load request that was running while a fault struck, and a sample of the others, is run again on
a quiet replica and its text compared (greedy and seeded requests are deterministic).

The Locust users run in a child process (`--load`: gevent), this process drives the faults.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from contract.paths import REPOSITORY_ROOT
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.channel import open_channel
from service.process import ServerProcess, free_port, wait_for

MODEL = "alibi"
PROMPTS = ["def main():\n", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):\n",
           "for i in range(10):\n", "# Utilities for the", "x = "]  # fmt: skip
REPLICA_FLAGS = (
    "--models", MODEL, "--kv-cache-bytes", str(24 << 20), "--max-sequence-tokens", "2048",
    "--grace-seconds", "30", "--drain-delay-seconds", "1",
)  # fmt: skip
LONG_PROMPT = "def f(x):\n    return x + 1\n" * 60  # ~1,600 bytes: eight of them outgrow the KV budget


def load_request(rng: random.Random) -> pb.GenerateRequest:
    """Greedy or seeded, short prompts: every one deterministic, so an uninterrupted rerun checks it."""
    sampled = rng.random() < 0.5
    return pb.GenerateRequest(
        model=MODEL, prompt=rng.choice(PROMPTS) * rng.randint(1, 4), max_new_tokens=rng.randint(32, 160),
        temperature=0.8 if sampled else 0.0, top_k=40 if sampled else 0, seed=rng.randrange(1 << 31),
    )  # fmt: skip


def request_dict(request: pb.GenerateRequest) -> dict[str, Any]:
    fields = ("model", "prompt", "max_new_tokens", "temperature", "top_k", "seed")
    return {name: getattr(request, name) for name in fields}


def streamed(stub: generation_pb2_grpc.GenerationStub, request: pb.GenerateRequest, kind: str,
             cancel_after: int | None = None) -> dict[str, Any]:  # fmt: skip
    """One GenerateStream as its client sees it: accepted (a first message), the text, the code."""
    record: dict[str, Any] = {"kind": kind, "request": request_dict(request), "started": time.time()}
    text, accepted, code, details = [], False, "OK", ""
    call = stub.GenerateStream(request, timeout=300)
    try:
        for chunk in call:
            accepted = True
            text.append(chunk.text)
            if cancel_after is not None and len(text) > cancel_after:
                call.cancel()
                code = "CANCELLED (client)"
                break
    except grpc.RpcError as error:
        code, details = error.code().name, error.details() or ""
    record.update(ended=time.time(), accepted=accepted, code=code, details=details, text="".join(text))
    return record


# ---------------------------------------------------------------------------- the load (child process)


def run_load(target: str, users: int, seconds: float, record: Path) -> None:
    """Locust users streaming `load_request`s for `seconds`, then finishing what runs; one JSON line per call."""
    import gevent
    import grpc.experimental.gevent as grpc_gevent
    from locust import User, task
    from locust.env import Environment

    grpc_gevent.init_gevent()
    stop_at = time.time() + seconds
    out = record.open("a")

    class ChaosUser(User):
        def on_start(self) -> None:
            self.rng = random.Random(id(self))
            self.channel = open_channel(self.host)  # the retry policy, as the Locust user carries it
            self.stub = generation_pb2_grpc.GenerationStub(self.channel)

        @task
        def stream(self) -> None:
            if time.time() > stop_at:
                gevent.sleep(1)
                return
            result = streamed(self.stub, load_request(self.rng), "load")
            out.write(json.dumps(result) + "\n")
            out.flush()
            failed = None if result["code"] == "OK" else RuntimeError(result["code"])
            self.environment.events.request.fire(
                request_type="grpc", name="GenerateStream", response_time=(result["ended"] - result["started"]) * 1000,
                response_length=len(result["text"]), exception=failed, context={},
            )  # fmt: skip

    environment = Environment(user_classes=[ChaosUser], host=target)
    runner = environment.create_local_runner()
    runner.start(users, spawn_rate=users)
    gevent.sleep(seconds + 60)  # calls started before the end finish (a resumed one may take a restart longer)
    runner.quit()
    out.close()


# ---------------------------------------------------------------------------- the proxy and the faults


def start_proxy(directory: Path, targets: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    """Debian's nginx with the shipped nginx.conf and a static upstream of the replicas."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = (REPOSITORY_ROOT / "deploy" / "nginx" / "nginx.conf").read_text()
    (directory / "nginx.conf").write_text(conf.replace("listen 50051 http2;", f"listen 127.0.0.1:{port} http2;"))
    temp = "".join(
        f"{kind}_temp_path {directory / kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    servers = "".join(f"    server {target} max_fails=1 fail_timeout=5s;\n" for target in targets)
    upstream = f"upstream posenc_replicas {{\n    zone posenc_replicas 256k;\n{servers}    keepalive 64;\n}}\n"
    (directory / "upstream.conf").write_text(temp + upstream)
    command = ["nginx", "-p", str(directory), "-c", str(directory / "nginx.conf"), "-e", "stderr",
               "-g", f"daemon off; pid {directory / 'nginx.pid'};"]  # fmt: skip
    process = subprocess.Popen(command, stdout=(directory / "nginx.log").open("a"), stderr=subprocess.STDOUT)
    assert wait_for(lambda: process.poll() is None and _listening(port), timeout=10), "nginx did not start"
    return process, port


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def counters(replica: ServerProcess) -> dict[str, float]:
    """The replica's own counts, from its /metrics."""
    found: dict[str, float] = {}
    try:
        text = replica.metrics()
    except OSError:
        return found
    for line in text.splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        if name in ("posenc_requests_total",) and 'method="GenerateStream"' in line:
            code = line.partition('code="')[2].partition('"')[0]
            found[f"GenerateStream {code}"] = found.get(f"GenerateStream {code}", 0) + float(line.rpartition(" ")[2])
        elif name in ("posenc_resumed_requests_total", "posenc_resume_failures_total", "posenc_engine_restarts_total"):
            found[name] = float(line.rpartition(" ")[2])
    return found


class Chaos:
    def __init__(self, repository: Path, out: Path, users: int, duration: float) -> None:
        self.repository, self.out, self.users, self.duration = repository, out, users, duration
        self.records: list[dict[str, Any]] = []
        self.faults: list[tuple[float, str]] = []
        self.server_counts: dict[str, dict[str, float]] = {}
        self.lock = threading.Lock()

    def run(self) -> dict[str, Any]:
        self.out.mkdir(parents=True, exist_ok=True)
        flags = (*REPLICA_FLAGS, "--threads", "1")
        self.a, self.b = ServerProcess(self.repository, *flags), ServerProcess(self.repository, *flags)
        self.a.wait_serving(), self.b.wait_serving()
        self.proxy, port = start_proxy(self.out / "nginx", [self.a.target, self.b.target])
        self.target = f"127.0.0.1:{port}"
        self.stub = generation_pb2_grpc.GenerationStub(open_channel(self.target))
        record = self.out / "load.jsonl"
        record.unlink(missing_ok=True)
        load = subprocess.Popen(
            [sys.executable, "-m", "loadtest.chaos", "--load", self.target, "--users", str(self.users),
             "--duration", str(self.duration), "--out", str(record)], cwd=REPOSITORY_ROOT,
        )  # fmt: skip
        started = time.monotonic()
        schedule: list[tuple[float, str, Callable[[], None]]] = [
            (0.15, "kill -9 engine core of A", self.kill_core),
            (0.30, "SIGTERM replica B, then restart it", self.restart_b),
            (0.45, "kill -9 engine core of A", self.kill_core),
            (0.55, "cancellation storm (64 streams)", self.storm),
            (0.65, "KV budget exhausted (8 long prompts)", self.long_prompts),
            (0.75, "kill -9 engine core of A", self.kill_core),
        ]
        threads = []
        for fraction, name, action in schedule:
            time.sleep(max(0.0, started + fraction * self.duration - time.monotonic()))
            self.faults.append((time.time(), name))
            print(f"[chaos] t={time.monotonic() - started:.0f}s {name}", flush=True)
            thread = threading.Thread(target=action)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        load.wait()
        self.records += [json.loads(line) for line in record.read_text().splitlines()]
        self.server_counts["A"] = counters(self.a)
        self.server_counts["B (since its restart)"] = counters(self.b)
        mismatches, checked = self.verify()
        self.proxy.terminate()
        self.a.stop(), self.b.stop()
        return self.summary(mismatches, checked)

    def kill_core(self) -> None:
        core = self.a.engine_core_pid()
        if core is not None:
            os.kill(core, signal.SIGKILL)

    def restart_b(self) -> None:
        self.server_counts["B (at its SIGTERM)"] = counters(self.b)
        self.b.process.send_signal(signal.SIGTERM)
        self.b.process.wait(timeout=120)
        self.b.channel.close()
        self.b = ServerProcess(self.repository, *REPLICA_FLAGS, "--threads", "1", port=self.b.port,
                               metrics_port=self.b.metrics_port).wait_serving()  # fmt: skip

    def _driven(self, requests: list[tuple[pb.GenerateRequest, str, int | None]]) -> None:
        with ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(lambda item: streamed(self.stub, *item), requests))
        with self.lock:
            self.records += results

    def storm(self) -> None:
        rng = random.Random(1)
        self._driven([(load_request(rng), "storm", rng.randint(0, 3)) for _ in range(64)])

    def long_prompts(self) -> None:
        request = pb.GenerateRequest(model=MODEL, prompt=LONG_PROMPT, max_new_tokens=128)
        self._driven([(request, "long prompt", None) for _ in range(8)])

    def verify(self, sample: int = 150) -> tuple[list[dict[str, Any]], int]:
        """Finished load calls run again on replica A, quiet now: those a fault struck, and a sample of the rest."""
        done = [r for r in self.records if r["kind"] == "load" and r["code"] == "OK"]
        struck = [r for r in done if any(r["started"] <= at <= r["ended"] for at, _ in self.faults)]
        rest = [r for r in done if r not in struck]
        chosen = struck + random.Random(0).sample(rest, min(sample, len(rest)))
        stub = generation_pb2_grpc.GenerationStub(self.a.channel)

        def again(record: dict[str, Any]) -> bool:
            request = pb.GenerateRequest(**record["request"])
            return stub.Generate(request, timeout=300).text == record["text"]

        with ThreadPoolExecutor(16) as pool:
            same = list(pool.map(again, chosen))
        return [r for r, ok in zip(chosen, same, strict=True) if not ok], len(chosen)

    def summary(self, mismatches: list[dict[str, Any]], checked: int) -> dict[str, Any]:
        by_kind: dict[str, dict[str, Any]] = {}
        for kind in ("load", "storm", "long prompt"):
            records = [r for r in self.records if r["kind"] == kind]
            accepted = [r for r in records if r["accepted"]]
            by_kind[kind] = {
                "calls": len(records),
                "accepted": len(accepted),
                "finished": sum(r["code"] == "OK" for r in records),
                "accepted, then failed": sum(r["code"] not in ("OK", "CANCELLED (client)") for r in accepted),
                "codes": dict(Counter(r["code"] for r in records)),
                "why accepted calls failed": dict(
                    Counter(r["details"] for r in accepted if r["code"] not in ("OK", "CANCELLED (client)"))
                ),
            }
        return {
            "duration_seconds": self.duration,
            "users": self.users,
            "faults": [name for _, name in self.faults],
            "clients": by_kind,
            "text_checked": checked,
            "text_mismatches": len(mismatches),
            "mismatched": [r["request"] for r in mismatches[:5]],
            "servers": self.server_counts,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=REPOSITORY_ROOT / "model_repository")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--out", type=Path, default=REPOSITORY_ROOT / "out" / "chaos")
    parser.add_argument("--load", metavar="TARGET", help=argparse.SUPPRESS)  # the child: Locust users only
    args = parser.parse_args(argv)
    if args.load:
        run_load(args.load, args.users, args.duration, args.out)
        return 0
    result = Chaos(args.repository, args.out, args.users, args.duration).run()
    (args.out / "summary.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    lost = sum(kind["accepted, then failed"] for kind in result["clients"].values())
    return 0 if lost == 0 and result["text_mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
