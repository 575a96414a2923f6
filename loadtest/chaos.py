"""Chaos run: Locust load through nginx on two replicas while faults are injected on a schedule.

    python -m loadtest.chaos --repository model_repository --duration 180 --users 32 --out out/chaos

Faults (at fixed fractions of --duration): kill -9 of replica A's engine core three times; SIGTERM
of replica B and its restart on the same ports; a client cancellation storm; the KV budget
exhausted by long prompts. Everything is measured from the outside: each call's outcome as its
client saw it (accepted: a first message arrived; finished; failed, by code), the replicas'
/metrics (requests by code, resumed requests, restarts), and text mismatches: every finished
load request that was running while a fault struck, and a sample of the others, is run again on
a quiet replica and its text compared (greedy and seeded requests are deterministic).

The servers' counts are complete: a replica that is stopped (B at its SIGTERM, both at the end)
is scraped once its drain has finished (`posenc_drained 1`; `--final-scrape-seconds` keeps its
/metrics up for that scrape), and its counts before and after a restart are summed, as
Prometheus' `increase()` sums a counter across a reset. They must equal the clients' counts:
streams finished, streams the clients cancelled, and accepted streams lost
(`posenc_resume_failures_total`).

The Locust users run in a child process (`--load`: gevent), this process drives the faults.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
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
from loadtest.proxy import Proxy
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.channel import open_channel
from service.process import ServerProcess, wait_for

MODEL = "alibi"
PROMPTS = ["def main():\n", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):\n",
           "for i in range(10):\n", "# Utilities for the", "x = "]  # fmt: skip
REPLICA_FLAGS = (
    "--models", MODEL, "--kv-cache-bytes", str(24 << 20), "--max-sequence-tokens", "2048",
    "--grace-seconds", "30", "--drain-delay-seconds", "1", "--final-scrape-seconds", "30",
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
            if cancel_after is not None and len(text) > cancel_after and not chunk.finish_reason:
                # cancel() is False when the call had already ended: then it ended as the server said.
                code = "CANCELLED (client)" if call.cancel() else call.code().name
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


COUNTED = ("posenc_resumed_requests_total", "posenc_resume_failures_total", "posenc_engine_restarts_total")


def counters(exposition: str) -> dict[str, float]:
    """A replica's own counts from its /metrics: GenerateStream calls by code, resumes, restarts."""
    found: dict[str, float] = {}
    for line in exposition.splitlines():
        name, value = line.partition("{")[0].partition(" ")[0], line.rpartition(" ")[2]
        if name == "posenc_requests_total" and 'method="GenerateStream"' in line:
            code = line.partition('code="')[2].partition('"')[0]
            found[f"GenerateStream {code}"] = found.get(f"GenerateStream {code}", 0) + float(value)
        elif name in COUNTED:
            found[name] = float(value)
    return found


def drain_and_count(replica: ServerProcess, timeout: float = 120.0) -> dict[str, float] | None:
    """SIGTERM, then the replica's final counts: the scrape that says it has drained (the last one
    it waits for before it exits); None if none came."""
    replica.process.send_signal(signal.SIGTERM)
    final: list[dict[str, float]] = []

    def drained() -> bool:
        try:
            text = replica.metrics()
        except OSError:
            return replica.process.poll() is not None  # gone without a final scrape
        if "posenc_drained 1.0" in text.splitlines():
            final.append(counters(text))
        return bool(final)

    wait_for(drained, timeout=timeout, interval=0.1)
    replica.process.wait(timeout=timeout)
    replica.channel.close()
    return final[0] if final else None


def summed(parts: list[dict[str, float] | None]) -> dict[str, float]:
    """Counts summed over a replica's lives (a restart resets its counters)."""
    total: dict[str, float] = {}
    for part in parts:
        for key, value in (part or {}).items():
            total[key] = total.get(key, 0) + value
    return total


def compared_counts(records: list[dict[str, Any]], servers: dict[str, float]) -> dict[str, dict[str, float]]:
    """What the clients counted beside what the servers counted, for what both can see: streams
    finished, streams the clients cancelled, accepted streams lost. (Refused attempts are not
    compared: a client's retry policy turns a refusal into a call served elsewhere, and a call
    nginx could not place never reached a server.)"""
    codes = Counter(r["code"] for r in records)
    lost = sum(r["accepted"] and r["code"] not in ("OK", "CANCELLED (client)") for r in records)
    return {
        "finished (OK)": {"clients": codes["OK"], "servers": servers.get("GenerateStream OK", 0)},
        "cancelled by the client": {
            "clients": codes["CANCELLED (client)"],
            "servers": servers.get("GenerateStream CANCELLED", 0),
        },
        "accepted, then lost": {"clients": lost, "servers": servers.get("posenc_resume_failures_total", 0)},
    }


