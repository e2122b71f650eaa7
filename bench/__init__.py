"""Benchmarks for Relay; each module runs with ``python -m bench.<name>``."""
