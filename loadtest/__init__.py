"""Locust users and the positional-encoding comparison harness."""
