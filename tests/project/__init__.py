"""The project itself: its import layers and the end of `make test`."""
