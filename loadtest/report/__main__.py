"""Redraw a comparison's report from its results.json: `python -m loadtest.report reports/<run-id>`."""

from __future__ import annotations

import sys
from pathlib import Path

from loadtest.report.document import write_report


def main(argv: list[str] | None = None) -> int:
    folder = Path((sys.argv[1:] if argv is None else argv)[0])
    print(write_report(folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
