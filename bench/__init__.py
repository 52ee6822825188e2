"""Kernel and layer benchmarks (pytest-benchmark) and the report CLI: ``python -m bench.report``."""
