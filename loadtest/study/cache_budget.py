"""The cache-budget comparison: what each scheme keeps of its quality when its KV cache is bounded.

Measured through the service, per scheme and cache policy (contract/cache_policy.py):
- bits per byte on held-out text at 2x-8x the training context, the text streaming through the
  policy (each byte scored seeing only what the cache keeps, as StreamingLLM evaluates), under
  budgets of 64-256 tokens for `window` and `sinks` (4 sinks), and `full`;
- graded retrieval probes (copy over distance, passkey) under the same policies;
- `int8` K/V against full precision, where the model offers it;
- the cost: KV bytes per sequence as /metrics reports them allocated, and the inter-token
  latency at 2048 tokens of history.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from contract.cache_policy import FORM_SYNTAX, parse_cache_policy
from loadtest.probes import Scorer, copy_text, passkey_text
from loadtest.study.results import CacheBudget, Cell, Cells
from service.api import generation_pb2 as pb
from service.process import ServerProcess

SINKS = 4
COST_HISTORY = 2048  # tokens of history at which decode latency is measured
COST_NEW_TOKENS = 32
FULL = "full"


@dataclass(frozen=True)
class CacheBudgetPlan:
    budgets: tuple[int, ...]  # tokens the cache may hold
    multiples: tuple[float, ...]  # text lengths, in training contexts
    windows: int  # held-out texts per bpb cell
    trials: int  # probes per retrieval cell
    copy_distances: tuple[int, ...]  # bytes between the two copies
    passkey_context: float  # in training contexts
    int8_multiples: tuple[float, ...]


def policies_for(budgets: tuple[int, ...]) -> list[str]:
    """full, then per budget B: window:B and sinks:4+window:(B-4) (the same bytes)."""
    out = [FULL]
    for budget in budgets:
        out += [f"window:{budget}", f"sinks:{SINKS}+window:{budget - SINKS}"]
    return out


def policy_budget(policy: str) -> int | None:
    """Tokens a policy string's cache holds (None: full)."""
    text = policy.removesuffix("+int8")
    if text in (FULL, "int8"):
        return None
    if text.startswith("sinks:"):
        sinks, window = text.removeprefix("sinks:").split("+window:")
        return int(sinks) + int(window)
    return int(text.removeprefix("window:"))


def offers_int8(info: pb.ModelInfo) -> bool:
    return any("int8" in form for form in info.cache_policies)


def serves(info: pb.ModelInfo, policy: str) -> bool:
    """Whether the model accepts the policy's form (ListModels lists them: a hybrid refuses windows
    on top of its own, and int8 where its export reads no int8 local columns)."""
    return FORM_SYNTAX[parse_cache_policy(policy).form] in info.cache_policies


def score_bpb(server: ServerProcess, model: str, texts: list[str], policy: str = "") -> float | None:
    """Bits per byte over the texts, streamed through `policy` (empty: the model's default;
    None: not servable)."""
    total, count = 0.0, 0
    for text in texts:
        request = pb.ScoreRequest(model=model, text=text, cache_policy=policy)
        try:
            response = server.stub.Score(request, timeout=600)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                return None
            raise
        total += response.total_logprob
        count += response.tokens
    return -total / count / np.log(2)


def measure_cost(server: ServerProcess, model: str, prompt: str, policy: str) -> dict[str, float] | None:
    """One stream at COST_HISTORY tokens of history, alone on the server: the most KV bytes
    /metrics shows allocated while it runs, and the time per token after the first (chunks may
    carry several tokens when the client falls behind: one token is one byte)."""
    request = pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=COST_NEW_TOKENS, cache_policy=policy)
    arrivals: list[tuple[float, int]] = []  # (time, tokens so far)
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                peak[0] = max(peak[0], server.metric("posenc_kv_cache_physical_bytes", model=model))
            except Exception:  # a scrape racing the server is not a result
                pass
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tokens = 0
    try:
        for chunk in server.stub.GenerateStream(request, timeout=600):
            if chunk.text:
                tokens += len(chunk.text.encode())
                arrivals.append((time.perf_counter(), tokens))
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return None
        raise
    finally:
        done.set()
        sampler.join()
    if len(arrivals) < 2:
        return {"kv_physical_bytes": peak[0], "itl_s": float("nan")}
    (first_time, first_tokens), (last_time, last_tokens) = arrivals[0], arrivals[-1]
    return {"kv_physical_bytes": peak[0], "itl_s": (last_time - first_time) / max(1, last_tokens - first_tokens)}


def measure_cache_budgets(
    server: ServerProcess,
    model: str,
    info: pb.ModelInfo,
    text: Callable[[int], str],
    windows: Callable[[int, int], list[str]],
    plan: CacheBudgetPlan,
) -> CacheBudget:
    """Every policy's bpb, retrieval and cost for one served model (None cells: not servable)."""
    limit, context = info.max_positions, info.train_context
    policies = policies_for(plan.budgets)
    rng = random.Random(11)
    bpb: dict[str, dict[str, float | None]] = {}
    for multiple in plan.multiples:
        texts = windows(int(multiple * context), plan.windows)
        for policy in policies:
            bpb.setdefault(policy, {})[f"{multiple:g}"] = score_bpb(server, model, texts, policy)
    retrieval: dict[str, Cells] = {}
    copy_probes = {d: [copy_text(text, rng, 64, d) for _ in range(plan.trials)] for d in plan.copy_distances}
    passkey_length = int(plan.passkey_context * context)
    passkeys = [passkey_text(text, rng, passkey_length) for _ in range(plan.trials)]
    for policy in policies:
        if not serves(info, policy):  # refused by the model: its cells are not servable
            retrieval[policy] = {**{f"copy@{d}": None for d in plan.copy_distances}, f"passkey@{passkey_length}": None}
            continue
        scorer = Scorer(server.stub, model, limit, cache_policy=policy)
        cells: Cells = {f"copy@{d}": scorer.accuracy(copy_probes[d]) for d in plan.copy_distances}
        cells[f"passkey@{passkey_length}"] = scorer.accuracy(passkeys)
        retrieval[policy] = cells
    int8: dict[str, dict[str, float | Cell | None]] = {}
    cost_policies = list(policies)
    if offers_int8(info):
        for policy in ("int8", f"window:{plan.budgets[-1]}+int8"):
            if not serves(info, policy):
                continue
            int8[policy] = {
                f"{m:g}": score_bpb(server, model, windows(int(m * context), plan.windows), policy)
                for m in plan.int8_multiples
            }
            scorer = Scorer(server.stub, model, limit, cache_policy=policy)
            int8[policy].update({f"copy@{d}": scorer.accuracy(copy_probes[d]) for d in plan.copy_distances})
        int8[FULL] = {
            f"{m:g}": score_bpb(server, model, windows(int(m * context), plan.windows), FULL)
            for m in plan.int8_multiples
        }
        cost_policies += list(int8)
    prompt = text(COST_HISTORY - COST_NEW_TOKENS)
    cost = {policy: measure_cost(server, model, prompt, policy) for policy in dict.fromkeys(cost_policies)
            if serves(info, policy)}  # fmt: skip
    return {
        "policies": policies,
        "bytes_per_token": info.kv_cache_bytes_per_token,
        "bpb": bpb,
        "retrieval": retrieval,
        "int8": int8,
        "cost": cost,
    }
