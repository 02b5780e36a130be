"""The benchmarks (benchmarks/), run small."""
