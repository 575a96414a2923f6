"""Scheduling and admission (vLLM v1's core/sched): who runs each step, which requests are
admitted or shed against their time-to-first-token target, and what each step teaches both."""
