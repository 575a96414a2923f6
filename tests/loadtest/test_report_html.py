"""report.html in a real headless Chromium (Debian's package): the reference report's page, and one
written from it, show every figure; a screenshot is kept as an artifact (out/report-html.png)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from contract.paths import REPOSITORY_ROOT
from loadtest.report.html import write_html

REFERENCE = REPOSITORY_ROOT / "reports" / "reference"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
# Written into the body once the page has loaded: whether each image decoded (a broken one has no width).
PROBE = (
    "<script>window.addEventListener('load', () => document.body.setAttribute('data-images', "
    "JSON.stringify([...document.images].map(i => i.complete && i.naturalWidth > 0))));</script>"
)


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs it)")
        pytest.skip("chromium not installed (apt-get install chromium chromium-driver)")
    return path


def loaded_images(page: Path, profile: Path) -> list[bool]:
    """Each image's load state as Chromium saw it, from the page's DOM after its load event."""
    probe = page.with_name(page.stem + ".probe.html")
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    dom = subprocess.run(
        [chromium(), *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    found = re.search(r'data-images="([^"]*)"', dom)
    assert found, f"the page never finished loading: {dom[-500:]}"
    return json.loads(found.group(1).replace("&quot;", '"'))


@pytest.mark.server  # runs Chromium
def test_the_reference_report_renders_with_every_figure(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    shutil.copy(REFERENCE / "report.html", page)  # the committed page, alone: its figures are embedded
    images = loaded_images(page, tmp_path / "profile")
    figures = len(re.findall(r"!\[[^\]]*\]\([^)]+\.png\)", (REFERENCE / "report.md").read_text()))
    assert len(images) == figures > 0 and all(images), images
    artifacts = REPOSITORY_ROOT / "out"
    artifacts.mkdir(exist_ok=True)
    screenshot = artifacts / "report-html.png"
    subprocess.run(
        [chromium(), *FLAGS, f"--user-data-dir={tmp_path / 'shot'}", "--window-size=1280,2400",
         f"--screenshot={screenshot}", page.as_uri()],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    assert screenshot.stat().st_size > 10_000


@pytest.mark.server  # runs Chromium
def test_write_html_embeds_what_the_markdown_shows_and_leaves_broken_links_visible(tmp_path: Path) -> None:
    shutil.copy(REFERENCE / "kv_bytes.png", tmp_path / "kv_bytes.png")
    report = tmp_path / "report.md"
    report.write_text("# A report\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n![kv](kv_bytes.png)\n\n![missing](gone.png)\n")
    page = write_html(report)
    html = page.read_text()
    assert "<table>" in html and "data:image/png;base64," in html and 'src="gone.png"' in html
    assert loaded_images(page, tmp_path / "profile") == [True, False]


def test_the_reference_report_opens_with_its_findings_and_a_narrow_headline() -> None:
    text = (REFERENCE / "report.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[:2] == ["## Findings", "## Headline"]
    headline = text.split("## Headline", 1)[1].strip().splitlines()[0]
    assert headline.count("|") - 1 <= 8  # columns
    assert "Rerun:" not in text.split("## Appendix", 1)[0]  # the rerun history is in the appendix
