"""The Grafana dashboard: its variables, rows and series colours, and every query, with the
variables substituted as Grafana substitutes them, returning data from a real Prometheus scraping
the real service on loopback."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from contract.paths import REPOSITORY_ROOT
from loadtest.palette import DASHBOARD, grafana_overrides
from service.api import generation_pb2 as pb
from service.process import ServerProcess, free_port

PROMETHEUS_CONFIG = REPOSITORY_ROOT / "deploy" / "prometheus" / "prometheus.yml"
VARIABLES = ("scheme", "model", "instance", "policy")
ROWS = ("Latency", "Memory", "Load and admission", "Replicas", "Speculation")
# Policies the test sends (one per form the label can take), and the form each is counted under.
POLICIES = {"": "full", "window:64": "window", "sinks:4+window:60": "sinks", "int8": "int8",
            "window:64+int8": "window+int8", "sinks:4+window:60+int8": "sinks+int8"}  # fmt: skip
# The series labelled by cache-policy form (service/metrics.py; the service tests check the labels).
POLICY_METRICS = ("posenc_time_to_first_token", "posenc_inter_token_latency", "posenc_generated_tokens",
                  "posenc_prompt_tokens", "posenc_kv_cache_used", "posenc_requests_shed",
                  "posenc_speculative_proposed_tokens", "posenc_speculative_accepted_tokens")  # fmt: skip
Tool = Callable[[str], str]


def dashboard() -> dict:  # type: ignore[type-arg]
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:  # type: ignore[type-arg]
    return [panel for panel in dashboard()["panels"] if panel["type"] != "row"]


def queries() -> list[str]:
    return [target["expr"] for panel in panels() for target in panel["targets"]]


def variables() -> dict[str, dict]:  # type: ignore[type-arg]
    return {variable["name"]: variable for variable in dashboard()["templating"]["list"]}


def regex_escape(value: str) -> str:
    """Grafana's prometheusSpecialRegexEscape: a multi-value variable's value inside `=~"..."`
    (the backslash doubled, since the regex sits in a PromQL string)."""
    return re.sub(r"([\\^$*+?.()|\[\]{}])", r"\\\\\1", value)


def interpolate(expr: str, chosen: dict[str, list[str] | None]) -> str:
    """`$name` as Grafana writes it for a multi-value, include-All variable: All (None) is its
    allValue, one value is escaped, several are `(a|b)`."""
    defined = variables()

    def value(name: str) -> str:
        picked = chosen.get(name)
        if picked is None:
            return str(defined[name]["allValue"])
        escaped = [regex_escape(v) for v in picked]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"

    return re.sub(r"\$(\w+)", lambda m: value(m.group(1)), expr)


def test_dashboard_has_a_variable_per_question_and_uses_them_in_every_query() -> None:
    defined = variables()
    assert list(defined) == list(VARIABLES)
    for variable in defined.values():
        assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*", variable["name"]
        assert variable["query"]["query"].startswith("label_values("), variable["name"]
    for expr in queries():
        assert 'model=~"$model"' in expr or expr.startswith("sum(up{"), expr
        assert 'instance=~"$instance"' in expr, expr
        # Where a series carries `policy`, the query filters by it, in every selector of the query.
        for selector in re.findall(r"(posenc_[a-z_]+)\{([^}]*)\}", expr):
            labelled = selector[0].startswith(POLICY_METRICS)
            assert ('policy=~"$policy"' in selector[1]) == labelled, (expr, selector)


def test_dashboard_rows_answer_one_question_each() -> None:
    rows = [panel for panel in dashboard()["panels"] if panel["type"] == "row"]
    assert [row["title"].split(":")[0] for row in rows] == list(ROWS)
    assert dashboard()["panels"][0]["type"] == "row"  # every panel sits under a row
    ids = [panel["id"] for panel in dashboard()["panels"]]
    assert len(ids) == len(set(ids))


def test_series_colours_are_the_palette_s() -> None:
    """Panels whose legends start with the model carry the palette's overrides, exactly
    (`python -m loadtest.palette` writes them); the others are per replica or per method."""
    expected = grafana_overrides()
    for panel in panels():
        legends = [target["legendFormat"] for target in panel["targets"]]
        by_model = all(legend.startswith("{{model}}") for legend in legends)
        assert panel["fieldConfig"]["overrides"] == (expected if by_model else []), panel["title"]


def test_dashboard_only_queries_metrics_the_service_defines() -> None:
    defined = (REPOSITORY_ROOT / "service" / "metrics.py").read_text()
    for expr in queries():
        for metric in re.findall(r"posenc_[a-z_]+", expr):
            base = re.sub(r"_(bucket|sum|count|total)$", "", metric)
            assert f'"{base}"' in defined, metric


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(repository, "--models", "alibi", "rope").wait_serving()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def prometheus(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory, tool: Tool) -> Iterator[int]:
    """The shipped Prometheus config, its DNS discovery swapped for the loopback replica; its port."""
    path = tool("prometheus")
    folder = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    (job,) = config["scrape_configs"]
    del job["dns_sd_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{server.metrics_port}"]}]
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen(
        [path, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for i in range(8):  # traffic under every policy form across several scrapes, so rates have two points
            for model in ("alibi", "rope"):
                for policy in POLICIES:
                    request = pb.GenerateRequest(model=model, prompt=f"def f{i}():\n", max_new_tokens=8,
                                                 cache_policy=policy)  # fmt: skip
                    server.stub.Generate(request, timeout=30)
            time.sleep(0.5)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def _get(port: int, path: str, params: list[tuple[str, str]]) -> object:
    url = f"http://127.0.0.1:{port}{path}?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", (path, params, body)
    return body["data"]


def label_values(port: int, query: str, chosen: dict[str, list[str] | None]) -> list[str]:
    """A `label_values(selector, label)` variable resolved as Grafana does: the series API's label
    values for the selector, after substituting the variables it depends on."""
    match = re.fullmatch(r"label_values\((?P<selector>.+), (?P<label>\w+)\)", interpolate(query, chosen))
    assert match, query
    data = _get(port, f"/api/v1/label/{match['label']}/values", [("match[]", match["selector"])])
    return sorted(data)  # type: ignore[arg-type]


def test_every_variable_lists_what_the_service_serves(prometheus: int, server: ServerProcess) -> None:
    defined = variables()
    everything: dict[str, list[str] | None] = dict.fromkeys(VARIABLES)

    def values() -> dict[str, list[str]]:
        return {name: label_values(prometheus, v["query"]["query"], everything) for name, v in defined.items()}

    expected = {
        "scheme": ["alibi", "rope"],
        "model": ["alibi", "rope"],
        "instance": [f"127.0.0.1:{server.metrics_port}"],
        "policy": sorted(POLICIES.values()),
    }
    # Until every variable has its values: the first scrape may land between two of the queries.
    deadline = time.monotonic() + 60
    while (found := values()) != expected and time.monotonic() < deadline:
        time.sleep(1)
    assert found == expected
    # A chained variable follows its parent: model given scheme=alibi.
    assert label_values(prometheus, defined["model"]["query"]["query"], {**everything, "scheme": ["alibi"]}) == [
        "alibi"
    ]


def test_every_dashboard_query_returns_data_from_real_prometheus(prometheus: int, server: ServerProcess) -> None:
    """Each query under several variable choices: All, one value of each (with regex characters to
    escape: `window+int8`, the instance's dots), and several at once."""
    instance = f"127.0.0.1:{server.metrics_port}"
    choices: list[dict[str, list[str] | None]] = [
        dict.fromkeys(VARIABLES),
        {"scheme": ["rope"], "model": ["rope"], "instance": [instance], "policy": ["window+int8"]},
        {"scheme": ["alibi", "rope"], "model": ["alibi"], "instance": None, "policy": ["sinks", "full"]},
        {"scheme": None, "model": None, "instance": [instance], "policy": ["sinks+int8"]},
    ]

    def query(expr: str) -> list[object]:
        return _get(prometheus, "/api/v1/query", [("query", expr)])["result"]  # type: ignore[index]

    for chosen in choices:
        deadline = time.monotonic() + 60
        missing = [interpolate(expr, chosen) for expr in queries()]
        while missing and time.monotonic() < deadline:
            missing = [expr for expr in missing if not query(expr)]
            time.sleep(1)
        assert not missing, f"queries without data for {chosen}: {missing}"
    # A value no series has selects nothing: the filters do filter.
    (expr,) = [e for e in queries() if "posenc_generated_tokens_total" in e]
    assert not query(interpolate(expr, {**dict.fromkeys(VARIABLES), "policy": ["window:64"]}))
