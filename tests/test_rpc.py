"""gRPC plumbing without daemons: version negotiation, error mapping, token checks."""

from __future__ import annotations

import grpc
import pytest

from kspeed import errors
from kspeed.client import links
from kspeed.config import SecurityConfig
from kspeed.control import rpc
from kspeed.errors import AccessDeniedError, ConfigError
from kspeed.rdma.options import RailOptions


def test_negotiate_picks_highest_common_and_names_both_sides():
    assert rpc.negotiate([1, 2], local=(1, 2, 3)) == 2
    with pytest.raises(errors.VersionMismatchError) as info:
        rpc.negotiate([4, 5], local=(1,))
    assert "[1]" in str(info.value) and "[4, 5]" in str(info.value)
    assert info.value.remote == (4, 5)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.NotFoundError("x"), grpc.StatusCode.NOT_FOUND),
        (errors.VersionMismatchError("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.ProtocolError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.AccessDeniedError("x"), grpc.StatusCode.PERMISSION_DENIED),
        (errors.CapacityError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ValueError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_of(exc, code):
    assert rpc.status_of(exc) == code


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, trailing=()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


def test_error_from_rpc_prefers_the_named_class():
    exc = rpc.error_from_rpc(
        FakeRpcError(
            grpc.StatusCode.FAILED_PRECONDITION, "no common version", ((rpc.ERROR_HEADER, "VersionMismatchError"),)
        ),
        "manager at m:1",
    )
    assert isinstance(exc, errors.VersionMismatchError)
    assert str(exc) == "manager at m:1: no common version"
    exc = rpc.error_from_rpc(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "refused"), "manager at m:1")
    assert isinstance(exc, errors.UnavailableError) and "unreachable" in str(exc)
    # An unknown class name in the header cannot pick an arbitrary attribute of the module.
    exc = rpc.error_from_rpc(FakeRpcError(grpc.StatusCode.NOT_FOUND, "x", ((rpc.ERROR_HEADER, "__doc__"),)), "m")
    assert isinstance(exc, errors.NotFoundError)


def test_token_check_and_metadata():
    security = SecurityConfig(auth="token", token="t0k")
    metadata = rpc.call_metadata(security)
    assert rpc._token_ok(metadata, "t0k")
    assert not rpc._token_ok((("authorization", "Bearer other"),), "t0k")
    assert not rpc._token_ok((), "t0k")
    assert rpc.call_metadata(SecurityConfig(auth="none")) == ()
    assert rpc.server_interceptors(SecurityConfig(auth="none"), aio=False) == []


def test_bind_reports_address_in_use():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(1))
        with pytest.raises(errors.ConfigError, match=f"127.0.0.1:{port}"):
            rpc.bind(server, f"127.0.0.1:{port}", SecurityConfig(auth="none"))


def test_a_callers_addresses_come_from_its_grpc_peer():
    assert rpc.caller_addresses("ipv4:10.1.2.3:51234") == ("10.1.2.3",)
    assert rpc.caller_addresses("ipv6:[fe80::1]:51234") == ("fe80::1",)
    assert rpc.caller_addresses("unix:/run/kspeed.sock") == ("127.0.0.1", "::1")
    assert rpc.caller_addresses("something-else") == ()


def test_a_writer_dials_only_allowed_networks():
    RailOptions().check_dial("192.0.2.1", 7)  # nothing set: a caller of the rails decides
    options = RailOptions(dial_allow=("127.0.0.1", "10.0.0.0/8"))
    options.check_dial("127.0.0.1", 7)
    options.check_dial("10.200.0.9", 7)
    with pytest.raises(AccessDeniedError, match=r"receiver 192\.0\.2\.1:7 \(192\.0\.2\.1\) is neither"):
        options.check_dial("192.0.2.1", 7)
    with pytest.raises(ConfigError, match=r"data_networks: .10\.0\.0\.0/33. is no network"):
        RailOptions(dial_allow=("10.0.0.0/33",))


def test_a_busy_server_is_asked_again_shortly():
    answers = iter([errors.BusyError("busy"), errors.BusyError("busy"), "planned"])

    def call():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert links._when_not_busy(call) == "planned"
    with pytest.raises(errors.CapacityError):  # a real shortage is not retried
        links._when_not_busy(lambda: (_ for _ in ()).throw(errors.CapacityError("window full")))
