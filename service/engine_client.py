"""The front end's handle on the engine core process (service.engine.core): start it, pass requests
in, route each step's outputs to the requests' streams, and notice when it dies. It speaks only
service.engine.messages, so the front end loads neither onnxruntime nor the engine.

gRPC threads call `submit`, `cancel` and `score`; one reader thread receives every event the
core sends; one watcher thread waits on the core's process. When the core dies unexpectedly,
health turns NOT_SERVING and a new core is started, unless cores keep dying (then the server
exits non-zero for its supervisor to act). Accepted generations survive it: each handle keeps its
input and every token id the core sent, and is resubmitted to the new core with those tokens
(`Add.produced`), so its stream goes on where its client is, with no byte twice or missing, and
greedy and seeded text equal to an uninterrupted run's. One that cannot be resumed (it died with
its core too often, the new core refuses it, or no core comes back) ends with UNAVAILABLE and a
message saying why (never a hang). Calls not yet accepted (an Add not yet answered, a score) end
with UNAVAILABLE at once: nothing of them had started, so a client may retry them.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from service.core_process import RestartWindow, end_process, exit_cause, spawn_core
from service.engine.messages import (
    Add,
    Cancel,
    DrainReport,
    EngineConfig,
    ErrorKind,
    Event,
    Failed,
    GenerateInput,
    MessageWriter,
    MetricsQuery,
    MetricsReply,
    ModelInfo,
    Outputs,
    Ready,
    Reply,
    RequestError,
    RequestStatus,
    Score,
    Scored,
    ScoreReply,
    Stop,
    Stopped,
    read_messages,
)
from service.engine.processing.fields import FieldLimits, check_fields
from service.engine.processing.streams import OutputStream
from service.quota import TenantQuota
from service.request_handle import RequestHandle, ResumeObserver

logger = logging.getLogger(__name__)

READY_TIMEOUT_SECONDS = 600.0  # loading every model (sessions, budgets) on a slow machine
CALL_TIMEOUT_SECONDS = 60.0  # a reply to ADD or METRICS; SCORE waits as long as the RPC may
RESUMES_ALLOWED = 2  # core deaths one request survives; at the next it ends with UNAVAILABLE


class EngineStartError(RuntimeError):
    """The core could not load the models (bad manifest, file or budget): the server refuses to start."""


class EngineClient:
    """The engine core behind a small in-process interface (the servicer's `engine`)."""

    def __init__(
        self,
        repository: Path,
        config: EngineConfig,
        names: list[str] | None = None,
        on_serving: Callable[[bool], None] = lambda serving: None,
        on_give_up: Callable[[str], None] = lambda reason: None,
        resume: ResumeObserver | None = None,
        quota: TenantQuota | None = None,
    ) -> None:
        """`quota`: each tenant's limits and counters (service.quota; None: no limits, not counted)."""
        self.repository, self.config, self.names = repository, config, names
        self.quota = quota
        self.on_serving, self.on_give_up = on_serving, on_give_up
        self.resume = resume or ResumeObserver()
        self.models: dict[str, ModelInfo] = {}  # what ListModels answers, from the core
        self._commands: MessageWriter | None = None  # the running core's command pipe (used under _send_lock)
        self._send_lock = threading.Lock()
        self._handles: dict[str, RequestHandle] = {}
        self._calls: dict[str | int, Future[Event]] = {}
        self._call_ids = itertools.count()
        self._ids = itertools.count()
        self._ready: Future[dict[str, ModelInfo]] = Future()
        self._stopped: Future[DrainReport] = Future()
        self._process: subprocess.Popen[bytes] | None = None
        self._serving = False
        self._stopping = False
        self._taken_while_stopping: list[RequestHandle] = []  # the drain's report counts them too
        self._restarts = RestartWindow()
        self.restarts = 0
        self._reader: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        """Start the core and wait until its models are loaded; EngineStartError if it cannot load them."""
        self._spawn()
        try:
            self._await_ready(timeout)
        except EngineStartError:
            self._stopping = True
            self.stop(0)
            raise
        self._serve()
        threading.Thread(target=self._watch, name="engine-watch", daemon=True).start()

    def _spawn(self) -> None:
        """A new core with a new pair of pipes, and a reader thread for its events."""
        core = spawn_core(self.repository, self.config, self.names)
        old, self._commands = self._commands, core.commands
        if old is not None:
            os.close(old.fd)
        self._process = core.process
        self._reader = threading.Thread(
            target=self._read_events, args=(core.events_fd,), name="engine-events", daemon=True
        )
        self._reader.start()

    def _await_ready(self, timeout: float) -> None:
        assert self._process is not None
        deadline = time.monotonic() + timeout
        while not self._ready.done():
            if self._process.poll() is not None and not self._ready.done():
                time.sleep(0.2)  # its FAILED message may still be in flight
                if not self._ready.done():
                    raise EngineStartError(f"engine core exited with code {self._process.returncode} while loading")
            if time.monotonic() > deadline:
                raise EngineStartError(f"engine core did not load the models within {timeout:.0f} s")
            time.sleep(0.05)
        self.models = self._ready.result()  # raises EngineStartError for FAILED

    def _serve(self) -> None:
        self._serving = True
        self.on_serving(True)

    def _watch(self) -> None:
        """Wait for the core to exit; an exit that was not asked for restarts it, resumes the
        accepted requests on the new one and fails the calls that were not accepted yet."""
        while True:
            process = self._process
            assert process is not None
            code = process.wait()
            if self._stopping:
                return
            died = time.monotonic()
            self._serving = False
            self.on_serving(False)
            if self._reader is not None:
                self._reader.join(5)  # every event it sent before dying is applied (its pipe ends at its exit)
            cause = exit_cause(code)
            kept = self._keep_for_resume(cause, died)
            logger.error("%s; %d request(s) in flight will resume on a new core", cause, len(kept))
            reason = self._restarts.give_up(time.monotonic())
            if reason is not None:
                self._not_resumed(kept, f"{cause}; {reason}: not resumed, retry it")
                self.on_give_up(reason)
                return
            self._ready = Future()
            try:
                self._spawn()
                self._await_ready(READY_TIMEOUT_SECONDS)
            except EngineStartError as error:
                self._not_resumed(kept, f"{cause}; the engine core could not be restarted: not resumed, retry it")
                self.on_give_up(f"the engine core could not be restarted: {error}")
                return
            self._resume(kept, cause)
            self._serve()
            self.restarts += 1
            logger.info("engine core restarted (restart %d)", self.restarts)

    def _keep_for_resume(self, cause: str, died: float) -> list[RequestHandle]:
        """The accepted requests to resume (oldest first); calls in flight and requests that have
        already died with RESUMES_ALLOWED cores end now with UNAVAILABLE."""
        calls, self._calls = self._calls, {}
        for future in calls.values():  # an Add not answered yet was not accepted: its submit fails
            if not future.done():
                future.set_exception(RequestError(ErrorKind.UNAVAILABLE, f"{cause}; the request was lost, retry it"))
        kept = []
        for handle in sorted(list(self._handles.values()), key=lambda h: h.arrival_time):
            if not handle.accepted or handle.input is None:
                continue  # its submit is failing (above): it removes the handle
            if handle.resumes >= RESUMES_ALLOWED:
                self._not_resumed(
                    [handle], f"{cause}; the request ran on {handle.resumes + 1} engine cores that died: not resumed"
                )
                continue
            handle.stalled_since = handle.stalled_since or died
            kept.append(handle)
        return kept

    def _resume(self, kept: list[RequestHandle], cause: str) -> None:
        """Each kept request on the new core, with the tokens it had produced; one the core refuses
        (it no longer fits, say) ends with UNAVAILABLE and the core's reason."""
        for handle in kept:
            if handle.status.finished:
                continue
            if handle.cancelled:
                self._handles.pop(handle.request_id, None)
                handle.finish(RequestStatus.FINISHED_CANCELLED, "cancelled")
                continue
            assert handle.input is not None
            handle.resumes += 1
            try:
                reply = self._call(
                    handle.request_id, Add(handle.request_id, handle.input, handle.token_ids), CALL_TIMEOUT_SECONDS
                )
            except RequestError as error:
                self._not_resumed([handle], f"{cause}; the request could not be resumed: {error.message}")
                continue
            assert isinstance(reply, Reply)
            if reply.refusal is not None:
                self._not_resumed([handle], f"{cause}; the request could not be resumed: {reply.refusal.message}")
                continue
            self.resume.resumed()
            logger.info("resumed %s after %d token(s)", handle.request_id, len(handle.token_ids))

    def _not_resumed(self, handles: list[RequestHandle], message: str) -> None:
        for handle in handles:
            self._handles.pop(handle.request_id, None)
            if not handle.status.finished:
                handle.finish(RequestStatus.FINISHED_SHUTDOWN, message)
                self.resume.not_resumed()

    def _fail_everything(self, message: str) -> None:
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.finish(RequestStatus.FINISHED_SHUTDOWN, message)
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(RequestError(ErrorKind.UNAVAILABLE, message))

    def stop(self, timeout: float, until: threading.Event | None = None) -> DrainReport:
        """Drain: running requests finish within `timeout`, and new ones are still taken until `until`
        is set (the front end has ended every call it accepted), then the core cuts the rest and exits."""
        self._stopping = True
        in_flight = dict(self._handles)  # by id: a submit racing this line may also be in the list below
        deadline = time.monotonic() + timeout

        def busy() -> bool:
            return (until is not None and not until.is_set()) or any(not h.done.is_set() for h in self._running())

        while self._serving and time.monotonic() < deadline and busy():
            time.sleep(0.02)
        in_flight |= {handle.request_id: handle for handle in self._taken_while_stopping}
        self._serving = False
        process = self._process
        report = DrainReport()
        if process is not None and process.poll() is None:
            try:
                if self._ready.done() and self._ready.exception() is None:  # it serves: let it drain
                    self._send(Stop(max(0.0, deadline - time.monotonic())))
                    self._stopped.result(timeout + 30)
                    cut = sum(1 for h in in_flight.values() if h.status is RequestStatus.FINISHED_SHUTDOWN)
                    report = DrainReport(len(in_flight) - cut, cut)
            except RequestError:
                pass  # it is not there to hear it
            except FutureTimeout:
                logger.error("engine core did not stop within %.0f s; killing it", timeout + 30)
            end_process(process)
        self._fail_everything("server shut down")
        if self._reader is not None:
            self._reader.join(2)  # ends at the core's exit (end of its events pipe)
        with self._send_lock:
            if self._commands is not None:
                os.close(self._commands.fd)
                self._commands = None
        return report

    def _running(self) -> list[RequestHandle]:
        return list(self._handles.values())  # a copy: other threads add and remove handles

    @property
    def serving(self) -> bool:
        return self._serving

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # ------------------------------------------------------------------ requests

    def _send(self, command: Add | Cancel | Score | MetricsQuery | Stop) -> None:
        """One command down the pipe; with no core there (it died, or stopped) it fails at once."""
        with self._send_lock:
            try:
                if self._commands is None:
                    raise BrokenPipeError
                self._commands.send(command)
            except (BrokenPipeError, OSError):
                raise RequestError(ErrorKind.UNAVAILABLE, "engine core is not running") from None

    def _call(self, key: str | int, command: Add | Score | MetricsQuery, timeout: float) -> Event:
        future: Future[Event] = Future()
        self._calls[key] = future
        try:
            self._send(command)
        except RequestError:
            self._calls.pop(key, None)
            raise
        try:
            return future.result(timeout)
        except FutureTimeout:
            self._calls.pop(key, None)
            raise RequestError(ErrorKind.UNAVAILABLE, f"engine core did not answer within {timeout:.0f} s") from None

    def _check_serving(self) -> None:
        if not self._serving:
            raise RequestError(ErrorKind.UNAVAILABLE, "engine core is not serving (starting, restarting or stopping)")

    def submit(self, raw: GenerateInput, output: OutputStream | None = None) -> RequestHandle:
        """`output`: where the request's text goes (an asynchronous front end passes its own kind).
        Prompt log-probabilities (`prompt_logprobs`, OpenAI's echo) are computed first, by scoring
        the whole prompt teacher-forced through the request's cache policy (Score's path), so every
        prompt token has its own however much of the prompt the prefix cache or a reused segment
        would give the generation; max_new_tokens 0 asks for them alone (no generation)."""
        self._check_serving()
        info = self.models.get(raw.model)
        if info is not None:  # the one check of every field, before any work (an unknown model: NOT_FOUND below)
            check_fields(raw, FieldLimits.of(info))
        request_id = f"{raw.model}-{next(self._ids)}"
        handle = RequestHandle(request_id, raw.model, raw, output=output or OutputStream())
        if raw.prompt_logprobs is not None:
            self._score_prompt(handle, raw)
            if raw.max_new_tokens == 0:
                handle.accepted = True
                handle.prompt_tokens = len(handle.prompt_ids)
                handle.finish(RequestStatus.FINISHED_LENGTH, None)
                return handle
        self._hold_quota(handle, raw)
        self._handles[request_id] = handle
        try:
            reply = self._call(request_id, Add(request_id, raw), CALL_TIMEOUT_SECONDS)
            assert isinstance(reply, Reply)
            if reply.refusal is not None:
                raise reply.refusal.error()
        except RequestError as error:
            self._handles.pop(request_id, None)
            self._refused(handle, error)
            raise
        if self._stopping:
            self._taken_while_stopping.append(handle)
        return handle

    def _hold_quota(self, handle: RequestHandle, raw: GenerateInput) -> None:
        """The tenant's place for this request (service.quota), given back when it ends; or its refusal."""
        if self.quota is None:
            return
        info = self.models.get(raw.model)
        prompt = len(raw.prompt_ids) or (len(info.prompt_ids(raw.prompt)) if info else len(raw.prompt.encode()))
        new = self.config.default_max_new_tokens if raw.max_new_tokens is None else raw.max_new_tokens
        labels = {"model": raw.model, "scheme": info.scheme} if info else {}
        ticket = self.quota.acquire(raw.tenant, prompt + new, labels)
        quota = self.quota
        handle.quota_labels = ticket.labels

        def release(ended: RequestHandle) -> None:
            queued = None if ended.scheduled_time is None else max(0.0, ended.scheduled_time - ended.arrival_time)
            quota.release(ticket, ended.prompt_tokens, ended.completion_tokens, queued)

        handle.on_finish = release

    def _refused(self, handle: RequestHandle, error: RequestError) -> None:
        """Not accepted: its quota comes back, and the refusal is counted for its tenant."""
        if self.quota is None or handle.on_finish is None:
            return
        reason = error.message.partition(":")[0] if error.kind is ErrorKind.RESOURCE_EXHAUSTED else "invalid"
        if error.kind is ErrorKind.UNAVAILABLE:
            reason = "unavailable"
        reason = reason if reason in ("ttft_slo", "queue", "invalid") else "unavailable"
        self.quota.refused(handle.quota_labels, reason)
        handle.on_finish(handle)  # nothing used

    def cancel(self, handle: RequestHandle) -> None:
        if not handle.status.finished:
            handle.cancelled = True  # not resumed if its core died
            try:
                self._send(Cancel(handle.request_id))
            except RequestError:
                pass  # no core: the request ends when the next one would have resumed it (or now, at a stop)

    def _score_prompt(self, handle: RequestHandle, raw: GenerateInput) -> None:
        """The prompt's log-probabilities into `handle` (None for its first token), or the refusal."""
        info = self.models.get(raw.model)
        if info is None:
            self.score(raw.model, raw.prompt or " ")  # the core's NOT_FOUND, worded as every call's
            return
        ids = list(raw.prompt_ids) or info.prompt_ids(raw.prompt)
        scored = self.score(
            raw.model, raw.prompt, raw.cache_policy, ids=list(raw.prompt_ids), top=raw.prompt_logprobs or 0,
            field="prompt",
        )  # fmt: skip
        handle.prompt_ids, handle.prompt_logprobs = ids, [None, *scored.token_logprobs(ids)]

    def score(
        self,
        model: str,
        text: str,
        cache_policy: str = "",
        timeout: float | None = None,
        ids: list[int] | None = None,
        top: int = 0,
        field: str = "text",
    ) -> Scored:
        """Teacher-forced log-probabilities of a text (or token ids) after its first token; `top`: each
        position's likeliest tokens too; `field`: what an error calls the text."""
        self._check_serving()
        call = next(self._call_ids)
        command = Score(call, model, text, cache_policy, ids or [], top, field)
        reply = self._call(call, command, min(timeout or 3600.0, 3600.0))
        assert isinstance(reply, ScoreReply)
        if reply.refusal is not None:
            raise reply.refusal.error()
        return reply.scored()

    def metrics_text(self, timeout: float = 5.0) -> bytes | None:
        """The core's /metrics exposition, or None when it is not there to answer."""
        if self._process is None or self._process.poll() is not None:
            return None
        call = next(self._call_ids)
        try:
            reply = self._call(call, MetricsQuery(call), timeout)
        except RequestError:
            return None
        assert isinstance(reply, MetricsReply)
        return reply.exposition

    # ------------------------------------------------------------------ events

    def _read_events(self, fd: int) -> None:
        """One core's events, until it exits (the end of its pipe)."""
        try:
            for event in read_messages(fd, Event):
                self._dispatch(event)
        finally:
            os.close(fd)

    def _dispatch(self, event: Event) -> None:
        if isinstance(event, Outputs):
            handles = self._handles
            for entry in event.entries:
                status = entry.status
                handle = handles.get(entry.request_id) if status is None else handles.pop(entry.request_id, None)
                if handle is not None:
                    if entry.token_ids:
                        handle.token_ids += entry.token_ids
                        handle.first_token_time = handle.first_token_time or time.monotonic()
                        if handle.stalled_since is not None:  # resumed: its first token since its core died
                            self.resume.first_token(time.monotonic() - handle.stalled_since)
                            handle.stalled_since = None
                    handle.receive(entry.text, status, entry.error, entry.final, entry.logprobs)
        elif isinstance(event, Reply | ScoreReply | MetricsReply):
            if isinstance(event, Reply) and event.refusal is None and event.request_id in self._handles:
                self._handles[event.request_id].accepted = True  # before its submit (or resume) learns it
            future = self._calls.pop(event.request_id if isinstance(event, Reply) else event.call, None)
            if future is not None and not future.done():
                future.set_result(event)
        elif isinstance(event, Ready):
            self._ready.set_result({info.name: info for info in event.models})
        elif isinstance(event, Failed):
            self._ready.set_exception(EngineStartError(event.message))
        elif isinstance(event, Stopped):
            self._stopped.set_result(DrainReport(event.finished, event.cut))
