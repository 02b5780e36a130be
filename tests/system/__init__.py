"""Whole clusters: end to end, chaos, survival, durability, multi-host, Slurm, network namespaces."""
