"""The trainer: takes tasks from the router, runs each attempt of a job in a process of its own, reports.

Two processes, two folders:

- :mod:`.service` — the long-lived trainer service (``busctl start trainer``): its router link and
  credentials, the task loop, the attempt's supervision (a child process it relays for, watches and
  ends). It never imports torch, nor anything of :mod:`.attempt` but its entry point.
- :mod:`.attempt` — what runs in an attempt's child process, forked from the fork server: the job's
  function or the built-in loop, the job API it is handed, checkpoints, evaluations, a gang. It holds
  its job's grant and imports nothing of :mod:`.service` (``tests/project/test_layers.py`` checks both).

What both processes use sits here: the channel between them (:mod:`.channel`), the reports to the
router (:mod:`.reports`), how an attempt failed (:mod:`.failures`), the attempt's grant
(:mod:`.grant`) and the user it runs as (:mod:`.attempt_user`).
"""
