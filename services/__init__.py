"""batchbus services: router (control plane), provider (datasets), trainer (task loop and models)."""
