"""Every posenc.v1.Generation RPC counted exactly once, with the status code its client saw.

A server interceptor, outermost, so it sees what no handler does: requests whose bytes do not
decode (answered INVALID_ARGUMENT here, naming the field, instead of gRPC's INTERNAL "Exception
deserializing request!" and a logged traceback), calls the token check refuses, streams the
client cancels at a yield (the handler's generator is closed without returning), and deadlines
that pass while the handler waits (the engine sees a cancel; the client sees DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import empty_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from service.metrics import ServiceMetrics

Labels = Callable[[str], dict[str, str]]  # model name -> {"model", "scheme"} labels
LENGTH_DELIMITED = 2  # protobuf wire type of strings, bytes and messages


@dataclass(frozen=True)
class UndecodableRequest:
    """Stands in for a request whose bytes did not decode; the handler is never called with it."""

    message: str


def tolerant_deserializer(message_class: type[Message]) -> Callable[[bytes], Message | UndecodableRequest]:
    def deserialize(data: bytes) -> Message | UndecodableRequest:
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            return UndecodableRequest(describe_undecodable(message_class, data, error))

    return deserialize


def describe_undecodable(message_class: type[Message], data: bytes, error: Exception) -> str:
    """Name the field when a string field is not valid UTF-8 (the usual cause), else say what failed."""
    name = message_class.DESCRIPTOR.full_name
    probe = empty_pb2.Empty()
    try:
        probe.ParseFromString(data)  # every field lands in the unknown set, undecoded
    except DecodeError:
        return f"request: not a valid {name} message (malformed protobuf bytes)"
    fields = message_class.DESCRIPTOR.fields_by_number
    for unknown in UnknownFieldSet(probe):
        field = fields.get(unknown.field_number)
        if field is None or field.type != FieldDescriptor.TYPE_STRING or unknown.wire_type != LENGTH_DELIMITED:
            continue
        raw = bytes(unknown.data)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            return (
                f"{field.name}: not valid UTF-8 (byte {bad.start} of the field is {raw[bad.start]:#04x}); "
                "protobuf string fields must be UTF-8 text"
            )
    return f"request: not a valid {name} message ({error})"


class RequestAccounting(grpc.ServerInterceptor):
    """Counts `posenc_requests_total{method,code,api="grpc"}` and `posenc_request_duration_seconds` per RPC."""

    def __init__(self, service_name: str, metrics: ServiceMetrics, labels: Labels) -> None:
        self._prefix = f"/{service_name}/"
        self._metrics = metrics
        self._labels = labels

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:  # fmt: skip
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        method = handler_call_details.method.removeprefix(self._prefix)
        deserializer = handler.request_deserializer
        message_class = getattr(deserializer, "__self__", None)  # the generated Message.FromString
        if isinstance(message_class, type) and issubclass(message_class, Message):
            deserializer = tolerant_deserializer(message_class)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method), deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method), deserializer, handler.response_serializer
            )
        return handler  # no client-streaming RPCs in this service

    def _unary(self, behavior: Callable[[Any, grpc.ServicerContext], Any], method: str) -> Callable[..., Any]:
        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            with self._counting(request, method, context):
                return behavior(request, context)

        return counted

    def _stream(
        self, behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]], method: str
    ) -> Callable[..., Iterator[Any]]:
        def counted(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with self._counting(request, method, context):
                yield from behavior(request, context)

        return counted

    @contextmanager
    def _counting(self, request: Any, method: str, context: grpc.ServicerContext) -> Iterator[None]:
        """Around one handler: refuse undecodable bytes, then record the code the call ended with.

        A stream the client cancels while its handler is suspended at a yield ends without the
        handler ever resuming (its generator is closed only when collected), so the call's
        termination callback records it then; whichever comes first counts, once."""
        once = _Once(lambda code: self._record(request, method, _client_saw(code, context), started))
        started, code = time.monotonic(), grpc.StatusCode.UNKNOWN
        context.add_callback(lambda: once(grpc.StatusCode.CANCELLED) if not context.is_active() else None)
        try:
            if isinstance(request, UndecodableRequest):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            yield
            code = context.code() or grpc.StatusCode.OK
        except GeneratorExit:  # a stream closed at a yield: the client cancelled or its deadline passed
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:  # context.abort() raises after setting the code
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        finally:
            once(code)

    def _record(self, request: Any, method: str, code: grpc.StatusCode, started: float) -> None:
        model = "" if isinstance(request, UndecodableRequest) else str(getattr(request, "model", ""))
        labels = self._labels(model)
        self._metrics.requests.labels(**labels, method=method, code=code.name, api="grpc").inc()
        self._metrics.request_duration.labels(**labels, method=method, api="grpc").observe(time.monotonic() - started)


class _Once:
    """Calls `record` with the first code it is given; later calls do nothing (thread-safe)."""

    def __init__(self, record: Callable[[grpc.StatusCode], None]) -> None:
        self._record = record
        self._lock = threading.Lock()
        self._done = False

    def __call__(self, code: grpc.StatusCode) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._record(code)


# The client's deadline timer fires before the server's copy of it (the server's runs from when the
# call arrived): a call the client ends this close to its deadline ended by the deadline.
DEADLINE_SLACK_SECONDS = 0.1


def _client_saw(code: grpc.StatusCode, context: grpc.ServicerContext) -> grpc.StatusCode:
    """When the call already ended on the client's side, the client saw its own ending, not ours."""
    if context.is_active():
        return code
    remaining = context.time_remaining()
    if remaining is not None and remaining <= DEADLINE_SLACK_SECONDS:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED
