"""The positional-encoding comparison's measurements, taken through the running service.

`python -m loadtest.compare` runs them (budget.py: how much; serving.py: the servers; timed.py:
latency and load; scored.py: quality and retrieval; cache_budget.py: bounded caches) into the
typed results of results.py, which `python -m loadtest.report` writes up.
"""
