"""A job's name within a group (no daemon): the same for all its ranks, different between jobs."""

from __future__ import annotations

import pytest

from kspeed.client.feeding.membership import group_fields, member_name
from kspeed.client.options import FeedOptions
from kspeed.errors import ConfigError
from kspeed.proto import kspeed_pb2


def test_a_named_job_is_its_name_made_valid():
    assert member_name("sweep/lr=0.1 trial 3", environ={}) == "sweep-lr-0.1-trial-3"


def test_ranks_of_one_launched_job_agree_and_two_jobs_differ():
    rank0 = {"WORLD_SIZE": "4", "RANK": "0", "MASTER_ADDR": "node7", "MASTER_PORT": "29500"}
    rank3 = {**rank0, "RANK": "3"}
    other = {**rank0, "MASTER_PORT": "29501"}
    assert member_name("", environ=rank0, pid=10) == member_name("", environ=rank3, pid=11) == "node7:29500"
    assert member_name("", environ=other, pid=10) != member_name("", environ=rank0, pid=10)


def test_a_job_of_one_process_is_that_process():
    one = member_name("", environ={"MASTER_PORT": "29500"}, pid=4242)  # (WORLD_SIZE unset: one process)
    assert one.endswith(":4242") and one != member_name("", environ={}, pid=4243)


def test_the_fields_a_feed_sends_and_the_decoded_mode_needs_a_cached_dataset():
    info = kspeed_pb2.DatasetInfo(spec=kspeed_pb2.DatasetSpec(name="imgs"))
    assert group_fields(info, FeedOptions(batch_size=8), "job") == {}
    fields = group_fields(info, FeedOptions(batch_size=8, group="hp", group_lag=64), "job-a")
    assert fields == {"group": "hp", "member": "job-a", "share": "samples", "group_lag": 64}
    with pytest.raises(ConfigError, match="cache='preprocessed'"):
        group_fields(info, FeedOptions(batch_size=8, group="hp", share="decoded"), "job-a")
    info.spec.cache = "preprocessed"
    assert group_fields(info, FeedOptions(batch_size=8, group="hp", share="decoded"), "job-a")["share"] == "decoded"


@pytest.mark.parametrize(
    ("options", "field"),
    [({"group": "no spaces"}, "group"), ({"share": "all"}, "share"), ({"group": "g", "group_lag": 0}, "group_lag")],
)
def test_bad_group_options_are_named(options, field):
    with pytest.raises(ConfigError) as caught:
        FeedOptions(batch_size=8, **options)
    assert caught.value.field == field
