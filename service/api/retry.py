"""The retry hint every API gives a refused request: where it travels and how far it may reach.

A load-shedding refusal (gRPC RESOURCE_EXHAUSTED) carries the seconds after which the same request
would likely be accepted, as trailing metadata `retry-after-ms` (milliseconds). Clients (the
project's own, the Locust users, the comparison harness) read it from here too.
"""

from __future__ import annotations

RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of load-shedding refusals: milliseconds
MIN_RETRY_AFTER_SECONDS = 0.05
MAX_RETRY_AFTER_SECONDS = 5.0  # a hint past this says little: the load will have changed by then
