"""The trainer service's process: the router link, the task loop, and each attempt's supervision
(:mod:`.attempt_run`); never torch, never the job's code (see :mod:`services.trainer`)."""
