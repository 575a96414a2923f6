"""Serving engine, split like vLLM: request -> scheduler -> KV-cache manager -> runner -> sampler."""
