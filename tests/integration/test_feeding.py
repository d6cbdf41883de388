"""The servers' side of feeding, driven by hand through the rails (no client library).

These tests speak docs/feeding.md directly: open a ring, OpenFeed on every server, Lookup,
CommitPlan, grant batches and check the bytes that land, on every available rail.
"""

from __future__ import annotations

import json
import time

import grpc
import numpy as np
import pytest

from kspeed import grants
from kspeed.cli.cluster import wait_for
from kspeed.layout import batch_layout
from kspeed.proto import kspeed_pb2
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import available_rails, get_rail
from tests.helpers import client_for
from tests.integration.test_datasets import broadcast_lookup, make_tree, server_stubs


@pytest.fixture
def loaded(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "feed", max_size=96 * 1024)
    cluster = cluster_factory(
        2, server_args=["--backend-allow", str(tmp_path), "--memory", "16MiB", "--region-size", "1MiB"]
    )
    with client_for(cluster) as client:
        wait_for(lambda: len([r for r in client.servers() if r.state == 2]) == 2, 10, "ready")
        info = client.create_dataset(
            kspeed_pb2.DatasetSpec(name="feed", uri=str(tmp_path / "feed")), operator=True
        ).dataset
    return cluster, info, files


def commit(stub, feed_id, epoch, batch_size, ids, lengths, mine=None, *, positions=None):
    """Commit a server's part of the plan ``ids``/``lengths``: the positions ``mine`` (default:
    all), in two chunks; ``positions`` replaces the positions sent (to send wrong ones)."""
    layout = batch_layout(lengths, batch_size)
    mine = np.arange(len(ids)) if mine is None else np.array(sorted(mine), dtype=np.int64)
    sent = mine if positions is None else np.asarray(positions)

    def chunk(part, **head):
        p = mine[part]
        return kspeed_pb2.PlanChunk(
            ids=ids[p].astype("<i8").tobytes(),
            lengths=lengths[p].astype("<u4").tobytes(),
            positions=sent[part].astype("<u4").tobytes(),
            offsets=layout.offsets[p].astype("<i8").tobytes(),
            **head,
        )

    head = dict(feed_id=feed_id, epoch=epoch, batch_size=batch_size, count=len(ids))
    if len(mine) <= 50:  # one message
        return stub.CommitPlan(chunk(slice(None), **head), timeout=60)
    return stub.StreamPlan(iter([chunk(slice(0, 50), **head), chunk(slice(50, None))]), timeout=60)


