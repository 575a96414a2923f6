"""Time to first token and inter-token latency, kept out of Locust's request statistics.

Locust's Aggregated line sums every request event, so TTFT and ITL fired as requests counted each
stream three times and mixed milliseconds between tokens with whole-request seconds. They are
kept here instead: in Locust's own `RequestStats` (the same histograms, percentiles and
worker-to-master merging through the `report_to_master` / `worker_report` events), one per
measure, apart from `environment.stats`. Values are stored in microseconds because Locust keeps
about two significant digits of an integer and an inter-token gap can be shorter than a millisecond.

Shown three ways: a table printed after Locust's own summary when it quits (so `--headless` runs
end with TTFT and ITL percentiles), `<--csv prefix>_token_latency.csv`, and a "Token latency" tab
in the web UI with a CSV download at /token_latency/csv.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from typing import Any

from flask import Response, request
from locust import events
from locust.env import Environment
from locust.runners import WorkerRunner
from locust.stats import PERCENTILES_TO_REPORT, RequestStats, StatsEntry, get_readable_percentiles

MEASURES = {"TTFT": "time to first token", "ITL": "mean gap between a stream's text chunks"}
REPORT_KEY = "posenc_token_latency"  # in the worker -> master report
TAB = "token-latency"
SUMMARY_PERCENTILES = (0.5, 0.95, 0.99)


class TokenLatency:
    """One `RequestStats` per measure; an entry per model plus the measure's own total."""

    def __init__(self) -> None:
        self.stats = {measure: RequestStats(use_response_times_cache=False) for measure in MEASURES}

    def record(self, measure: str, model: str, seconds: float) -> None:
        self.stats[measure].log_request(measure, model, round(seconds * 1e6), 0)

    def reset(self) -> None:
        for stats in self.stats.values():
            stats.reset_all()

    def take_report(self) -> dict[str, Any]:
        """What a worker sends its master; its own figures start again from zero (as Locust's do)."""
        return {
            measure: {"entries": stats.serialize_stats(), "total": stats.total.get_stripped_report()}
            for measure, stats in self.stats.items()
        }

    def merge(self, report: dict[str, Any]) -> None:
        for measure, part in report.items():
            stats = self.stats[measure]
            for data in part["entries"]:
                entry = StatsEntry.unserialize(data, stats)
                stats.entries[(entry.name, entry.method)].extend(entry)
            stats.total.extend(StatsEntry.unserialize(part["total"], stats))

    def rows(self) -> list[dict[str, Any]]:
        """Per measure, each model then all models together; times in milliseconds."""
        rows = []
        for measure, stats in self.stats.items():
            entries = [stats.entries[key] for key in sorted(stats.entries)]
            for name, entry in [(e.name, e) for e in entries] + [("All models", stats.total)]:
                if not entry.num_requests:
                    continue
                row: dict[str, Any] = {
                    "type": measure,
                    "name": name,
                    "count": entry.num_requests,
                    "avg": round(entry.avg_response_time / 1000, 3),
                    "min": round((entry.min_response_time or 0) / 1000, 3),
                    "max": round(entry.max_response_time / 1000, 3),
                }
                for percent in PERCENTILES_TO_REPORT:
                    row[_key(percent)] = round(entry.get_response_time_percentile(percent) / 1000, 3)
                rows.append(row)
        return rows

    def summary(self) -> list[str]:
        """The table printed at the end of a run."""
        rows = self.rows()
        if not rows:
            return ["Token latency: no stream produced a first token"]
        percentiles = _columns(SUMMARY_PERCENTILES)
        header = f"{'Type':<6}{'Name':<28}{'# streams':>10}{'avg':>10}" + "".join(
            f"{label:>10}" for _, label in percentiles
        )
        lines = [
            "Token latency, ms (TTFT: " + MEASURES["TTFT"] + "; ITL: " + MEASURES["ITL"] + ")",
            header + f"{'max':>10}",
            "-" * (len(header) + 10),
        ]
        for row in rows:
            cells = "".join(f"{row[key]:>10.2f}" for key, _ in percentiles)
            lines.append(
                f"{row['type']:<6}{row['name']:<28}{row['count']:>10}{row['avg']:>10.2f}{cells}{row['max']:>10.2f}"
            )
        return lines

    def csv_text(self) -> str:
        percentiles = _columns(PERCENTILES_TO_REPORT)
        columns = ["type", "name", "count", "avg", "min", "max", *(key for key, _ in percentiles)]
        headers = ["Type", "Name", "Count", "Average (ms)", "Min (ms)", "Max (ms)"]
        headers += [f"{label} (ms)" for _, label in percentiles]
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(headers)
        writer.writerows([row[column] for column in columns] for row in self.rows())
        return out.getvalue()


