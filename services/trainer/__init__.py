"""The trainer service: takes tasks from the router, streams batches from providers, trains."""
