"""The training-step benchmark runs every variant and prints a ratio to `before` for each."""

from __future__ import annotations

import pytest

from models.train_bench import main


def test_every_variant_is_timed_against_before(capsys: pytest.CaptureFixture[str]) -> None:
    main(
        ["--scheme", "alibi", "--threads", "1", "--batch-size", "2", "--context", "16", "--steps", "1", "--rounds", "1"]
    )
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row[:24].strip() for row in rows] == ["before", "fused AdamW", "fused attention", "both (models.train)"]
    assert rows[0].split()[-1] == "1.00" and all(float(row.split()[-1]) > 0 for row in rows)