def _key(percent: float) -> str:
    return "p" + f"{percent * 100:g}".replace(".", "_")


def _columns(percents: tuple[float, ...] | list[float]) -> list[tuple[str, str]]:
    """(row key, label) per percentile, e.g. ("p95", "95%")."""
    return [(_key(p), label) for p, label in zip(percents, get_readable_percentiles(list(percents)), strict=True)]


LATENCY = TokenLatency()  # one per Locust process: its users record here
_environment: list[Environment] = []  # the process's environment, kept at init for the quit event


@events.init.add_listener
def _on_init(environment: Environment, **_kwargs: Any) -> None:
    _environment[:] = [environment]
    if environment.web_ui is not None:
        _extend_web_ui(environment)


@events.report_to_master.add_listener
def _on_report_to_master(client_id: str, data: dict[str, Any], **_kwargs: Any) -> None:
    data[REPORT_KEY] = LATENCY.take_report()


@events.worker_report.add_listener
def _on_worker_report(client_id: str, data: dict[str, Any], **_kwargs: Any) -> None:
    if REPORT_KEY in data:
        LATENCY.merge(data[REPORT_KEY])


@events.reset_stats.add_listener
def _on_reset_stats(**_kwargs: Any) -> None:
    LATENCY.reset()


@events.quit.add_listener
def _on_quit(**_kwargs: Any) -> None:
    """After Locust printed its summary: ours below it, and the CSV beside Locust's (not on workers,
    whose figures went to the master)."""
    if not _environment or isinstance(_environment[0].runner, WorkerRunner):
        return
    console = logging.getLogger("locust.stats_logger")  # where Locust prints its own summary
    for line in LATENCY.summary():
        console.info(line)
    console.info("")
    options = _environment[0].parsed_options
    prefix = getattr(options, "csv_prefix", None) if options is not None else None
    if prefix:
        with open(f"{prefix}_token_latency.csv", "w", newline="") as file:
            file.write(LATENCY.csv_text())


def _extend_web_ui(environment: Environment) -> None:
    """A "Token latency" tab and CSV download, through Locust's documented web UI extension points."""
    web_ui = environment.web_ui
    assert web_ui is not None
    structure = [
        {"key": "type", "title": "Type"},
        {"key": "name", "title": "Name"},
        {"key": "count", "title": "# streams"},
    ]
    structure += [{"key": "avg", "title": "Average (ms)"}, {"key": "min", "title": "Min (ms)"}]
    structure += [{"key": key, "title": f"{label} (ms)"} for key, label in _columns(SUMMARY_PERCENTILES)]
    structure += [{"key": "max", "title": "Max (ms)"}]
    web_ui.template_args["extended_tabs"] = [{"title": "Token latency", "key": TAB}]
    web_ui.template_args["extended_tables"] = [{"key": TAB, "structure": structure}]
    web_ui.template_args["extended_csv_files"] = [
        {"href": "./token_latency/csv", "title": "Download time to first token and inter-token latency CSV"}
    ]

    @web_ui.app.after_request
    def _add_token_latency(response: Response) -> Response:
        if request.path == "/stats/requests" and response.is_json:
            body = response.get_json()
            body["extended_stats"] = [{"key": TAB, "data": LATENCY.rows()}]
            response.set_data(json.dumps(body))
        return response

    @web_ui.app.route("/token_latency/csv")
    def _token_latency_csv() -> Response:
        return Response(
            LATENCY.csv_text(), mimetype="text/csv",
            headers={"Content-Disposition": "attachment; filename=token_latency.csv"},
        )  # fmt: skip
