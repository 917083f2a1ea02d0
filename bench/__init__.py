"""Benchmarks (run with ``python -m tinyloop bench``); results go in docs/BENCHMARKS.md."""
