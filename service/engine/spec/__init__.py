"""Speculative decoding (vLLM v1's spec_decode): proposers of draft tokens, each request's draft
state, the speculator that decides what a step feeds and keeps, and the block verifier."""
