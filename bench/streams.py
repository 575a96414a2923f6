"""Reading a stream of text as a measurement: token arrivals, decode rate, medians of runs."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator

from service.api import generation_pb2 as pb
from service.engine.request import Request
from service.request_handle import RequestHandle


def median_of(measure: Callable[[], float], runs: int = 3) -> float:
    """Median of `runs` measurements that produced a figure (NaN: the run could not be measured)."""
    figures = [figure for figure in (measure() for _ in range(runs)) if not math.isnan(figure)]
    return statistics.median(figures) if figures else math.nan


def token_arrivals(texts: Iterable[str], each: Callable[[int], None] = lambda chunks: None) -> list[tuple[float, int]]:
    """(arrival time, tokens received so far) per chunk of streamed text; `each(chunks so far)`
    runs after every chunk. A chunk may merge several steps when the reader falls behind; the
    tokenizer is byte-level, so a chunk's bytes are its tokens."""
    arrivals, count = [], 0
    for text in texts:
        count += len(text.encode())
        arrivals.append((time.perf_counter(), count))
        each(len(arrivals))
    return arrivals


def decode_rate(arrivals: list[tuple[float, int]]) -> float:
    """Tokens/s from the first chunk to the last: decode steps only (the first token is the prefill's).
    NaN when the reader got everything in one chunk (it was descheduled for the whole run)."""
    (first, first_count), (last, last_count) = arrivals[0], arrivals[-1]
    return (last_count - first_count) / (last - first) if last > first else math.nan


def stream_texts(stream: Iterator[pb.GenerateStreamResponse]) -> Iterator[str]:
    return (chunk.text for chunk in stream)


def output_texts(request: Request | RequestHandle) -> Iterator[str]:
    """A request's streamed text read from its output stream, as the gRPC servicer reads it."""
    while True:
        event = request.output.get(timeout=10)
        if event is not None:
            yield event.text
            if event.status.finished:
                return
