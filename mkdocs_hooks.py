"""MkDocs hook (mkdocs.yml, `hooks:`): the site shows the reference report, its figures and its
report.md, without a copy of them in docs/, so they are always the ones `python -m loadtest.report`
drew.

A page links a figure or the report where the repository keeps them,
`../reports/reference/<name>`, which GitHub renders as it stands; the build adds each figure to the
site as `figures/<name>.png` and the report as the page `reference-report.md`, and points the links
there (MkDocs cannot serve a file from outside docs_dir).
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

REPORT = Path(__file__).parent / "reports" / "reference"
REPORT_PAGE = "reference-report.md"
LINK = re.compile(r"\]\(\.\./reports/reference/([\w.-]+\.png)\)")
REPORT_LINK = re.compile(r"\]\(\.\./reports/reference/report\.md(#[\w-]*)?\)|\]: \.\./reports/reference/report\.md")
# The report's own figure links, beside it in reports/reference/.
OWN_FIGURE = re.compile(r"\]\(([\w.-]+\.png)\)")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for figure in sorted(REPORT.glob("*.png")):
        files.append(File.generated(config, f"figures/{figure.name}", abs_src_path=str(figure)))
    files.append(File.generated(config, REPORT_PAGE, abs_src_path=str(REPORT / "report.md")))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri == REPORT_PAGE:
        return OWN_FIGURE.sub(r"](figures/\1)", markdown)
    markdown = REPORT_LINK.sub(lambda m: m.group(0).replace("../reports/reference/report.md", REPORT_PAGE), markdown)
    return LINK.sub(r"](figures/\1)", markdown)
