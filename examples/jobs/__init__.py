"""Training functions submitted as jobs (``busctl submit --entrypoint examples.jobs.mnist:train``):
see README.md here and docs/jobs.md."""
