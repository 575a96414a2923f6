"""Locust with this project's locustfile: `python -m loadtest [locust options]`.

The same run as `locust -f loadtest/locustfile.py ...`, but its `--help` lists the scenario
options too. Locust 2.47 answers `--help` before it imports any locustfile (locust issue #2917),
so options a locustfile adds never appear there; importing `loadtest.scenario` first registers
them before Locust builds its parser.
"""

from __future__ import annotations

import sys
from pathlib import Path

from locust.main import main as locust_main

import loadtest.scenario  # noqa: F401  (registers the scenario options)

LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not any(arg in ("-f", "--locustfile") or arg.startswith("--locustfile=") for arg in args):
        args = ["-f", str(LOCUSTFILE), *args]
    sys.argv = ["python -m loadtest", *args]  # Locust reads sys.argv itself
    return locust_main()


if __name__ == "__main__":
    sys.exit(main())
