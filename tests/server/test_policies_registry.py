"""The policy registry's decisions, made on the smallest state they read: no production, no threads.

Each test builds the policy objects and a :class:`CacheState` (or a few plans) and checks what the
policy keeps, what it lets go first, and which plans it works for.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kspeed.errors import ConfigError
from kspeed.policies import CACHING, LRU, MEMORY_POLICIES, MINIO, REUSE, STREAM
from kspeed.server.production.policies import (
    EVICT_BATCH,
    ON_DEMAND,
    POLICY_CLASSES,
    STAGING,
    WHOLE,
    CacheState,
    Lru,
    Minio,
    OnDemand,
    Reuse,
    Stream,
    Whole,
    farthest_first,
    policy_for,
    share_policy,
)

NEVER = np.iinfo(np.int64).max  # the next use of a sample no known plan needs


@dataclasses.dataclass
class Plan:
    """A followed plan as a policy reads it: its samples and its first position not written."""

    ids: np.ndarray
    next: int


def written(policy_name: str, cache: CacheState, samples: list[int], nbytes: int = 10) -> list[int]:
    """Offer ``samples`` (each ``nbytes``) to the policy as written, in turn; returns those it keeps."""
    policy = policy_for(policy_name)
    return [s for s in samples if policy.keeps(cache, s, nbytes)]


def no_next_use(ids: np.ndarray) -> np.ndarray:
    raise AssertionError("this policy does not look at next uses")


# -- the registry -----------------------------------------------------------------------------------


def test_the_registry_holds_the_two_internal_members_and_every_public_memory_policy():
    assert sorted(POLICY_CLASSES) == sorted([WHOLE, ON_DEMAND, *MEMORY_POLICIES])
    assert sorted(n for n, cls in POLICY_CLASSES.items() if cls.own_window) == sorted(MEMORY_POLICIES)
    assert sorted(n for n, cls in POLICY_CLASSES.items() if cls.caching) == sorted(CACHING)
    assert [n for n, cls in POLICY_CLASSES.items() if cls.home] == [WHOLE]
    classes = {WHOLE: Whole, ON_DEMAND: OnDemand, STREAM: Stream, MINIO: Minio, REUSE: Reuse, LRU: Lru}
    for name, cls in classes.items():
        assert type(policy_for(name)) is cls and policy_for(name).name == name
        assert policy_for(name) is policy_for(name)  # stateless: one object per policy


@pytest.mark.parametrize("name", ["fifo", "", "auto", "cache", "LRU"])
def test_an_unknown_name_is_a_config_error_naming_it(name):
    with pytest.raises(ConfigError, match=f"memory policy {name!r} is not one of whole, on_demand") as caught:
        policy_for(name)
    assert caught.value.value == name and caught.value.field == "policy"


def test_an_assignment_names_a_memory_policy_or_none_and_on_demand_wins():
    assert share_policy("", on_demand=False) is policy_for(WHOLE)
    assert share_policy("", on_demand=True) is policy_for(ON_DEMAND)
    assert share_policy(LRU, on_demand=True) is policy_for(ON_DEMAND)  # a survivor holds no window
    for name in MEMORY_POLICIES:
        assert share_policy(name, on_demand=False) is policy_for(name)
    for name in ("fifo", WHOLE, ON_DEMAND):  # the internal members are never assigned by name
        with pytest.raises(ConfigError, match=repr(name)):
            share_policy(name, on_demand=False)


# -- windows and rooms ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [WHOLE, ON_DEMAND])
def test_whole_and_on_demand_have_no_window_and_keep_nothing_in_one(name):
    policy = policy_for(name)
    assert not policy.own_window and not policy.caching and not policy.holds_planned_uses
    assert policy.prefetch_room(1000) == 1000 and policy.keep_room(1000) == 0
    cache = CacheState()
    assert written(name, cache, [1, 2, 3]) == [] and cache == CacheState()
    assert policy_for(WHOLE).home and not policy_for(ON_DEMAND).home


def test_stream_has_a_window_keeps_nothing_and_holds_what_current_plans_still_need():
    stream = policy_for(STREAM)
    assert stream.own_window and not stream.home and not stream.caching and stream.holds_planned_uses
    assert stream.prefetch_room(1000) == 1000 and stream.keep_room(1000) == 0  # all of it prefetches
    cache = CacheState(kept_room=1000)
    assert written(STREAM, cache, list(range(20))) == []
    assert not cache.recent and not cache.kept and cache.kept_bytes == 0
    assert len(stream.victims(cache, no_next_use)) == 0


@pytest.mark.parametrize("name", CACHING)
def test_caching_policies_prefetch_into_a_quarter_and_keep_the_rest(name):
    policy = policy_for(name)
    assert policy.own_window and policy.caching and not policy.holds_planned_uses and not policy.home
    assert STAGING == 4
    assert policy.prefetch_room(1000) == 250 and policy.keep_room(1000) == 750
    assert policy.prefetch_room(1003) + policy.keep_room(1003) == 1003


# -- what each keeps --------------------------------------------------------------------------------


def test_minio_keeps_the_first_samples_that_fit_for_good():
    cache = CacheState(kept_room=100)
    # 30 + 30 + 30 fit; the fourth would not (120); a later, smaller one still fits (100)
    assert written(MINIO, cache, [7, 3, 9, 1], nbytes=30) == [7, 3, 9]
    assert written(MINIO, cache, [5], nbytes=10) == [5]
    assert cache.kept == {7, 3, 9, 5} and cache.kept_bytes == 100 and not cache.recent
    # written again (read anew for a later plan): still kept, not counted twice
    assert written(MINIO, cache, [3, 7], nbytes=30) == [3, 7] and cache.kept_bytes == 100
    assert written(MINIO, cache, [1], nbytes=1) == []  # full: the subset does not change
    # a horizon holding a kept sample again does not unkeep it; minio never evicts
    policy_for(MINIO).needed_again(cache, 3)
    assert cache.holds(3) and len(policy_for(MINIO).victims(cache, no_next_use)) == 0


def test_minio_keeps_fewer_once_its_room_shrinks_never_others():
    cache = CacheState(kept_room=60)
    assert written(MINIO, cache, [1, 2, 3], nbytes=30) == [1, 2]
    cache.drop(2, 30)  # preempted for a first grant: its room is given up
    cache.kept_room = 30
    assert written(MINIO, cache, [3, 4, 2], nbytes=30) == []
    assert cache.kept == {1} and cache.kept_bytes == 30


def test_minio_keeps_nothing_before_its_room_is_set():
    assert written(MINIO, CacheState(), [1]) == []


@pytest.mark.parametrize("name", [REUSE, LRU])
def test_evicting_policies_keep_every_written_sample_in_written_order(name):
    cache = CacheState()
    assert written(name, cache, [4, 2, 8, 6]) == [4, 2, 8, 6]
    assert list(cache.recent) == [4, 2, 8, 6] and not cache.kept and cache.kept_bytes == 0
    assert written(name, cache, [2]) == [2]  # written again: the most recent now
    assert list(cache.recent) == [4, 8, 6, 2]


# -- what each lets go first ------------------------------------------------------------------------


def test_lru_lets_go_the_least_recently_written_first():
    cache = CacheState()
    written(LRU, cache, list(range(30)))
    lru = policy_for(LRU)
    lru.needed_again(cache, 1)  # a horizon holds 1 again: held until written, no victim meanwhile
    assert not cache.holds(1)
    assert lru.victims(cache, no_next_use).tolist() == [0, *range(2, 17)]
    written(LRU, cache, [1])  # written again: now the most recent
    assert list(cache.recent)[-1] == 1
    assert lru.victims(cache, no_next_use).tolist() == [0, *range(2, 17)]
    assert len(lru.victims(cache, no_next_use)) == EVICT_BATCH


def test_lru_lets_go_all_it_caches_when_fewer_than_a_batch():
    cache = CacheState()
    written(LRU, cache, [9, 4, 7])
    assert policy_for(LRU).victims(cache, no_next_use).tolist() == [9, 4, 7]
    assert len(policy_for(LRU).victims(CacheState(), no_next_use)) == 0


def test_reuse_lets_go_the_farthest_next_use_first():
    cache = CacheState()
    written(REUSE, cache, list(range(20)))
    # the known plans want 19, 18, ..., 5 next (19 first), and never 0..4 again
    upcoming = {s: 19 - s for s in range(5, 20)}
    asked: list[list[int]] = []

    def next_use(ids: np.ndarray) -> np.ndarray:
        asked.append(ids.tolist())
        return np.array([upcoming.get(int(i), NEVER) for i in ids], dtype=np.int64)

    victims = policy_for(REUSE).victims(cache, next_use)
    # the never-needed first (in written order), then the farthest: 5 (14 ahead), 6, ...
    assert victims.tolist() == [0, 1, 2, 3, 4, *range(5, 16)]
    assert asked == [list(range(20))]  # asked about the cached samples only, once


def test_reuse_does_not_let_go_by_age():
    cache = CacheState()
    written(REUSE, cache, [10, 20, 30])
    later = {10: 1, 20: 500, 30: 7}
    victims = policy_for(REUSE).victims(cache, lambda ids: np.array([later[int(i)] for i in ids], np.int64))
    assert victims.tolist() == [20, 30, 10]  # lru would say 10, 20, 30
    assert len(policy_for(REUSE).victims(CacheState(), no_next_use)) == 0


def test_a_sample_that_left_the_window_is_no_longer_cached_or_kept():
    cache = CacheState(kept_room=100)
    written(LRU, cache, [1, 2])
    cache.kept, cache.kept_bytes = {3}, 40
    cache.drop(1, 10)
    cache.drop(3, 40)
    assert list(cache.recent) == [2] and not cache.kept and cache.kept_bytes == 0
    assert policy_for(LRU).victims(cache, no_next_use).tolist() == [2]


def test_farthest_first_breaks_ties_in_the_given_order():
    ids = np.array([5, 6, 7, 8], np.int64)
    assert farthest_first(ids, np.array([3, NEVER, 3, NEVER], np.int64), 3).tolist() == [6, 8, 5]


# -- which plans each works for ---------------------------------------------------------------------


def plans() -> list[Plan]:
    """A feed's plans in epoch order: the first written, two still being consumed."""
    return [Plan(np.arange(4), 4), Plan(np.arange(4), 1), Plan(np.arange(4), 0)]


def test_whole_follows_every_plan():
    followed = policy_for(WHOLE).followed(plans())
    assert [p.next for p in followed] == [4, 1, 0]


def test_on_demand_follows_only_the_plan_being_consumed():
    followed = policy_for(ON_DEMAND).followed(plans())
    assert [p.next for p in followed] == [1]
    assert policy_for(ON_DEMAND).followed([Plan(np.arange(2), 2)]) == []


@pytest.mark.parametrize("name", MEMORY_POLICIES)
def test_a_window_of_its_own_follows_every_plan_not_written_yet(name):
    followed = policy_for(name).followed(plans())
    assert [p.next for p in followed] == [1, 0]
