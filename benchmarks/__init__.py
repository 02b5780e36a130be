"""Benchmarks: each module runs on its own (`python -m benchmarks.NAME`) and through `busctl bench`."""
