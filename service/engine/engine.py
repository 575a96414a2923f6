"""The engine: every model of one repository, each served by its own ModelEngine loop, behind one
submit / score / cancel / stop interface (what the engine core process serves, and what the bench
drives in-process)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from contract.manifest import Manifest, ManifestError
from service.engine.messages import DrainReport, EngineConfig, ErrorKind, GenerateInput, RequestError, Scored
from service.engine.model_engine import ModelEngine
from service.engine.processing.output_processor import OutputBatch
from service.engine.processing.streams import OutputSink
from service.engine.request import Request
from service.engine.worker.store_size import check_kv_budget
from service.metrics import ServiceMetrics

logger = logging.getLogger(__name__)

__all__ = ["Engine", "ModelEngine"]


class Engine:
    """All models of one repository, by name."""

    def __init__(
        self, models: dict[str, ModelEngine], output_sink: Callable[[Request], OutputSink] | None = None
    ) -> None:
        """`output_sink`: where a new request's text goes: its own OutputStream when None (in-process
        readers), or the engine core's per-step collector (service.engine.core)."""
        self.models = models
        self._ids = itertools.count()
        self.output_sink = output_sink

    @classmethod
    def from_repository(
        cls,
        repository: Path,
        config: EngineConfig,
        metrics: ServiceMetrics,
        names: list[str] | None = None,
        output_sink: Callable[[Request], OutputSink] | None = None,
        publish: Callable[[Callable[[OutputBatch], None], OutputBatch], None] | None = None,
    ) -> Engine:
        """Load every model folder (or those named); a bad manifest, file or budget stops the start
        before any session opens. `output_sink` and `publish`: see Engine and ModelEngine."""
        if not repository.is_dir():
            raise ManifestError(f"{repository}: model repository does not exist")
        folders = sorted(p for p in repository.iterdir() if (p / "manifest.json").is_file())
        if names:
            missing = sorted(set(names) - {p.name for p in folders})
            if missing:
                raise ManifestError(f"{repository}: no model folder named {', '.join(missing)}")
            folders = [p for p in folders if p.name in names]
        if not folders:
            raise ManifestError(f"{repository}: no model folders with a manifest.json")
        manifests = [Manifest.load(p) for p in folders]
        if not names:  # the default set: the schemes themselves; scaling variants and further seeds only when named
            variants = [m.folder.name for m in manifests if m.is_scaling_variant]
            if variants:
                logger.info("not serving rope scaling variants %s (name them in --models)", ", ".join(variants))
            seeds = [m.folder.name for m in manifests if m.is_extra_seed]
            if seeds:
                logger.info("not serving further training seeds %s (name them in --models)", ", ".join(seeds))
            manifests = [m for m in manifests if m.served_by_default]
            if not manifests:
                raise ManifestError(
                    f"{repository}: only rope scaling variants and further seeds; name the ones to serve in --models"
                )
        for manifest in manifests:
            check_kv_budget(manifest, config)
        return cls({m.folder.name: ModelEngine(m, config, metrics, publish) for m in manifests}, output_sink)

    def model(self, name: str) -> ModelEngine:
        try:
            return self.models[name]
        except KeyError:
            known = ", ".join(sorted(self.models))
            raise RequestError(ErrorKind.NOT_FOUND, f"model: unknown model {name!r} (serving: {known})") from None

    def submit(self, raw: GenerateInput, request_id: str | None = None) -> Request:
        engine = self.model(raw.model)
        request = engine.inputs.request(raw, request_id or f"{raw.model}-{next(self._ids)}")
        if self.output_sink is not None:
            request.output = self.output_sink(request)
        engine.submit(request)
        return request

    def score(
        self,
        model: str,
        text: str,
        cache_policy: str = "",
        token_ids: list[int] | None = None,
        top: int = 0,
        field: str = "text",
    ) -> Scored:
        """Teacher-forced log-probabilities (and greedy predictions) of the text's tokens after the
        first, each seeing what the cache policy keeps; `token_ids`: the text as ids instead; `top`:
        each position's likeliest tokens too; `field`: what errors call the text (echo's: prompt)."""
        engine = self.model(model)
        ids, policy = engine.inputs.score(text, cache_policy, token_ids, top, field)
        return engine.runner.score(ids, policy, top)

    def cancel(self, request: Request) -> None:
        if request.cancel_time is None and not request.status.finished:
            request.cancel_time = time.monotonic()
        request.cancelled.set()
        self.models[request.model].wake()

    def start(self) -> None:
        for engine in self.models.values():
            engine.start()

    def stop(self, timeout: float) -> DrainReport:
        """Every model drains in parallel; the report adds them up."""
        with ThreadPoolExecutor(max_workers=max(1, len(self.models))) as pool:
            reports = list(pool.map(lambda e: e.stop(timeout), self.models.values()))
        return DrainReport(sum(r.finished for r in reports), sum(r.cut for r in reports))
