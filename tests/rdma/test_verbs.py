"""The ``verbs`` rail's own behaviour on the strict double of pyverbs (``tests/verbs_double``).

What every rail must do is the conformance suite's (``tests/conformance``, which runs ``verbs``
through the double too); these are the verbs-only parts: NIC choice, GIDs, credits for deep
queues, fencing by deregistration, and the finite retry settings.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kspeed.client.feeding.builder import rail_options_for
from kspeed.config import ClientConfig, load_config
from kspeed.errors import PeerLostError, RailUnavailableError
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import get_rail
from kspeed.rdma.topology import place
from kspeed.rdma.verbs import VerbsRail, nic
from kspeed.rdma.verbs.api import load_api
from kspeed.rdma.verbs.receiver_process import CREDITS
from tests.rdma.topology_fixtures import dgx_like

DOUBLE = "tests.verbs_double:api"


def _options(**extra) -> RailOptions:
    return RailOptions(token=b"verbs-test-token-0123456789", io_timeout=2.0, connect_timeout=3.0, **extra)


def _poll(rx, count: int, timeout: float = 10.0) -> list[int]:
    imms: list[int] = []
    deadline = time.monotonic() + timeout
    while len(imms) < count and time.monotonic() < deadline:
        imms += rx.poll(0.1).imm.tolist()
    return imms


def fence_and_expect_loss(rx, wr, key, data: bytes, offset: int) -> None:
    """Disconnect writer ``wr``; once the receiver process has deregistered its rings for it, the
    writer's further writes fail (its rkeys are dead at the NIC)."""
    rx.disconnect(wr.conn)
    deadline = time.monotonic() + 5
    while not rx.writer_gone(wr.conn) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rx.writer_gone(wr.conn)
    time.sleep(0.3)  # the receiver process has deregistered its rings for this writer
    with pytest.raises(PeerLostError):
        for i in range(50):
            wr.write(key, data, offset, imm=2 + i)
            time.sleep(0.02)


def test_without_a_device_the_rail_says_why():
    api = load_api(None)
    if api.device_names():
        pytest.skip("this host has an RDMA device")
    assert VerbsRail().unavailable_reason() == "no RDMA device on this host"
    with pytest.raises(RailUnavailableError, match="no RDMA device"):
        get_rail("verbs")


def test_a_forced_nic_that_is_not_there_is_an_error(verbs):
    with pytest.raises(RailUnavailableError, match=r"'mlx5_9' is not on this host \(devices: dbl0, dbl1\)"):
        verbs.listen(_options(nic="mlx5_9"))


def test_each_end_uses_its_nic_and_a_rocev2_gid(verbs):
    with verbs.listen(_options(nic="dbl1")) as rx:
        ring = rx.register(1 << 16)
        assert rx.nic == "dbl1"
        with verbs.connect(rx.material, _options(nic="dbl0")) as wr:
            assert wr._nic.name == "dbl0"
            api = wr._nic.api
            assert wr._nic.context.query_gid_type(nic.PORT, wr._nic.gid_index) == api.e.IBV_GID_TYPE_SYSFS_ROCE_V2
            wr.write(ring.key, b"abc", 0, imm=1)
            assert _poll(rx, 1) == [1]
            assert bytes(ring.view[:3]) == b"abc"


def test_retries_are_finite():
    # 7 means "retry forever" for RNR (IBA 9.7.5.2.8): a dead peer must fail a queue pair, not hang it
    assert 0 <= nic.RETRY_CNT < 7
    assert 0 <= nic.RNR_RETRY < 7


def test_thousands_of_immediates_in_one_batch_wait_for_credit(verbs):
    count = CREDITS * 12
    with verbs.listen(_options()) as rx:
        ring = rx.register(1 << 16)
        source = np.arange(4096, dtype=np.uint8)
        received: list[int] = []
        with verbs.connect(rx.material, _options()) as wr:
            imms = np.arange(count, dtype=np.uint32)
            done = threading.Event()

            def write() -> None:
                wr.write_batch(ring.key, source, [0], [4096], [0], imms)
                done.set()

            writer = threading.Thread(target=write)
            writer.start()
            deadline = time.monotonic() + 30
            while len(received) < count and time.monotonic() < deadline:
                received += rx.poll(0.1).imm.tolist()
            writer.join(10)
            assert done.is_set()
        assert received == list(range(count))
        assert bytes(ring.view[:4096]) == source.tobytes()


def test_disconnect_revokes_the_writers_keys(verbs):
    with verbs.listen(_options()) as rx:
        ring = rx.register(1 << 16)
        with verbs.connect(rx.material, _options()) as wr:
            wr.write(ring.key, b"first", 0, imm=1)
            assert _poll(rx, 1) == [1]
            fence_and_expect_loss(rx, wr, ring.key, b"late!", 16)
        assert bytes(ring.view[16:21]) != b"late!"
        assert bytes(ring.view[:5]) == b"first"


def test_the_placements_nic_reaches_the_rail(tmp_path, verbs, monkeypatch):
    host = dgx_like(tmp_path)
    gpu = host.gpus[5]
    placement = place(host.root, gpu_bus_id=gpu)
    assert placement.rail == "verbs" and placement.nic == host.nic_of[gpu]
    config = load_config(ClientConfig, environ={}, overrides={"security.auth": "none", "verbs_api": DOUBLE})
    options = rail_options_for(config, "127.0.0.1", placement)
    assert options.nic == placement.nic and options.verbs_api == DOUBLE
    # the receiver process's double has the fixture's NICs, so the rail opens the placed one
    monkeypatch.setenv("KSPEED_VERBS_DOUBLE_DEVICES", ",".join(sorted(set(host.nic_of.values()))))
    with verbs.listen(options) as rx:
        assert rx.nic == placement.nic
