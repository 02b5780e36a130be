"""The router: registration, discovery, the durable job queue, commands and statistics."""
