"""The report's copy-probe chance comes from the alphabet the run planted spans from, not a typed
number: a run written before results recorded it planted lowercase letters and digits; a new run,
the reference's retrieval included, records models.spans' alphabet."""

from __future__ import annotations

import dataclasses
import json

from contract.paths import REPOSITORY_ROOT
from loadtest.report.tables import what_each_scheme_buys
from loadtest.study.results import Results
from models.spans import SPAN_ALPHABET, SPAN_CHANCE

REFERENCE_RESULTS = REPOSITORY_ROOT / "reports" / "reference" / "results.json"


def test_a_run_without_a_recorded_alphabet_reads_as_the_legacy_one() -> None:
    data = json.loads(REFERENCE_RESULTS.read_text())
    del data["span_alphabet"]  # as results.json was written before it recorded one
    results = Results.from_dict(data)
    assert len(results.span_alphabet) == 36 and results.span_chance == 1 / 36
    assert "above chance (1/36 per character)" in what_each_scheme_buys(results)


def test_a_new_run_states_the_chance_of_the_alphabet_it_recorded() -> None:
    results = dataclasses.replace(Results.read(REFERENCE_RESULTS), span_alphabet=SPAN_ALPHABET)
    assert results.span_chance == SPAN_CHANCE
    assert f"above chance (1/{len(SPAN_ALPHABET)} per character)" in what_each_scheme_buys(results)
