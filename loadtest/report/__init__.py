"""Tables and plots from a comparison's results.json: `python -m loadtest.report reports/<run-id>`.

Everything is drawn from results.json (loaded as loadtest/study/results.py's `Results`), so a
report can be redrawn without measuring again. document.py writes report.md in order from the
tables (tables.py, cache_tables.py) and figures (figures.py, cache_figures.py); analysis.py holds
the conclusions they draw: pooled cells, goals, verdicts, the cheapest cache policy.
"""
