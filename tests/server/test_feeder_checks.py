"""Which stored samples a feeder checks before it writes them (``verify_served``), no daemon."""

from __future__ import annotations

import numpy as np

from kspeed.server.feeder.writer import FeederShared


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_a_sample_checked_at_home_is_not_checked_again_until_it_is_placed_anew():
    shared = FeederShared(lambda event: None)
    assert not shared.checked("ds", ids(3, 7, 1000)).any()  # nothing checked yet
    since = shared.placements
    shared.mark_checked("ds", ids(3, 1000), since)
    assert shared.checked("ds", ids(3, 7, 1000)).tolist() == [True, False, True]
    assert not shared.checked("other", ids(3)).any()  # per dataset
    shared.unchecked("ds", ids(1000, 5000))  # a new place (a repair re-read it, or it moved)
    assert shared.checked("ds", ids(3, 1000)).tolist() == [True, False]


def test_a_check_begun_before_a_sample_was_placed_anew_proves_nothing():
    shared = FeederShared(lambda event: None)
    since = shared.placements
    shared.unchecked("ds", ids(9))  # placed anew while its old bytes were being checked
    shared.mark_checked("ds", ids(9), since)
    assert not shared.checked("ds", ids(9)).any()


def test_with_recheck_every_write_checks_again():
    shared = FeederShared(lambda event: None, recheck=True)
    shared.mark_checked("ds", ids(1, 2), shared.placements)
    assert not shared.checked("ds", ids(1, 2)).any()