class Chaos:
    def __init__(self, repository: Path, out: Path, users: int, duration: float) -> None:
        self.repository, self.out, self.users, self.duration = repository, out, users, duration
        self.records: list[dict[str, Any]] = []
        self.faults: list[tuple[float, str]] = []
        self.server_counts: dict[str, dict[str, float] | None] = {}
        self.lock = threading.Lock()

    def run(self) -> dict[str, Any]:
        self.out.mkdir(parents=True, exist_ok=True)
        nginx = shutil.which("nginx")
        if nginx is None:
            raise SystemExit("nginx is not installed (apt-get install nginx)")
        self.a, self.b = ServerProcess(self.repository, *REPLICA_FLAGS), ServerProcess(self.repository, *REPLICA_FLAGS)
        self.a.wait_serving(), self.b.wait_serving()
        replicas = (self.a, self.b)
        http = [replica.http_url.removeprefix("http://") for replica in replicas]
        self.proxy = Proxy(nginx, self.out / "nginx", [replica.target for replica in replicas], http)
        self.target = self.proxy.target
        self.stub = self.proxy.stub
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
        mismatches, checked = self.verify()  # unary Generate calls: not among the GenerateStream counts
        self.server_counts["A"] = drain_and_count(self.a)
        self.server_counts["B (after its restart)"] = drain_and_count(self.b)
        self.proxy.stop()
        return self.summary(mismatches, checked)

    def kill_core(self) -> None:
        core = self.a.engine_core_pid()
        if core is not None:
            os.kill(core, signal.SIGKILL)

    def restart_b(self) -> None:
        self.server_counts["B (before its restart)"] = drain_and_count(self.b)
        self.b = ServerProcess(
            self.repository, *REPLICA_FLAGS, port=self.b.port, metrics_port=self.b.metrics_port,
            http_port=self.b.http_port,
        ).wait_serving()  # fmt: skip

    def _driven(self, requests: list[tuple[pb.GenerateRequest, str, int | None]]) -> None:
        with ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(lambda item: streamed(self.stub, *item), requests))
        with self.lock:
            self.records += results

    def storm(self) -> None:
        """Streams cancelled after 1-4 chunks; each runs far longer than that (1000 tokens, EOS ignored)."""
        rng = random.Random(1)
        requests = []
        for _ in range(64):
            request = load_request(rng)
            request.max_new_tokens, request.ignore_eos = 1000, True
            requests.append((request, "storm", rng.randint(0, 3)))
        self._driven(requests)

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
        complete = all(counts is not None for counts in self.server_counts.values())
        servers = summed(list(self.server_counts.values()))
        compared = compared_counts(self.records, servers)
        equal = complete and all(pair["clients"] == pair["servers"] for pair in compared.values())
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
            "servers, summed over replicas and restarts": servers,
            "counts (clients, servers)": compared,
            "server counts equal client counts": equal,
        }


def verdict(result: dict[str, Any]) -> tuple[list[str], bool]:
    """The run's closing lines, and whether it passed: no accepted stream lost, no text mismatch,
    and the servers' counts equal to the clients'."""
    lost = sum(kind["accepted, then failed"] for kind in result["clients"].values())
    equal = result["server counts equal client counts"]
    pairs = ", ".join(
        f"{name} {pair['clients']:g} {'==' if pair['clients'] == pair['servers'] else '!='} {pair['servers']:g}"
        for name, pair in result["counts (clients, servers)"].items()
    )
    missing = [name for name, counts in result["servers"].items() if counts is None]
    lines = [
        f"[chaos] server counts {'==' if equal else '!='} client counts: {pairs}"
        + (f" (no final scrape of {', '.join(missing)})" if missing else ""),
        f"[chaos] accepted streams lost: {lost}; text mismatches: {result['text_mismatches']} of "
        f"{result['text_checked']} rerun",
    ]
    return lines, lost == 0 and result["text_mismatches"] == 0 and equal


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
    lines, passed = verdict(result)
    print("\n".join(lines))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
