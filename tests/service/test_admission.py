"""Admission control's estimate and refusal rule (pure logic; the server-level test is in test_operability.py)."""

from __future__ import annotations

import pytest

from service.engine.admission import AdmissionControl, Backlog
from service.engine.errors import ErrorKind, RequestError
from service.engine.request import Request, SamplingParams


def request(prompt_tokens: int, max_new_tokens: int = 10, generated: int = 0) -> Request:
    made = Request("r", "alibi", list(range(prompt_tokens)), SamplingParams(max_new_tokens), eos_token_id=-1)
    made.output_ids = list(range(generated))
    return made


def test_backlog_counts_prompts_not_yet_computed_and_steps_left() -> None:
    waiting = [request(100), request(50)]
    running = [request(30, 10, generated=0), request(40, 10, generated=7), request(20, 5, generated=1)]
    backlog = Backlog.of(waiting, running)
    assert backlog.prompt_tokens == 100 + 50 + 30  # the running one without a first token is still in prefill
    assert backlog.waiting == 2
    assert backlog.running_steps_left == (3, 4, 10)


def test_nothing_is_refused_until_prefill_is_measured_or_when_off() -> None:
    backlog = Backlog(prompt_tokens=10**6, waiting=100)
    AdmissionControl(0.5, 8).check(request(100), backlog, 0, 0, "alibi")  # not measured yet
    off = AdmissionControl(0.0, 8)
    off.observe_prefill(1.0, 1000)
    off.check(request(100), backlog, 0, 0, "alibi")


def test_a_request_that_would_miss_the_target_is_refused_with_a_hint() -> None:
    admission = AdmissionControl(0.5, 8)
    admission.observe_prefill(1.0, 1000)  # 1000 tokens/s
    admission.check(request(100), Backlog(prompt_tokens=300), 0, 0, "alibi")  # 0.3 + 0.1 s: admitted
    with pytest.raises(RequestError) as refused:
        admission.check(request(100), Backlog(prompt_tokens=300), 200, 2, "alibi")  # 0.5 + 0.1 s
    assert refused.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert refused.value.retry_after == pytest.approx(0.1)
    assert "--ttft-slo-seconds" in refused.value.message and "alibi" in refused.value.message


def test_a_full_batch_makes_a_request_wait_for_the_soonest_ending_sequence() -> None:
    admission = AdmissionControl(0.5, max_batch_size=2)
    admission.observe_prefill(1.0, 10**6)  # prompts are free here: only the row matters
    admission.observe_decode(0.01)
    full = Backlog(prompt_tokens=0, waiting=0, running_steps_left=(30, 80))
    assert admission.wait_seconds(full, 0, 0) == pytest.approx(0.30)
    behind_one = Backlog(prompt_tokens=0, waiting=1, running_steps_left=(30, 80))
    assert admission.wait_seconds(behind_one, 0, 0) == pytest.approx(0.80)
    with pytest.raises(RequestError):
        admission.check(request(10), Backlog(0, 2, (30, 80)), 0, 0, "alibi")  # a second round: 0.8 + 0.3 s
    room = Backlog(prompt_tokens=0, waiting=0, running_steps_left=(30,))
    assert admission.wait_seconds(room, 0, 0) == 0.0


def test_a_request_with_nothing_ahead_is_admitted_however_long_its_prompt() -> None:
    admission = AdmissionControl(0.1, 8)
    admission.observe_prefill(1.0, 100)
    admission.check(request(4000), Backlog(), 0, 0, "alibi")
