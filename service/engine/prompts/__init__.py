"""Prompts and their reuse: a prompt's chunks and its computed K/V on the way to its row, the
prefill workers that compute them, the prefix cache's reuse and reusable segments."""
