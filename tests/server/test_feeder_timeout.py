"""``production_timeout`` counts the time a feed went without writing a grant, not the time a grant
was queued: a client grants far ahead, and a grant behind its feed's earlier ones waits its turn
(eight jobs sharing one server's preprocessing took over a minute per epoch, and their next
epoch's grants failed while every feed moved). No daemon."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kspeed import grants
from kspeed.server.feeder.writer import FeedWriter
from tests.server.test_feeder_truncation import EPOCH, RecordingWriter, serving, until
from tests.server.test_production import plan_of

BATCH = 10
BATCHES = 6
TIMEOUT = 0.6


@pytest.fixture
def feed():
    """A feed with ``production_timeout`` :data:`TIMEOUT` serving a plan of :data:`BATCHES`
    batches, nothing resident yet; yields it, its plan, its writer and the client's end."""
    part = plan_of(np.arange(BATCH * BATCHES), np.full(BATCH * BATCHES, 8), BATCH)
    with serving(part, [], production_timeout=TIMEOUT) as (feed, writer, client):
        yield feed, part, writer, client


def grant(batch: int) -> grants.Grant:
    return grants.Grant(EPOCH, batch, ring_offset=1024 * batch, first=0, end=BATCH, tag=100 + batch)


def refusals(writer: RecordingWriter) -> list[grants.GrantError]:
    """The grants refused so far (the writer also sends notices of grants held on production)."""
    return [m for m in map(grants.decode, list(writer.sent)) if isinstance(m, grants.GrantError)]


def produce(feed: FeedWriter, part, batch: int) -> None:
    """Production placed the samples of ``batch``: the feeder knows where they are."""
    part.region[batch * BATCH : (batch + 1) * BATCH] = 0
    feed.moved()


def test_grants_queued_behind_their_feeds_earlier_ones_wait_while_the_feed_moves(feed):
    feed, part, writer, client = feed
    client.send(grants.encode_grants([grant(b) for b in range(BATCHES)]))
    began = time.monotonic()
    for b in range(BATCHES):  # one batch made every half timeout: the last waits 3 timeouts queued
        time.sleep(TIMEOUT / 2)
        produce(feed, part, b)
        until(lambda b=b: 100 + b in writer.tags)
    assert time.monotonic() - began > 2 * TIMEOUT  # (the last grant was queued well past the timeout)
    assert writer.tags == [100 + b for b in range(BATCHES)] and refusals(writer) == []  # none refused


def test_a_grant_fails_once_its_feed_wrote_nothing_for_the_production_timeout(feed):
    feed, part, writer, client = feed
    client.send(grants.encode_grants([grant(0), grant(1)]))
    time.sleep(TIMEOUT * 0.7)  # batch 0 is made before the timeout, batch 1 never
    produce(feed, part, 0)
    until(lambda: writer.tags == [100])
    written = time.monotonic()
    until(lambda: len(refusals(writer)) == 1, timeout=10 * TIMEOUT)
    [refused] = refusals(writer)
    assert (refused.batch, refused.tag) == (1, 101)
    assert refused.sample == BATCH and f"sample {BATCH} was not produced within {TIMEOUT:g}s" in refused.text
    assert time.monotonic() - written >= TIMEOUT * 0.9  # counted from the feed's last write, not the grant's arrival
