"""report.html: the report as one self-contained page, written next to report.md by the same
command. Markdown becomes HTML through Python-Markdown (tables, code blocks, heading anchors), and
each figure is embedded as a data URI, so the page can be mailed or opened offline as one file."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import markdown

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 76rem; margin: 2rem auto; padding: 0 1rem; line-height: 1.45; }
table { border-collapse: collapse; margin: 1rem 0; font-size: 0.9rem; display: block; overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
img { max-width: 100%; height: auto; }
code { background: #f6f6f6; padding: 0 0.2rem; }
pre { background: #f6f6f6; padding: 0.5rem; overflow-x: auto; }
"""


def embed_images(html: str, folder: Path) -> str:
    """Every <img src="name.png"> that lies in `folder` becomes a data URI (others are left as they are)."""

    def inline(match: re.Match[str]) -> str:
        path = folder / match.group(2)
        if not path.is_file():
            return match.group(0)
        data = base64.b64encode(path.read_bytes()).decode()
        return f'{match.group(1)}data:image/png;base64,{data}"'

    return re.sub(r'(<img[^>]*?src=")([^":]+\.png)"', inline, html)


def write_html(report: Path) -> Path:
    """report.html beside `report` (a report.md), its figures embedded."""
    body = markdown.markdown(report.read_text(), extensions=["tables", "fenced_code", "toc"])
    title = report.read_text().splitlines()[0].lstrip("# ").strip()
    page = (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{title}</title>\n'
        f"<style>{STYLE}</style>\n</head>\n<body>\n{embed_images(body, report.parent)}\n</body>\n</html>\n"
    )
    out = report.with_suffix(".html")
    out.write_text(page)
    return out
