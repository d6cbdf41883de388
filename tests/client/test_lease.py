"""The lease keeper renews at a third of the TTL, tolerates a manager outage and releases on close."""

from __future__ import annotations

import threading
import time

from kspeed.client.lease import LeaseKeeper
from kspeed.errors import UnavailableError


class FakeManager:
    def __init__(self) -> None:
        self.renewed: list[float] = []
        self.released: list[str] = []
        self.down = threading.Event()

    def renew_lease(self, lease_id: str) -> None:
        if self.down.is_set():
            raise UnavailableError("manager at 127.0.0.1:1 is unreachable")
        self.renewed.append(time.monotonic())

    def release_lease(self, lease_id: str) -> None:
        self.released.append(lease_id)


def test_renews_at_a_third_of_the_ttl_and_releases_on_close():
    manager = FakeManager()
    keeper = LeaseKeeper(manager, "imgs/abc", ttl=0.3)
    time.sleep(0.55)
    keeper.close()
    assert 3 <= len(manager.renewed) <= 6  # every 0.1 s
    assert manager.released == ["imgs/abc"]
    count = len(manager.renewed)
    time.sleep(0.2)
    assert len(manager.renewed) == count  # stopped
    keeper.close()
    assert manager.released == ["imgs/abc"]  # released once


def test_a_manager_outage_is_survived():
    manager = FakeManager()
    manager.down.set()
    keeper = LeaseKeeper(manager, "imgs/def", ttl=0.15)
    time.sleep(0.2)
    assert keeper.renewals == 0
    manager.down.clear()
    time.sleep(0.2)
    keeper.close()
    assert keeper.renewals >= 1 and manager.released == ["imgs/def"]
