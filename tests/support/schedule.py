"""The order test files start in: the longest first.

``make test`` runs files in parallel, one file per pytest-xdist worker at a time (``--dist loadfile``), and a
file's tests stay on one worker; the run ends when its last file does. Started last, a file of several minutes
(test_slurm's cluster recipes) ran alone on a worker after every other file had ended; started first, it runs
beside the short ones. ``--no-loadscope-reorder`` (the Makefile) keeps this order: pytest-xdist otherwise starts
the files with the most tests first, whatever their length.

:data:`LONGEST_FIRST` is measured, not derived: the files whose tests took 15 s or more together in a full
run (the JUnit reports ``make test`` leaves in ``.pytest_cache/reports/``), longest first. A file missing from it only starts later; a stale entry costs
nothing but order. Re-measure when a file's tests change much.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

__all__ = ["LONGEST_FIRST", "longest_first"]

#: Test files (under tests/), the longest first; every other file follows in collection order.
LONGEST_FIRST = [
    "test_survive.py",
    "test_entrypoints.py",
    "test_slurm.py",
    "test_gang.py",
    "test_samples_of_each_step.py",
    "test_doc_blocks.py",
    "test_bench_remote.py",
    "test_sources_contract.py",
    "test_examples.py",
    "test_jobs_durable.py",
    "test_replicas.py",
    "test_example_jobs.py",
    "test_attempt_grant.py",
    "test_studies_e2e.py",
    "test_bench_peer_formats.py",
    "test_recipes.py",
    "test_slurm_requeue.py",
    "test_chaos_short.py",
    "test_security_edges.py",
    "test_bench_peers_images.py",
    "test_fuzz.py",
    "test_datasets_cli.py",
    "test_security.py",
    "test_evaluators.py",
    "test_bench.py",
    "test_ddp_token.py",
    "test_multihost.py",
    "test_loss_spikes.py",
    "test_model_from_running.py",
    "test_peer_formats_job.py",
    "test_e2e.py",
    "test_top_eval.py",
    "test_entrypoint_gang.py",
    "test_scale.py",
    "test_studies_cli.py",
    "test_sdnotify.py",
    "test_gang_elastic.py",
    "test_tensorboard_export.py",
    "test_loader_habits.py",
    "test_stall_sources.py",
    "test_study_watch.py",
    "test_roles.py",
    "test_security_memory.py",
    "test_stall.py",
    "test_one_machine.py",
]


def longest_first(items: Sequence[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the files of :data:`LONGEST_FIRST` first, in its order; within a file, and among the
    files it does not name, the order stays as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    return sorted(items, key=lambda item: rank.get(item.path.name, len(rank)))
