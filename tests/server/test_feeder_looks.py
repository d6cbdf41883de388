"""How a feed looks at its waiting grants: grants that arrive are looked at with the oldest ones,
not by a look at every grant waiting (a client grants up to an epoch ahead, and looking at all of
them at each arrival cost a feeder more than its writes); whether a waiting grant is hopeless is
asked at the periodic full look, or at once when its plan has failed positions. No daemon."""

from __future__ import annotations

import numpy as np
import pytest

from kspeed import grants
from kspeed.server.feeder import writer as feed_writer
from tests.server.test_feeder_timeout import refusals
from tests.server.test_feeder_truncation import EPOCH, serving, until
from tests.server.test_production import plan_of

BATCH = 4
BATCHES = feed_writer.HEAD_GRANTS + 8


@pytest.fixture
def feed(monkeypatch):
    """A feed whose periodic full look never comes after its first, serving a plan of
    :data:`BATCHES` batches, nothing resident; yields it, its plan and its writer."""
    monkeypatch.setattr(feed_writer, "RESCAN_EVERY", 3600.0)
    part = plan_of(np.arange(BATCH * BATCHES), np.full(BATCH * BATCHES, 8), BATCH)
    with serving(part, []) as (feed, writer, client):
        yield feed, part, writer, client


def grant(batch: int) -> grants.Grant:
    return grants.Grant(EPOCH, batch, ring_offset=64 * batch, first=0, end=BATCH, tag=100 + batch)


def test_a_grant_arriving_behind_more_than_the_head_is_written_when_its_samples_are_there(feed):
    feed, part, writer, client = feed
    last = BATCHES - 1
    client.send(grants.encode_grants([grant(b) for b in range(last)]))  # all wait: nothing is resident
    until(lambda: len(feed._pending) == last)
    part.region[last * BATCH :] = 0  # the last batch is made before it is granted
    client.send(grants.encode_grants([grant(last)]))
    until(lambda: writer.tags == [100 + last])
    assert len(feed._pending) == last and refusals(writer) == []
    part.region[:] = 0  # everything made: a move has the head written, and the next while all of it went
    feed.moved()
    until(lambda: len(writer.tags) == BATCHES)
    assert writer.tags == [100 + last] + [100 + b for b in range(last)] and not feed._pending


def test_a_waiting_grant_whose_plan_has_a_failed_position_is_refused_at_the_next_move(feed):
    feed, part, writer, client = feed
    client.send(grants.encode_grants([grant(0), grant(1)]))
    until(lambda: len(feed._pending) == 2)
    part.failures[BATCH + 1] = "decode_image failed: not a JPEG"  # batch 1's second position
    feed.moved()
    until(lambda: len(refusals(writer)) == 1)
    [refused] = refusals(writer)
    assert (refused.batch, refused.tag, refused.sample) == (1, 101, BATCH + 1)
    assert "not a JPEG" in refused.text
    assert writer.tags == [] and len(feed._pending) == 1  # batch 0 still waits for its samples


def test_each_arriving_grant_waits_as_an_entry_of_its_own(feed):
    feed = feed[0]
    rows = grants.decode(grants.encode_grants([grant(0), grant(0)]))  # the same grant twice, at once
    first, second = feed._note(rows, 1.0)
    assert first is not second and (first.i, first.j) == (second.i, second.j) == (0, BATCH)
    first.i = 3  # (an entry is the feed's own record of one grant: nothing else changes with it)
    assert second.i == 0 and feed._note(rows[:1], 1.0)[0].i == 0