@pytest.mark.parametrize("rail", available_rails())
def test_grants_land_byte_exact(loaded, rail):
    cluster, info, files = loaded
    keys = list(files)
    stubs = server_stubs(cluster, info)
    receiver = get_rail(rail).listen(RailOptions(io_timeout=5.0))
    try:
        ring = receiver.register(8 << 20)
        for stub in stubs.values():
            stub.OpenFeed(
                kspeed_pb2.OpenFeedRequest(
                    dataset="feed",
                    feed_id="rank0",
                    rail=rail,
                    material=receiver.material,
                    ring_key=ring.key.to_bytes(),
                    generation=3,
                    holder="test",
                ),
                timeout=30,
            )
        conn_of = {}
        deadline = time.monotonic() + 10
        while len(conn_of) < len(stubs) and time.monotonic() < deadline:
            receiver.poll(0.1)
            for conn, message in receiver.messages():
                hello = grants.decode(message)
                assert isinstance(hello, grants.Hello) and hello.generation == 3 and hello.feed == "rank0"
                conn_of[hello.server] = conn
        assert set(conn_of) == set(stubs)

        ids = np.random.default_rng(5).permutation(len(files))[:100]
        ids[7] = ids[3]  # a duplicate inside one batch: each position gets its own copy
        replies = broadcast_lookup(stubs, "feed", ids)
        lengths = np.zeros(len(ids), dtype=np.int64)
        owners = {}
        for sid, (pos, lens, _) in replies.items():
            lengths[pos] = lens
            owners[sid] = set(pos.tolist())
        for sid, stub in stubs.items():
            reply = commit(stub, "rank0", 0, 16, ids, lengths, owners[sid])
            assert reply.owned == len(owners[sid])

        layout = batch_layout(lengths, 16)
        offset, tag = 0, 0
        expected = {}
        for b in range(layout.num_batches):
            lo, hi = layout.positions(b)
            for sid, conn in conn_of.items():
                if owners[sid] & set(range(lo, hi)):
                    tag += 1
                    grant = np.zeros(1, grants.GRANT_DTYPE)
                    grant[0] = (0, b, offset, 0, 16, grants.make_tag(3, tag))
                    receiver.send(conn, grants.encode_grants(grant))
                    expected[grants.make_tag(3, tag)] = (b, offset)
            for p in range(lo, hi):
                expected.setdefault(("pos", p), offset + int(layout.offsets[p]))
            offset += int(layout.batch_bytes[b])
        seen = []
        deadline = time.monotonic() + 20
        while len(seen) < tag and time.monotonic() < deadline:
            done = receiver.poll(0.2)
            seen.extend(done.imm.tolist())
        assert sorted(seen) == sorted(k for k in expected if isinstance(k, int))  # exactly once each
        memory = ring.array()
        for p, sid in enumerate(ids.tolist()):
            start = expected[("pos", p)]
            assert memory[start : start + len(files[keys[sid]])].tobytes() == files[keys[sid]]
        for stub in stubs.values():
            stub.CloseFeed(kspeed_pb2.CloseFeedRequest(feed_id="rank0"), timeout=10)
    finally:
        receiver.close()


def test_a_server_dials_only_where_its_client_called_from(loaded):
    cluster, info, _ = loaded
    stub = server_stubs(cluster, info)[info.shares[0].server_id]

    def forged(rail: str, **fields) -> bytes:
        receiver = get_rail(rail).listen(RailOptions(io_timeout=5.0))
        try:
            ring = receiver.register(1 << 20)
            material = json.dumps({**json.loads(receiver.material), **fields}).encode()
            request = kspeed_pb2.OpenFeedRequest(
                dataset="feed",
                feed_id="forged",
                rail=rail,
                material=material,
                ring_key=ring.key.to_bytes(),
                generation=1,
            )
            with pytest.raises(grpc.RpcError) as exc:
                stub.OpenFeed(request, timeout=10)
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
            return exc.value.details()
        finally:
            receiver.close()

    # This test calls from loopback: a receiver anywhere else is refused before a packet is sent
    # (192.0.2.1 is a documentation address: dialling it would hang, not fail).
    if "tcp" in available_rails():
        why = forged("tcp", host="192.0.2.1", port=22)
        assert "receiver 192.0.2.1:22" in why and "not dialled" in why
    # The shm rail dials only a KSpeed receiver's socket, never another abstract socket of this user.
    why = forged("shm", socket="some-other-daemon")
    assert "'some-other-daemon', not a KSpeed receiver's" in why


