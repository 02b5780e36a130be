"""The wire: frames, messages, versions, and the serving loop's heartbeats."""
