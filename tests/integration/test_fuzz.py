"""Every RPC of both daemons, called with random bytes and with mutated messages: a refused call
changes nothing, and no call takes a daemon down (bounded, loopback only)."""

from __future__ import annotations

import json
import math
import random

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kspeed.proto import kspeed_pb2
from tests.helpers import http_get

SEED = 20261122
CALLS_PER_METHOD = 12
STRINGS = ("", "x" * 5000, "evil\nFAKE log line", "\x00nul", "../../etc/passwd", "naïve", "srv-a")
INTS = (0, 1, 255, 2**31 - 1, 2**32 - 1)
SIGNED = (-1, -(2**63), 2**63 - 1)
FLOATS = (math.nan, math.inf, -math.inf, -1.0, 1e308)


def mutated(descriptor, rng: random.Random, depth: int = 0):
    """A message of ``descriptor``'s type with random, mostly hostile, field values."""
    message = kspeed_pb2.__dict__.get(descriptor.name)
    message = message() if message is not None else _message_class(descriptor)()
    for field in descriptor.fields:
        if rng.random() < 0.4:
            continue
        value = _value(field, rng, depth)
        if value is None:
            continue
        if field.is_repeated and field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue  # maps: leave empty (their keys are checked like any string)
        if field.is_repeated:
            container = getattr(message, field.name)
            for _ in range(rng.randint(1, 3)):
                item = _value(field, rng, depth)
                if field.message_type is not None:
                    container.add().CopyFrom(item)
                else:
                    container.append(item)
        elif field.message_type is not None:
            getattr(message, field.name).CopyFrom(value)
        else:
            setattr(message, field.name, value)
    return message


def _message_class(descriptor):
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def _value(field, rng: random.Random, depth: int):
    kinds = field.__class__
    if field.message_type is not None:
        if depth > 2 or field.message_type.full_name.startswith("google."):
            return None
        return mutated(field.message_type, rng, depth + 1)
    if field.type == kinds.TYPE_STRING:
        return rng.choice(STRINGS)
    if field.type == kinds.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 7, 64)))
    if field.type in (kinds.TYPE_DOUBLE, kinds.TYPE_FLOAT):
        return rng.choice(FLOATS)
    if field.type == kinds.TYPE_BOOL:
        return rng.random() < 0.5
    if field.type == kinds.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values])
    if field.type in (kinds.TYPE_INT32, kinds.TYPE_INT64, kinds.TYPE_SINT32, kinds.TYPE_SINT64):
        return rng.choice(SIGNED if field.type in (kinds.TYPE_INT64, kinds.TYPE_SINT64) else (-1, 2**31 - 1))
    if field.type in (kinds.TYPE_UINT64, kinds.TYPE_FIXED64):
        return rng.choice((*INTS, 2**64 - 1))
    return rng.choice(INTS)


def view(cluster) -> dict:
    """What a refused call must not change: servers (state, incarnation, what they registered with), datasets."""
    status = json.loads(http_get(cluster.http_address, "/v1/status")[1])
    servers = {s["id"]: (s["state"], s["incarnation"], s["address"], s["hostname"]) for s in status["servers"]}
    datasets = {
        d["name"]: (d.get("uri"), json.dumps(d.get("shares"), sort_keys=True)) for d in status.get("datasets", [])
    }
    return {"servers": servers, "datasets": datasets}


def call(channel: grpc.Channel, service: str, method, payload: bytes) -> bool:
    """Send ``payload`` as ``method``'s request; whether the daemon accepted it."""
    path = f"/{service}/{method.name}"
    identity = {"request_serializer": None, "response_deserializer": None}
    try:
        if method.client_streaming and method.server_streaming:
            list(channel.stream_stream(path, **identity)(iter([payload, payload]), timeout=2))
        elif method.client_streaming:
            channel.stream_unary(path, **identity)(iter([payload]), timeout=2)
        elif method.server_streaming:
            stream = channel.unary_stream(path, **identity)(payload, timeout=1)
            for _ in stream:
                break
            stream.cancel()
        else:
            channel.unary_unary(path, **identity)(payload, timeout=2)
    except grpc.RpcError as exc:  # refused, unless a watch merely waited (it was accepted)
        return exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and method.server_streaming
    return True


@pytest.mark.timeout(300)
def test_every_rpc_refuses_garbage_without_a_trace(cluster_factory, tmp_path):
    cluster = cluster_factory(1)
    rng = random.Random(SEED)
    targets = [
        ("kspeed.v1.Manager", cluster.address),
        ("kspeed.v1.Server", cluster.servers[0].ready["grpc"]),
    ]
    before = view(cluster)
    assert list(before["servers"]) == [cluster.servers[0].ready["id"]]  # the view sees what it guards
    accepted: list[str] = []
    refused = 0
    for service, address in targets:
        descriptor = kspeed_pb2.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[1]]
        with grpc.insecure_channel(address) as channel:
            for method in descriptor.methods:
                for k in range(CALLS_PER_METHOD):
                    if k % 2:
                        payload = mutated(method.input_type, rng).SerializeToString()
                    else:
                        payload = rng.randbytes(rng.choice((1, 16, 300)))
                    if call(channel, service, method, payload):
                        accepted.append(f"{service}/{method.name}")
                    else:
                        refused += 1
                        after = view(cluster)
                        assert after == before, f"a refused {service}/{method.name} changed the cluster"
                    before = view(cluster)
            # The daemon still answers, and says it is healthy.
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING, service
    assert cluster.manager.process.poll() is None and cluster.servers[0].process.poll() is None
    assert refused > len(accepted), accepted  # nearly everything was refused, and checked
    # Some calls are harmless enough to be taken (a status read, a watch); none registered a server.
    assert {s for s in view(cluster)["servers"]} == {cluster.servers[0].ready["id"]}
