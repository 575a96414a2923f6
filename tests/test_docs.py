"""The documentation site: MkDocs builds it strictly (a broken link or a page left out of the nav
fails) with the reference report's figures, every page is in the nav, none is over about 400 lines,
and no code block is wider than the page shows."""

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
MAX_CODE_COLUMNS = 100  # what the site's code blocks show without a scroll bar
MIN_FIGURES = 3


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
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    images = re.findall(r'<img [^>]*src="\.\./figures/([\w.-]+\.png)"', reference)
    assert len(images) >= MIN_FIGURES and all((tmp_path / "site" / "figures" / name).is_file() for name in images)


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


def code_block_lines(text: str) -> list[str]:
    """The lines inside fenced code blocks (``` or ~~~)."""
    lines, fence = [], None
    for line in text.splitlines():
        marker = line.lstrip()[:3]
        if marker in ("```", "~~~") and (fence is None or marker == fence):
            fence = None if fence else marker
        elif fence:
            lines.append(line)
    return lines


def test_no_code_block_line_is_wider_than_the_page() -> None:
    wide = [
        f"docs/{page.name}: {len(line)} columns: {line[:60]}..."
        for page in sorted(DOCS.glob("*.md"))
        for line in code_block_lines(page.read_text())
        if len(line) > MAX_CODE_COLUMNS
    ]
    assert wide == []


def test_the_figures_the_docs_show_are_the_reference_report_s() -> None:
    """Pages link figures where the report keeps them (mkdocs_hooks.py serves them): each must exist,
    and the reference page shows at least three."""
    linked = {page.name: re.findall(r"\]\(\.\./reports/reference/([\w.-]+\.png)\)", page.read_text())
              for page in DOCS.glob("*.md")}  # fmt: skip
    assert len(linked["reference.md"]) >= MIN_FIGURES
    missing = [name for names in linked.values() for name in names
               if not (REPOSITORY_ROOT / "reports" / "reference" / name).is_file()]  # fmt: skip
    assert missing == []
