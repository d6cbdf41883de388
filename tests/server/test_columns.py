"""A plan part's compact columns read and write like the int64 arrays they replace."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from kspeed.server.feeder.columns import BLOCK, CrcColumn, SparseColumn
from kspeed.server.feeder.plan_part import PlanPart, narrow, search


@pytest.mark.parametrize("cls", [SparseColumn, CrcColumn])
@pytest.mark.parametrize("seed", range(10))
def test_a_column_matches_an_int64_array(cls, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3 * BLOCK))
    ref = np.full(n, -1 if cls is CrcColumn else 0, dtype=np.int64)
    column = cls(n)
    for _ in range(30):
        pos = rng.integers(-n, n, int(rng.integers(0, 40)))
        low = -1 if cls is CrcColumn else 0
        values = np.where(rng.random(len(pos)) < 0.3, low, rng.integers(1, 1 << 32, len(pos)))
        column[pos] = values
        ref[pos] = values
        a, b = sorted(rng.integers(0, n + 2, 2).tolist())
        assert column[a:b].tolist() == ref[a:b].tolist()
        at = rng.integers(-n, n, 7)
        assert column[at].tolist() == ref[at].tolist()
        k = int(rng.integers(-n, n))
        assert column[k] == int(ref[k])
    assert column.tolist() == ref.tolist() and ((column == ref) | (ref == column)).all()
    again = pickle.loads(pickle.dumps(column))
    assert again.tolist() == ref.tolist()


def test_a_sparse_column_keeps_blocks_only_where_values_are_not_zero():
    column = SparseColumn(10 * BLOCK)
    assert column.nbytes == 0 and not column[:].any()
    column[np.array([5, BLOCK + 1, BLOCK + 2])] = [7, 8, 9]
    assert column.nbytes == 2 * BLOCK * 8 and column[BLOCK : BLOCK + 3].tolist() == [0, 8, 9]
    column[np.array([BLOCK + 1, BLOCK + 2, 5])] = 0
    assert column.nbytes == 0 and (column == 0).all()
    column[np.array([3, 3])] = [1, 0]  # the last value of a position wins, as with numpy
    assert column[3] == 0 and column.nbytes == 0


def test_a_crc_column_is_4_bytes_and_a_bit_per_position():
    column = CrcColumn(1000)
    assert column.nbytes == 4000 + 125 and (column == -1).all()
    column[np.array([1, 2])] = [0xFFFFFFFF, 0]
    assert column[:4].tolist() == [-1, 0xFFFFFFFF, 0, -1]
    column[np.array([2, 2])] = [5, -1]
    assert column[2] == -1


def test_narrow_takes_the_narrowest_unsigned_dtype():
    assert narrow(np.array([0, 65535])).dtype == np.uint16
    assert narrow(np.array([65536])).dtype == np.uint32
    assert narrow(np.array([1 << 32])).dtype == np.int64
    assert narrow(np.zeros(0, np.int64)).dtype == np.uint16


def test_search_in_a_compact_array_finds_what_searchsorted_finds():
    haystack = np.array([2, 4, 4, 9], dtype=np.int32)
    values = np.array([0, 4, 5, 9, 1 << 40], dtype=np.int64)
    for side in ("left", "right"):
        assert (
            search(haystack, values, side).tolist() == np.searchsorted(haystack.astype(np.int64), values, side).tolist()
        )
    assert int(search(haystack, 4)) == 1


def test_where_finds_every_occurrence_in_compact_ids():
    ids = np.array([7, 3, 7, 5], dtype=np.int32)
    part = PlanPart(
        starts=np.array([0, 4]),
        positions=np.arange(4, dtype=np.int32),
        ids=ids,
        length=narrow(np.ones(4)),
        dst=narrow(np.zeros(4)),
    )
    at, which = part.where(np.array([7, 4, 5, 1 << 35]))
    assert sorted(zip(at.tolist(), which.tolist(), strict=True)) == [(0, 0), (2, 0), (3, 2)]


def reference_where(ids: np.ndarray, wanted: np.ndarray) -> list[tuple[int, int]]:
    return [(int(k), int(w)) for w, x in enumerate(wanted.tolist()) for k in np.flatnonzero(ids == x).tolist()]


@pytest.mark.parametrize("seed", range(20))
def test_where_matches_a_scan_for_sparse_dense_and_repeated_plans(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 3000))
    spread = int(rng.choice([1, 3, 50, 5000]))
    ids = rng.integers(10**6, 10**6 + max(n, 1) * spread, n).astype(np.int32)
    part = PlanPart(
        starts=np.array([0, n]),
        positions=np.arange(n, dtype=np.int32),
        ids=ids,
        length=narrow(np.ones(n)),
        dst=narrow(np.zeros(n)),
    )
    wanted = np.concatenate(
        [rng.choice(ids, min(n, 40)) if n else np.zeros(0, np.int64), rng.integers(0, 2 * 10**6, 20)]
    )
    at, which = part.where(wanted)
    assert list(zip(at.tolist(), which.tolist(), strict=True)) == reference_where(ids, wanted)
