"""What each engine step teaches admission control and the step metrics: prefill and decode step
times and batch sizes, and each first token against the time admission estimated for it."""

from __future__ import annotations

from service.engine.model_metrics import ModelMetrics
from service.engine.request import Request
from service.engine.sched.admission import AdmissionControl


class StepObserver:
    """One model's step observations, fed to its metrics and its admission control."""

    def __init__(self, metrics: ModelMetrics, admission: AdmissionControl) -> None:
        self.metrics, self.admission = metrics, admission

    def prefill(self, seconds: float, batch: int, tokens: int) -> None:
        self.metrics.step_seconds["prefill"].observe(seconds)
        self.metrics.batch_size["prefill"].observe(batch)
        self.admission.observe_prefill(seconds, tokens)

    def decode_step(self, step: tuple[float, int]) -> None:
        seconds, batch = step
        self.metrics.step_seconds["decode"].observe(seconds)
        self.admission.observe_decode(seconds)
        self.metrics.batch_size["decode"].observe(batch)

    def first_tokens(self, requests: list[Request]) -> None:
        """Admission learns from each first token: the drain rate, and its estimate against what happened."""
        for request in requests:
            if request.first_token_time is None:
                continue  # its sampling failed
            realised = request.first_token_time - request.arrival_time
            estimate = request.admission_estimate
            self.admission.observe_first_token(request.request_id, estimate, realised)
            if estimate is not None:
                self.metrics.estimated_ttft.observe(estimate.seconds)
                self.metrics.estimate_error.observe(realised - estimate.seconds)
