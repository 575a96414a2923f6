"""Redraw a comparison's report from its results.json: `python -m loadtest.report reports/<run-id>`;
`--readme-table` prints the README's findings table from it instead."""

from __future__ import annotations

import argparse
from pathlib import Path

from contract.cli import HelpFormatter
from loadtest.report.document import write_report
from loadtest.report.readme import readme_table
from loadtest.study.results import Results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.report", description=__doc__,
                                     formatter_class=HelpFormatter)  # fmt: skip
    parser.add_argument("folder", type=Path, help="the report folder, holding results.json")
    parser.add_argument("--readme-table", action="store_true", help="print the README's findings table and stop")
    args = parser.parse_args(argv)
    if args.readme_table:
        print(readme_table(Results.read(args.folder / "results.json")), end="")
    else:
        print(write_report(args.folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
