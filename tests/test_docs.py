"""The documentation site: MkDocs builds it strictly (a broken link or a page left out of the nav
fails), every page is in the nav, and none is over about 400 lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from contract.paths import REPOSITORY_ROOT

DOCS = REPOSITORY_ROOT / "docs"
MAX_LINES = 400


def nav_pages(nav: list[object]) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [str(value)]
    return pages


@pytest.mark.server  # runs a subprocess
def test_mkdocs_builds_the_site_strictly(tmp_path: Path) -> None:
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPOSITORY_ROOT, capture_output=True, text=True, env=environment,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "speculative" / "index.html").is_file()


def test_every_page_is_in_the_nav_and_short_enough() -> None:
    config = yaml.safe_load((REPOSITORY_ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    pages = sorted(path.name for path in DOCS.glob("*.md"))
    assert sorted(listed) == pages
    for page in pages:
        lines = len((DOCS / page).read_text().splitlines())
        assert lines <= MAX_LINES, f"docs/{page}: {lines} lines (split it)"


def test_the_readme_is_short_and_cites_no_commit() -> None:
    text = (REPOSITORY_ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"\b[0-9a-f]{7,40}\b", text), "the README cites a commit hash"
