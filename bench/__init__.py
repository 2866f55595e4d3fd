"""Benchmarks: one script per capability, run as `python -m bench.<name> [--quick] [--json]`."""
