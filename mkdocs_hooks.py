"""MkDocs hook (mkdocs.yml, `hooks:`): the site shows the reference report's figures without a copy
of them in docs/, so they are always the ones `python -m loadtest.report` drew.

A page links a figure where the repository keeps it, `../reports/reference/<name>.png`, which GitHub
renders as it stands; the build adds each figure to the site as `figures/<name>.png` and points the
link there (MkDocs cannot serve a file from outside docs_dir).
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

REPORT = Path(__file__).parent / "reports" / "reference"
LINK = re.compile(r"\]\(\.\./reports/reference/([\w.-]+\.png)\)")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for figure in sorted(REPORT.glob("*.png")):
        files.append(File.generated(config, f"figures/{figure.name}", abs_src_path=str(figure)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    return LINK.sub(r"](figures/\1)", markdown)
