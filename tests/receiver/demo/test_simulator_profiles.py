"""The simulator's profile table against the dialect table: one row each, same names."""

from __future__ import annotations

import pytest

from receiver.demo.profiles import PROFILES
from receiver.providers import DIALECTS


def test_the_simulator_has_a_profile_for_every_dialect_and_no_other():
    assert PROFILES.keys() == DIALECTS.keys()


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_profile_says_how_its_rows_are_served(name):
    p = PROFILES[name]
    ways = (p.output_files, p.results_file, p.request_status, p.message_batches)
    assert sum(map(bool, ways)) == 1
    assert (p.created_from == "requests") == (p.request_part is not None)
    assert not p.guide_shape or p.request_status  # the guide's shape has a request_status
    assert len(p.batch_statuses) <= 2 and (p.created_from is None or p.windows)
