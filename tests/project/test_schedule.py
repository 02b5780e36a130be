"""The longest-first table (tests/support/schedule.py) names files that exist: a file moved or renamed
without its entry would silently start last, and a run of several minutes would end with it alone."""

from __future__ import annotations

from tests.support.schedule import LONGEST_FIRST, TESTS


def test_every_file_of_the_longest_first_table_exists():
    missing = [name for name in LONGEST_FIRST if not (TESTS / name).is_file()]
    assert not missing, f"tests/support/schedule.py names files that are not there: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
