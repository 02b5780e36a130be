"""Same-host delivery through shared-memory rings (shm/)."""
