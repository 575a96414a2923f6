"""Load against the running service, from two sides that share only a timed stream (streaming.py)
and the colours (palette.py).

The Locust load test, for any deployment:
    locustfile.py     the gRPC user (`locust -f loadtest/locustfile.py`; images and compose use this path)
    __main__.py       `python -m loadtest`: the same Locust, its --help listing the scenario options
    scenario.py       the scenario options; token_latency.py: time to first token and between tokens
    soak.py           `python -m loadtest.soak`: Locust at high concurrency, watching server memory

The positional-encoding comparison, one server per scheme on this machine:
    compare.py        `python -m loadtest.compare [--quick]`: measures every section into results.json
    study/            its measurements: budget, servers, latency and load, scored sections, results
    probes.py         the graded retrieval probes it scores
    report/           `python -m loadtest.report DIR`: report.md and the figures from results.json
"""
