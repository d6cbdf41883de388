"""The server's agent: heartbeats at the manager's interval, and at once when there is news."""

from __future__ import annotations

import itertools
import threading
import time

from kspeed.cli.cluster import wait_for
from kspeed.config import SecurityConfig
from kspeed.proto import kspeed_pb2
from kspeed.server.agent import SOON_GAP, ManagerAgent
from kspeed.server.metrics import ServerMetrics


class Manager:
    """Answers the agent's calls in place of a manager, noting when each call came."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.calls: list[tuple[str, float]] = []
        self.lock = threading.Lock()

    def call(self, method: str, request: object) -> object:
        with self.lock:
            self.calls.append((method, time.monotonic()))
        if method == "RegisterServer":
            return kspeed_pb2.RegisterServerReply(incarnation=1, heartbeat_interval_s=self.interval)
        return kspeed_pb2.HeartbeatReply()

    def count(self) -> int:
        with self.lock:
            return len(self.calls)


def agent_for(manager: Manager) -> ManagerAgent:
    agent = ManagerAgent(
        manager_address="127.0.0.1:9",  # never dialled: the calls go to ``manager``
        security=SecurityConfig(auth="none"),
        server_id="srv-test",
        address="127.0.0.1:1",
        http_address="",
        inventory=kspeed_pb2.ServerInventory,
        metrics=ServerMetrics(),
        on_fatal=lambda exc: None,
    )
    agent._call = manager.call  # type: ignore[method-assign]
    return agent


def test_news_is_reported_at_once_not_at_the_next_interval():
    manager = Manager(interval=60.0)  # the next heartbeat would be a minute away
    agent = agent_for(manager)
    agent.start()
    try:
        wait_for(lambda: manager.count() == 1, 10, "the registration")
        agent.report_soon()
        wait_for(lambda: manager.count() == 2, 10, "a heartbeat for the news")
        agent.report_soon()
        agent.report_soon()  # news that comes together is one heartbeat
        wait_for(lambda: manager.count() == 3, 10, "a heartbeat for the next news")
        time.sleep(10 * SOON_GAP)
        assert manager.count() == 3
        assert [method for method, _ in manager.calls] == ["RegisterServer", "Heartbeat", "Heartbeat"]
        times = [at for _, at in manager.calls]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert min(gaps) >= SOON_GAP * 0.9  # a burst of news cannot make the agent hammer the manager
    finally:
        agent.stop(deregister=False)
    assert not agent._thread.is_alive()


def test_stop_ends_a_pause_at_once():
    manager = Manager(interval=60.0)
    agent = agent_for(manager)
    agent.start()
    wait_for(lambda: manager.count() == 1, 10, "the registration")
    started = time.monotonic()
    agent.stop(deregister=False)
    assert not agent._thread.is_alive()
    assert time.monotonic() - started < 30  # not the 60 s interval
