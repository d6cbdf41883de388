"""gRPC plumbing without daemons: version negotiation, error mapping, token checks."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kspeed import errors
from kspeed.client.feeding import links
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


@contextlib.contextmanager
def serving(security: SecurityConfig) -> Iterator[str]:
    """A gRPC server on loopback with KSpeed's listener and interceptors: ``grpc.health.v1`` and one
    method that needs the token (``/test.Echo/Call``); yields its address."""
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=rpc.server_interceptors(security, aio=False))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Call": echo}),))
    address = rpc.bind(server, "127.0.0.1:0", security)
    server.start()
    try:
        yield address
    finally:
        server.stop(0)


def check_health(address: str, security: SecurityConfig) -> None:
    channel = rpc.open_channel(address, security)
    try:
        with rpc.map_rpc_errors(f"manager at {address}"):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        channel.close()


@pytest.fixture
def tls_files(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make a test certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kspeed",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return str(cert), str(key)


def test_a_tls_mismatch_is_named_with_the_settings_to_change(tls_files):
    cert, key = tls_files
    with serving(SecurityConfig(auth="none", tls_cert=cert, tls_key=key)) as address:
        check_health(address, SecurityConfig(auth="none", tls_ca=cert))  # matched: answers
        with pytest.raises(errors.UnavailableError) as info:
            check_health(address, SecurityConfig(auth="none"))
    said = str(info.value)
    assert "TLS mismatch" in said and "serves TLS" in said and "security.tls_ca (KSPEED_TLS_CA" in said
    with serving(SecurityConfig(auth="none")) as address, pytest.raises(errors.UnavailableError) as info:
        check_health(address, SecurityConfig(auth="none", tls_ca=cert))
    said = str(info.value)
    assert "TLS mismatch" in said and "dials with TLS" in said and "security.tls_cert (KSPEED_TLS_CERT" in said


def test_a_closed_socket_without_tls_behind_it_is_not_called_a_mismatch():
    with socket.socket() as sock:  # accepts, then closes at once: neither gRPC nor TLS
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        details = f"failed to connect to all addresses; last error: UNAVAILABLE: ipv4:{sock.getsockname()[0]}:"
        details += f"{sock.getsockname()[1]}: Socket closed"
        closer = threading.Thread(target=lambda: sock.accept()[0].close(), daemon=True)
        closer.start()
        assert rpc.tls_mismatch(details, probe=True) == ""
        closer.join(5)


def test_a_refused_token_names_the_settings_that_give_it():
    call = "/test.Echo/Call"
    with serving(SecurityConfig(auth="token", token="right")) as address:
        channel = rpc.open_channel(address, SecurityConfig(auth="none"))
        for security, why in (
            (SecurityConfig(auth="none"), "no bearer token was sent"),
            (SecurityConfig(auth="token", token="wrong"), "does not match"),
        ):
            with pytest.raises(errors.AuthError) as info, rpc.map_rpc_errors(f"manager at {address}"):
                channel.unary_unary(call)(b"x", metadata=rpc.call_metadata(security), timeout=5)
            said = str(info.value)
            assert why in said and "security.token_file (KSPEED_TOKEN_FILE, --token-file)" in said
        right = rpc.call_metadata(SecurityConfig(auth="token", token="right"))
        assert channel.unary_unary(call)(b"x", metadata=right, timeout=5) == b"x"
        channel.close()
