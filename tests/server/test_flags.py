"""Packed flags read and write like the bool arrays they replace, at a bit per flag."""

from __future__ import annotations

import numpy as np
import pytest

from kspeed.server.memory.flags import Flags


def test_a_million_flags_take_an_eighth_of_a_megabyte():
    flags = Flags(1_000_000)
    assert flags.nbytes == 125_000 and len(flags) == 1_000_000 and not flags.any()


@pytest.mark.parametrize("seed", range(40))
def test_reads_and_writes_match_a_bool_array(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 70))
    ref = rng.random(n) < rng.random()
    flags = Flags.of(ref)
    for _ in range(20):
        a, b = sorted(rng.integers(0, n + 4, 2).tolist())
        part = ref[a:b]
        assert flags[a:b].tolist() == part.tolist()
        assert flags.count(a, b) == int(part.sum())
        assert flags.all(a, b) == bool(part.all()) and flags.any(a, b) == bool(part.any())
        assert flags.positions(a, b).tolist() == (np.flatnonzero(part) + a).tolist()
        assert flags.positions(a, b, value=False).tolist() == (np.flatnonzero(~part) + a).tolist()
        start = int(rng.integers(0, n + 1))
        rest = np.flatnonzero(~ref[start:])
        assert flags.first(start, False) == (start + int(rest[0]) if len(rest) else n)
        if n:
            pos = rng.integers(-n, n, 5)
            assert flags[pos].tolist() == ref[pos].tolist()
            i = int(rng.integers(-n, n))
            assert flags[i] == bool(ref[i])
            value = bool(rng.random() < 0.5)
            flags.set(pos, value)
            ref[pos] = value
            c, d = sorted(rng.integers(-n, n + 3, 2).tolist())
            assert flags[c:d].tolist() == ref[c:d].tolist()
        if rng.random() < 0.5:
            flags.set(slice(a, b))
            ref[a:b] = True
        else:
            flags.clear(a, b)
            ref[a:b] = False
        assert flags.tolist() == ref.tolist()
        assert np.array_equal(np.asarray(flags), ref) and flags.sum() == int(ref.sum())


def test_positions_out_of_range_are_refused():
    flags = Flags(10)
    with pytest.raises(IndexError):
        flags[10]
    with pytest.raises(IndexError):
        flags[np.array([3, 11])]
    with pytest.raises(IndexError):
        flags.set(np.array([-11]))


def test_a_flag_far_away_is_found_and_long_ranges_are_counted():
    flags = Flags(5_000_000)
    flags.set(slice(0, 4_999_990))
    assert flags.first(0, False) == 4_999_990 and flags.first(7, True) == 7
    assert flags.count() == 4_999_990 and flags.all(3, 4_999_990) and not flags.all(3, 4_999_991)
    flags.clear(17, 4_000_003)
    assert flags.count() == 4_999_990 - (4_000_003 - 17) and flags.positions(10, 20).tolist() == [
        10,
        11,
        12,
        13,
        14,
        15,
        16,
    ]
