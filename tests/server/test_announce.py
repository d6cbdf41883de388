"""The address a server announces, and why (no daemon: name resolution and routes are stubbed)."""

from __future__ import annotations

import pytest

from kspeed.server import announce as an


@pytest.fixture
def network(monkeypatch):
    """``routes``: manager host -> the local address towards it; ``names``: host name -> its addresses here."""
    routes: dict[str, str | None] = {}
    names: dict[str, list[str]] = {}
    monkeypatch.setattr(an, "_route_to", lambda address: routes.get(address.rpartition(":")[0]))
    monkeypatch.setattr(an, "_addresses_of", lambda name: names.get(name, []))
    return routes, names


def test_the_configured_address_wins(network):
    assert an.announce("0.0.0.0:7071", "node7.example:7071", "mgr:7070").address == "node7.example:7071"


def test_a_wildcard_listen_announces_the_route_to_the_manager_not_a_loopback_hostname(network):
    routes, names = network
    routes["mgr"] = "10.0.0.5"
    names["vm"] = ["127.0.1.1"]  # Debian's /etc/hosts entry for the host's own name
    got = an.announce("0.0.0.0:7071", "", "mgr:7070", hostname="vm")
    assert got.address == "10.0.0.5:7071" and "route to the manager" in got.how and not got.doubt
    assert an.http_address("0.0.0.0:7081", got) == "10.0.0.5:7081"
    routes["mgr"] = "fd00::5"
    assert an.announce("[::]:7071", "", "mgr:7070", hostname="vm").address == "[fd00::5]:7071"


def test_a_local_manager_gets_the_hostname_when_it_resolves_elsewhere(network):
    routes, names = network
    routes["127.0.0.1"] = "127.0.0.1"
    names["vm"] = ["192.0.2.2"]
    got = an.announce("0.0.0.0:7071", "", "127.0.0.1:7070", hostname="vm")
    assert got.address == "vm:7071" and not got.doubt
    names["vm"] = ["127.0.0.1"]
    got = an.announce("0.0.0.0:7071", "", "127.0.0.1:7070", hostname="vm")
    assert got.address == "127.0.0.1:7071" and "other hosts" in got.doubt


def test_doubts_are_said(network):
    routes, _ = network
    got = an.announce("0.0.0.0:7071", "", "nowhere.example:7070", hostname="vm")
    assert got.address == "vm:7071" and "does not resolve" in got.doubt and "nowhere.example:7070" in got.doubt
    routes["mgr"] = "10.0.0.5"
    got = an.announce("127.0.0.1:7071", "", "mgr:7070")
    assert got.address == "127.0.0.1:7071" and "loopback" in got.doubt
    assert an.http_address("127.0.0.1:7081", got) == "127.0.0.1:7081"
