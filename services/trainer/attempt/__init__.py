"""An attempt's process: the job's function or the built-in loop and everything it calls (the job API,
checkpoints, evaluations, a gang); :mod:`.entry` is where the trainer service's child starts. Nothing
here imports :mod:`services.trainer.service` (see :mod:`services.trainer`)."""