def test_feed_errors_are_named(loaded):
    cluster, info, _ = loaded
    share = info.shares[0]
    stub = server_stubs(cluster, info)[share.server_id]
    receiver = get_rail("shm").listen(RailOptions(io_timeout=5.0))
    try:
        ring = receiver.register(1 << 20)
        good = dict(
            dataset="feed",
            feed_id="r1",
            rail="shm",
            material=receiver.material,
            ring_key=ring.key.to_bytes(),
            generation=1,
        )
        for field, value, code in (
            ("feed_id", "bad id!", grpc.StatusCode.INVALID_ARGUMENT),
            ("generation", 0, grpc.StatusCode.INVALID_ARGUMENT),
            ("rail", "carrier-pigeon", grpc.StatusCode.INVALID_ARGUMENT),
            ("dataset", "nope", grpc.StatusCode.NOT_FOUND),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                stub.OpenFeed(kspeed_pb2.OpenFeedRequest(**{**good, field: value}), timeout=10)
            assert exc.value.code() == code
        with pytest.raises(grpc.RpcError) as exc:
            commit(stub, "never-opened", 0, 4, np.arange(4), np.ones(4))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "never-opened" in exc.value.details()
        stub.OpenFeed(kspeed_pb2.OpenFeedRequest(**good), timeout=10)
        wrong = np.full(4, 3)  # lengths that disagree with the server's index
        with pytest.raises(grpc.RpcError) as exc:
            commit(stub, "r1", 0, 4, np.arange(share.first_id, share.first_id + 4), wrong)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "length" in exc.value.details()
        # A part of a plan names only this share's samples, at increasing positions within the plan.
        mine = np.arange(share.first_id, share.first_id + 4)
        lengths = broadcast_lookup({share.server_id: stub}, "feed", mine)[share.server_id][1]
        for ids, positions, needle in (
            (np.append(mine[:3], share.end_id), None, f"sample {share.end_id} of the plan is not in this share"),
            (mine, [0, 2, 1, 3], "positions must increase"),
            (mine, [0, 1, 2, 4], "positions must increase within the plan's 4 positions"),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                commit(stub, "r1", 0, 4, ids, lengths, positions=positions)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in exc.value.details()
        # A grant for an epoch without a plan is answered with ERROR, not silence.
        receiver.poll(1.0)
        conn = next(iter(receiver.connections))
        receiver.messages()
        grant = np.zeros(1, grants.GRANT_DTYPE)
        grant[0] = (9, 0, 0, 0, 4, grants.make_tag(1, 1))
        receiver.send(conn, grants.encode_grants(grant))
        got = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            receiver.poll(0.1)
            got = [grants.decode(m) for _, m in receiver.messages()]
        assert got and isinstance(got[0], grants.GrantError) and "no plan for epoch 9" in got[0].text
        assert got[0].sample == -1  # no sample is at fault
        # Latency probes: filler of the asked size at the asked offset, one completion; a bad size is named.
        memory = ring.array()
        memory[:] = 0xAB
        probe = np.zeros(2, grants.GRANT_DTYPE)
        probe[0] = (grants.PROBE_EPOCH, 0, 4096, 0, 256 << 10, grants.make_tag(1, 2))
        probe[1] = (grants.PROBE_EPOCH, 0, 0, 0, grants.MAX_PROBE + 1, grants.make_tag(1, 3))
        receiver.send(conn, grants.encode_grants(probe))
        done, got = [], []
        deadline = time.monotonic() + 5
        while (not done or not got) and time.monotonic() < deadline:
            done += receiver.poll(0.1).imm.tolist()
            got += [grants.decode(m) for _, m in receiver.messages()]
        assert done == [grants.make_tag(1, 2)]
        assert not memory[4096 : 4096 + (256 << 10)].any()
        assert (memory[:4096] == 0xAB).all() and (memory[4096 + (256 << 10) :] == 0xAB).all()
        assert (
            isinstance(got[0], grants.GrantError) and got[0].tag == grants.make_tag(1, 3) and "probe of" in got[0].text
        )
    finally:
        receiver.close()


def test_a_truncated_pass_serves_its_grants_before_the_cut_and_produces_nothing_from_it(cluster_factory, tmp_path):
    # A client re-split a plan from batch 16 on (into a new pass): the servers serve the batches
    # it granted before the cut, refuse a grant beyond it, and never read the samples of the
    # positions cut off. The dataset is streamed through a window of one region (about 100 of its
    # samples), so every sample a plan needs is read for it and the server's figures count each.
    files = make_tree(tmp_path / "cut", per_class=200, max_size=64 * 1024, seed=2)
    keys = list(files)
    cluster = cluster_factory(1, server_args=["--backend-allow", str(tmp_path)])
    with client_for(cluster) as client:
        wait_for(lambda: [r.state for r in client.servers()] == [2], 10, "ready")
        spec = kspeed_pb2.DatasetSpec(name="cut", uri=str(tmp_path / "cut"), quota_bytes=1 << 20, policy="stream")
        info = client.create_dataset(spec, operator=True).dataset
    assert [s.policy for s in info.shares] == ["stream"]
    (stub,) = server_stubs(cluster, info).values()
    receiver = get_rail("shm").listen(RailOptions(io_timeout=5.0))
    try:
        ring = receiver.register(16 << 20)
        stub.OpenFeed(
            kspeed_pb2.OpenFeedRequest(
                dataset="cut",
                feed_id="rank0",
                rail="shm",
                material=receiver.material,
                ring_key=ring.key.to_bytes(),
                generation=1,
            ),
            timeout=30,
        )
        conn = None
        deadline = time.monotonic() + 10
        while conn is None and time.monotonic() < deadline:
            receiver.poll(0.1)
            conn = next((c for c, m in receiver.messages() if isinstance(grants.decode(m), grants.Hello)), None)
        assert conn is not None
        ids = np.random.default_rng(8).permutation(len(files))[:512]
        (_, lengths, _) = broadcast_lookup({"s": stub}, "cut", ids)["s"]
        lengths = lengths.astype(np.int64)
        assert commit(stub, "rank0", 0, 16, ids, lengths).owned == 512
        cut = 16  # 256 of the plan's 512 positions come before it
        receiver.send(conn, grants.encode_truncate_plan(0, cut))
        layout = batch_layout(lengths, 16)
        starts = np.concatenate(([0], np.cumsum(layout.batch_bytes)))
        table = np.zeros(cut, grants.GRANT_DTYPE)
        for b in range(cut):
            table[b] = (0, b, int(starts[b]), 0, 16, grants.make_tag(1, b + 1))
        receiver.send(conn, grants.encode_grants(table))
        seen: list[int] = []
        deadline = time.monotonic() + 30
        while len(seen) < cut and time.monotonic() < deadline:
            seen += receiver.poll(0.2).imm.tolist()
        assert sorted(seen) == [grants.make_tag(1, b + 1) for b in range(cut)]  # every grant before the cut
        memory = ring.array()
        for p in range(16 * cut):
            at = int(starts[p // 16] + layout.offsets[p])
            assert memory[at : at + int(lengths[p])].tobytes() == files[keys[int(ids[p])]]
        beyond = np.zeros(1, grants.GRANT_DTYPE)
        beyond[0] = (0, cut, int(starts[cut]), 0, 16, grants.make_tag(1, 99))
        receiver.send(conn, grants.encode_grants(beyond))
        got: list = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            receiver.poll(0.1)
            got = [m for m in (grants.decode(m) for _, m in receiver.messages()) if isinstance(m, grants.GrantError)]
        assert got and got[0].tag == grants.make_tag(1, 99) and f"truncated at batch {cut}" in got[0].text
        # The server's figures of the epoch: only the positions before the cut are planned, all of
        # them written, and no sample of the cut-off part was read (each read counts as a miss).
        deadline = time.monotonic() + 20
        while True:
            (figures,) = stub.CheckShare(kspeed_pb2.CheckShareRequest(name="cut", limit=1), timeout=10).epochs
            if figures.written == 16 * cut:
                break
            assert time.monotonic() < deadline, f"the server never reported the batches written: {figures}"
            time.sleep(0.05)
        assert figures.planned == 16 * cut and figures.misses == figures.backend_requests <= 16 * cut, figures
        stub.CloseFeed(kspeed_pb2.CloseFeedRequest(feed_id="rank0"), timeout=10)
    finally:
        receiver.close()
