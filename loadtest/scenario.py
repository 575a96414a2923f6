"""The load test's scenario options, registered with Locust once per process.

They live outside the locustfile for two reasons: `python -m loadtest` must register them before
Locust parses `--help` (Locust answers `--help` before it imports any locustfile), and a module
imported by name is registered once even when Locust imports the locustfile again by path.
Every option also reads a LOCUST_* environment variable (docker-compose.yml passes them so).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from locust import events
from locust.argument_parser import LocustArgumentParser

from loadtest.sse import DEFAULT_HTTP_PORT

LOAD_SHAPES = ("steady", "step", "poisson")
APIS = ("grpc", "http", "both")


def _option(group: Any, flag: str, default: Any, text: str, **kwargs: Any) -> None:
    """One scenario option: its environment variable is LOCUST_ and the flag in capitals. The help
    names its default literally, because the web UI shows the help text unformatted."""
    env_var = "LOCUST_" + flag.removeprefix("--").replace("-", "_").upper()
    help_text = f"{text} [env {env_var}] (default: {default!r})"
    action = group.add_argument(flag, default=default, env_var=env_var, help=help_text, **kwargs)
    # A group's add_argument is argparse's, not LocustArgumentParser's, which marks the options it
    # adds for the web UI's custom parameters; mark ours the same way so the UI offers them too.
    action.include_in_web_ui = True


@events.init_command_line_parser.add_listener
def add_scenario_options(parser: LocustArgumentParser, **_kwargs: Any) -> None:
    group = parser.add_argument_group(
        "posenc-serve scenario", "What each user sends. Prompts are cut from the corpus's held-out (test) split."
    )
    _option(group, "--models", "", "model mix, e.g. alibi:2,rope:1; empty: every model ListModels returns, equally")
    _option(group, "--prompt-bytes", "64,256,1024", "prompt lengths: one of a list (64,256,1024) or uniform:LOW:HIGH")
    _option(group, "--max-new-tokens", 64, "tokens to generate per request", type=int)
    _option(group, "--temperature", 0.0, "sampling temperature (0: greedy)", type=float)
    _option(group, "--top-p", 1.0, "nucleus sampling mass", type=float)
    _option(
        group, "--load-shape", "steady", "steady: -u users throughout; step: --step-users more every --step-seconds; "
        "poisson: waits that make arrivals Poisson at --target-rps", choices=LOAD_SHAPES,
    )  # fmt: skip
    _option(group, "--target-rps", 4.0, "arrivals per second, all users together (poisson shape)", type=float)
    _option(group, "--step-users", 8, "users added per step (step shape)", type=int)
    _option(group, "--step-seconds", 30.0, "seconds per step (step shape)", type=float)
    _option(group, "--request-timeout", 120.0, "deadline of each request, seconds", type=float)
    _option(group, "--ignore-eos", False, "generate exactly --max-new-tokens (the model's end-of-text does not stop)",
            action="store_true")  # fmt: skip
    _option(group, "--api", "grpc", "which front end the users call (grpc, http, both: half the users each); "
            "naming user classes on the command line overrides it", choices=APIS)  # fmt: skip
    _option(group, "--http-host", "", "base URL of the OpenAI-compatible HTTP API; empty: --host if it is a URL, "
            f"else http://<--host's name>:{DEFAULT_HTTP_PORT}")  # fmt: skip
    _option(
        group, "--cancel-fraction", 0.0,
        "share of streams the client cancels after a few chunks (reported as 'Cancelled <model>')", type=float,
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


def prompt_length_sampler(text: str) -> Callable[[random.Random], int]:
    """`64,256,1024` picks one of the values; `uniform:LOW:HIGH` draws between them."""
    if text.startswith("uniform:"):
        _, low, high = text.split(":")
        return lambda rng: rng.randint(int(low), int(high))
    choices = [int(v) for v in text.split(",")]
    return lambda rng: rng.choice(choices)
