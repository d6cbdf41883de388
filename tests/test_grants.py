"""The feed messages of the data-plane small-message channel: what is encoded is decoded as sent, and
a malformed message is a protocol error."""

from __future__ import annotations

import pytest

from kspeed import grants
from kspeed.errors import ProtocolError

TOP = 0xFFFFFFFF  # the largest epoch or batch a message carries


@pytest.mark.parametrize(("epoch", "batch"), [(0, 0), (7, 12), (TOP, TOP)])
def test_a_truncation_is_decoded_as_sent(epoch, batch):
    assert grants.decode(grants.encode_truncate_plan(epoch, batch)) == grants.TruncatePlan(epoch, batch)


def test_a_truncation_and_a_drop_are_different_messages():
    assert grants.decode(grants.encode_drop_plan(7)) == grants.DropPlan(7)
    assert grants.encode_truncate_plan(7, 0)[0] != grants.encode_drop_plan(7)[0]
    assert {"TruncatePlan", "encode_truncate_plan"} <= set(grants.__all__)


@pytest.mark.parametrize("cut", [1, 5, 8])  # the kind alone, the epoch alone, one byte short of the batch
def test_a_truncation_cut_short_is_a_malformed_message(cut):
    message = grants.encode_truncate_plan(7, 12)[:cut]
    with pytest.raises(ProtocolError, match=rf"malformed feed message of kind {message[0]}"):
        grants.decode(message)
