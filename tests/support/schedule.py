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
from pathlib import Path

import pytest

__all__ = ["LONGEST_FIRST", "longest_first"]

#: The tests folder, which the paths of :data:`LONGEST_FIRST` are relative to.
TESTS = Path(__file__).resolve().parents[1]

#: Test files (their paths under tests/), the longest first; every other file follows in collection order.
LONGEST_FIRST = [
    "system/test_survive.py",
    "trainer/test_entrypoints.py",
    "system/test_slurm.py",
    "router/test_gang.py",
    "router/test_samples_of_each_step.py",
    "cli/test_doc_blocks.py",
    "bench/test_bench_remote.py",
    "provider/sources/test_sources_contract.py",
    "cli/test_examples.py",
    "system/test_jobs_durable.py",
    "system/test_replicas.py",
    "cli/test_example_jobs.py",
    "security/test_attempt_grant.py",
    "router/test_studies_e2e.py",
    "bench/test_bench_peer_formats.py",
    "cli/test_recipes.py",
    "system/test_slurm_requeue.py",
    "system/test_chaos_short.py",
    "security/test_security_edges.py",
    "bench/test_bench_peers_images.py",
    "security/test_fuzz.py",
    "cli/test_datasets_cli.py",
    "security/test_security.py",
    "evaluation/test_evaluators.py",
    "bench/test_bench.py",
    "loader/test_ddp_token.py",
    "system/test_multihost.py",
    "trainer/test_loss_spikes.py",
    "router/test_model_from_running.py",
    "trainer/test_peer_formats_job.py",
    "system/test_e2e.py",
    "cli/test_top_eval.py",
    "trainer/test_entrypoint_gang.py",
    "bench/test_scale.py",
    "cli/test_studies_cli.py",
    "cli/test_sdnotify.py",
    "router/test_gang_elastic.py",
    "trainer/test_tensorboard_export.py",
    "loader/test_loader_habits.py",
    "loader/test_stall_sources.py",
    "cli/test_study_watch.py",
    "security/test_roles.py",
    "security/test_security_memory.py",
    "loader/test_stall.py",
    "system/test_one_machine.py",
]


def longest_first(items: Sequence[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the files of :data:`LONGEST_FIRST` first, in its order; within a file, and among the
    files it does not name, the order stays as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    return sorted(items, key=lambda item: rank.get(_under_tests(item.path), len(rank)))


def _under_tests(path: Path) -> str:
    """``path``'s place under tests/ (``system/test_survive.py``), or its name where it is elsewhere."""
    path = path.resolve()
    return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else path.name
