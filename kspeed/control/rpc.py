"""gRPC plumbing shared by the daemons, the client and the CLI.

One place for: the bearer-token interceptor, TLS credentials, binding listeners, building service
handlers straight from the protobuf descriptors (so a malformed or oversized request is answered
``INVALID_ARGUMENT`` before any servicer code runs), the mapping between :mod:`kspeed.errors` and
gRPC status codes in both directions, and the protocol-version negotiation.
"""

from __future__ import annotations

import contextlib
import hmac
import inspect
import logging
import re
import socket
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, cast

import grpc
from google.protobuf import message as pb_message

from kspeed import errors
from kspeed._version import PROTOCOL_VERSIONS
from kspeed.config import DaemonConfig, SecurityConfig, setting
from kspeed.proto import kspeed_pb2

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
#: Methods answered without a token: health checks reveal nothing but SERVING or not, and
#: Kubernetes' gRPC probes (and load balancers) send no credentials.
OPEN_METHODS = "/grpc.health.v1.Health/"
ERROR_HEADER = "kspeed-error"  # trailing metadata naming the kspeed.errors class of a failure

# kspeed.errors class -> gRPC status, most specific first.
_STATUS_OF: list[tuple[type[Exception], grpc.StatusCode]] = [
    (errors.VersionMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ProtocolError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.AccessDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.ConflictError, grpc.StatusCode.ALREADY_EXISTS),
    (errors.StateError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.StateFileError, grpc.StatusCode.RESOURCE_EXHAUSTED),  # gRPC's word for "the file system is full"
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.DatasetError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.TransportError, grpc.StatusCode.UNAVAILABLE),
    (errors.KSpeedError, grpc.StatusCode.INTERNAL),
]

# gRPC status -> kspeed.errors class, for failures that carry no ERROR_HEADER.
_ERROR_OF: dict[grpc.StatusCode, type[errors.KSpeedError]] = {
    grpc.StatusCode.UNAUTHENTICATED: errors.AuthError,
    grpc.StatusCode.PERMISSION_DENIED: errors.AuthError,
    grpc.StatusCode.NOT_FOUND: errors.NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: errors.ConflictError,
    grpc.StatusCode.INVALID_ARGUMENT: errors.ProtocolError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.StateError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.CapacityError,
    grpc.StatusCode.UNAVAILABLE: errors.UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.UnavailableError,
}


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code that reports ``exc`` to a caller."""
    for cls, code in _STATUS_OF:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def negotiate(remote: Sequence[int], local: Sequence[int] = PROTOCOL_VERSIONS) -> int:
    """The highest protocol version both sides speak.

    Raises:
        VersionMismatchError: naming the versions of each side.
    """
    common = set(local) & set(remote)
    if not common:
        raise errors.VersionMismatchError(
            f"no common protocol version: this side speaks {sorted(local)}, the peer speaks {sorted(remote)}",
            local=tuple(local),
            remote=tuple(remote),
        )
    return max(common)


def peer_version() -> kspeed_pb2.PeerVersion:
    """This build's version announcement."""
    from kspeed._version import FEATURES, __version__

    return kspeed_pb2.PeerVersion(protocol_versions=PROTOCOL_VERSIONS, features=FEATURES, software_version=__version__)


# ---------------------------------------------------------------------------------------------
# Authentication


def _token_ok(metadata: Sequence[tuple[str, Any]] | None, token: str) -> bool:
    expected = f"Bearer {token}".encode()
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            given = value.encode() if isinstance(value, str) else bytes(value)
            return hmac.compare_digest(given, expected)
    return False


def _allowed(details: grpc.HandlerCallDetails, token: str) -> bool:
    method = getattr(details, "method", "") or ""
    return method.startswith(OPEN_METHODS) or _token_ok(details.invocation_metadata, token)


def _refusal(details: grpc.HandlerCallDetails) -> str:
    """Why a call's token was refused: none was sent, or it is not this daemon's."""
    if any(key == AUTH_HEADER for key, _ in details.invocation_metadata or ()):
        return "the bearer token does not match this daemon's"
    return "no bearer token was sent and this daemon requires one"


def token_ok(header: str | None, token: str) -> bool:
    """Whether an HTTP ``Authorization`` header carries the bearer ``token`` (compared in constant time)."""
    return header is not None and hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


def _deny(handler: grpc.RpcMethodHandler | None, aio: bool, message: str) -> grpc.RpcMethodHandler | None:
    if handler is None:
        return None

    async def abort_async(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def abort_sync(request: Any, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    deny: Callable[..., Any] = abort_async if aio else abort_sync
    kind = (
        ("stream" if handler.request_streaming else "unary")
        + "_"
        + ("stream" if handler.response_streaming else "unary")
    )
    # The denial answers before reading the body: deserialization is left to the identity.
    return getattr(grpc, f"{kind}_rpc_method_handler")(deny)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call of a sync server whose bearer token is missing or wrong."""

    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if _allowed(handler_call_details, self._token):
            return handler
        return _deny(handler, aio=False, message=_refusal(handler_call_details))


class AioTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call of an asyncio server whose bearer token is missing or wrong."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if _allowed(handler_call_details, self._token):
            return handler
        return _deny(handler, aio=True, message=_refusal(handler_call_details))


def server_interceptors(security: SecurityConfig, *, aio: bool) -> list[Any]:
    """The interceptors a daemon's gRPC server needs for ``security``."""
    if security.auth != "token":
        return []
    return [AioTokenInterceptor(security.token) if aio else TokenInterceptor(security.token)]


def call_metadata(security: SecurityConfig) -> tuple[tuple[str, str], ...]:
    """Metadata to send on every call to a daemon."""
    if security.auth == "token" and security.token:
        return ((AUTH_HEADER, f"Bearer {security.token}"),)
    return ()


# ---------------------------------------------------------------------------------------------
# Listeners and channels


def bind(server: grpc.Server | grpc.aio.Server, address: str, security: SecurityConfig) -> str:
    """Bind ``server`` to ``address`` (TLS if configured) and return the bound ``host:port``.

    Raises:
        ConfigError: when the address cannot be bound (in use, not local, no permission).
    """
    host = address.rpartition(":")[0]
    check_bindable(address)
    try:
        if security.tls_cert:
            creds = grpc.ssl_server_credentials(
                [(security.read_pem("tls_key") or b"", security.read_pem("tls_cert") or b"")]
            )
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise errors.ConfigError(
            f"cannot listen on {address}: {exc} (address in use or not local?)", field="listen", value=address
        ) from exc
    if not port:
        raise errors.ConfigError(
            f"cannot listen on {address}: address in use or not local", field="listen", value=address
        )
    return f"{host}:{port}"


def check_bindable(address: str) -> None:
    """Try the bind ourselves first: gRPC's own failure is a C-level log line and a vague error.

    Raises:
        ConfigError: naming the address and why it cannot be bound.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if int(port) == 0:
        return
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise errors.ConfigError(f"cannot listen on {address}: {exc.strerror}", field="listen", value=address) from exc
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise errors.ConfigError(
                f"cannot listen on {address}: {(exc.strerror or str(exc)).lower()}", field="listen", value=address
            ) from exc


#: Longest wait between a channel's attempts to reconnect (gRPC's own default grows to 120 s, so a
#: daemon that came back would be found only long after: a restarted manager would declare healthy
#: servers failed before they dialled again).
MAX_RECONNECT_BACKOFF_MS = 1_000


def caller_addresses(peer: str) -> tuple[str, ...]:
    """The addresses a gRPC caller (``context.peer()``) called from: its IP, or loopback for a
    Unix-socket caller (on this host); nothing for a peer gRPC does not describe."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return (rest.rsplit(":", 1)[0],)
    if kind == "ipv6":
        return (rest.rsplit(":", 1)[0].strip("[]"),)
    if kind in ("unix", "unix-abstract"):
        return ("127.0.0.1", "::1")
    return ()


def channel_options(max_message_bytes: int = 64 * 1024**2) -> list[tuple[str, Any]]:
    """Options of every channel: bounded messages, keepalive so a dead peer is noticed, and a
    reconnect backoff bounded by :data:`MAX_RECONNECT_BACKOFF_MS` so a peer that returns is found at once."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


def server_options(max_request_bytes: int) -> list[tuple[str, Any]]:
    """Options of every daemon's gRPC server.

    gRPC's own limit is set above ``max_request_bytes`` so that oversized requests reach the
    descriptor-built handlers and get a precise ``INVALID_ARGUMENT``; far larger ones are cut by
    gRPC itself with ``RESOURCE_EXHAUSTED``.
    """
    return [
        ("grpc.max_receive_message_length", 2 * max_request_bytes + 1024),
        ("grpc.max_send_message_length", 256 * 1024**2),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.so_reuseport", 0),
    ]


def listener_options(config: DaemonConfig) -> list[tuple[str, Any]]:
    """Options that bound a daemon's gRPC connections: how many at once (more are closed as they
    come), how long a handshake may take in all (TLS and the HTTP/2 preface, however it trickles),
    and how long a connection may carry no call before it is closed.

    gRPC cannot cap connections per address: their streams are capped per address instead
    (:mod:`kspeed.control.streams`), and a connection without a call does not outlive
    ``connection_idle_timeout``; deploy/README.md shows a firewall rule for a per-address cap.
    """
    return [
        ("grpc.max_allowed_incoming_connections", config.max_connections),
        ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout * 1000)),
        ("grpc.max_connection_idle_ms", int(config.connection_idle_timeout * 1000)),
    ]


def open_channel(address: str, security: SecurityConfig, *, aio: bool = False) -> Any:
    """A channel to a daemon, secure when a CA bundle is configured."""
    module = grpc.aio if aio else grpc
    if security.tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=security.read_pem("tls_ca"))
        return module.secure_channel(address, creds, options=channel_options())
    return module.insecure_channel(address, options=channel_options())


# ---------------------------------------------------------------------------------------------
# Error mapping


@contextlib.contextmanager
def map_rpc_errors(what: str) -> Iterator[None]:
    """Convert a failed call into the matching :class:`~kspeed.errors.KSpeedError` (a connection the
    daemon closed at once is checked for a daemon that serves TLS: see :func:`error_from_rpc`).

    Args:
        what: the call's target for messages, e.g. ``"manager at 127.0.0.1:7070"``.
    """
    try:
        yield
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, what, probe_tls=True) from exc


#: A TLS client's handshake with a plaintext gRPC server (BoringSSL reads HTTP/2 as a bad record).
_PLAINTEXT_PEER = "WRONG_VERSION_NUMBER"
#: A plaintext client's connection to a TLS server: the server hangs up on the HTTP/2 preface.
_CLOSED_AT_ONCE = re.compile(r"\b(ipv4|ipv6):(\S+):(\d+): Socket closed")
TLS_PROBE_TIMEOUT = 1.0


def speaks_tls(host: str, port: int, timeout: float = TLS_PROBE_TIMEOUT) -> bool:
    """Whether ``host:port`` completes a TLS handshake (its certificate unchecked: this tells a TLS
    listener from a plaintext one, nothing more)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, port), timeout) as raw, context.wrap_socket(raw):
            return True
    except OSError:  # ssl.SSLError included: not TLS, or gone
        return False


def tls_mismatch(details: str, *, probe: bool) -> str:
    """What to change when a failed connection's ``details`` show a TLS mismatch ("" when they do not).

    A TLS client's failed handshake with a plaintext daemon is in the details. A plaintext client
    sees only a closed socket; with ``probe`` the peer is asked for a TLS handshake to tell a daemon
    that serves TLS from one that went away (a blocking connect of at most
    :data:`TLS_PROBE_TIMEOUT`, for callers outside an event loop).
    """
    if _PLAINTEXT_PEER in details:
        return (
            f"TLS mismatch: this process dials with TLS ({setting('security.tls_ca')} is set) but the daemon serves "
            f"without it: give the daemon {setting('security.tls_cert')} and {setting('security.tls_key')}, or "
            "leave tls_ca unset here"
        )
    found = _CLOSED_AT_ONCE.search(details) if probe else None
    if found is not None and speaks_tls(urllib.parse.unquote(found.group(2)).strip("[]"), int(found.group(3))):
        return (
            f"TLS mismatch: the daemon serves TLS (it has tls_cert and tls_key) but this process dials without it: "
            f"set {setting('security.tls_ca')} to the CA bundle that signed the daemon's certificate"
        )
    return ""


def error_from_rpc(exc: grpc.RpcError, what: str, *, probe_tls: bool = False) -> errors.KSpeedError:
    """The :class:`~kspeed.errors.KSpeedError` that stands for a failed call.

    A refused token says which settings give the cluster's token; a connection that failed for a
    TLS mismatch says so and which TLS settings to change (``probe_tls``: see :func:`tls_mismatch`).
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = ""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for metadatum in trailing or ():
        # A (key, value) pair at run time on both sync and aio channels, whatever the stubs say.
        key, value = cast("tuple[str, str | bytes]", metadatum)
        if key == ERROR_HEADER:
            name = value if isinstance(value, str) else value.decode(errors="replace")
    cls = getattr(errors, name, None) if name in errors.__all__ else None
    if cls is None:
        cls = _ERROR_OF.get(code, errors.KSpeedError)
    if code == grpc.StatusCode.UNAVAILABLE and not name and (mismatch := tls_mismatch(details or "", probe=probe_tls)):
        return cls(f"{what}: {mismatch} ({details})")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not name:
        return cls(f"{what} is unreachable ({code.name.lower()}: {details})")
    if code == grpc.StatusCode.UNAUTHENTICATED and not name:
        return cls(
            f"{what}: {details}: every process of the cluster must use the same token; set "
            f"{setting('security.token_file')} to the cluster's token file (or {setting('security.token')})"
        )
    return cls(f"{what}: {details}")


# ---------------------------------------------------------------------------------------------
# Service handlers built from descriptors


def _parse(cls: type[pb_message.Message], data: bytes, limit: int, method: str) -> pb_message.Message | str:
    """The parsed request, or a message saying why it was refused."""
    if len(data) > limit:
        return f"{method}: request of {len(data)} bytes exceeds the limit of {limit} bytes"
    try:
        return cls.FromString(data)
    except pb_message.DecodeError as exc:
        return f"{method}: malformed request: {exc}"


def _abort_args(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    return status_of(exc), str(exc), ((ERROR_HEADER, type(exc).__name__),)


def _sync_behavior(fn: Callable, cls: type, limit: int, method: str, streaming_in: bool, streaming_out: bool):
    def convert(context: grpc.ServicerContext, exc: errors.KSpeedError) -> None:
        code, details, trailing = _abort_args(exc)
        context.set_trailing_metadata(trailing)
        context.abort(code, details)

    def parse_one(data: bytes, context: grpc.ServicerContext) -> Any:
        parsed = _parse(cls, data, limit, method)
        if isinstance(parsed, str):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, parsed)
        return parsed

    def prepare(request: Any, context: grpc.ServicerContext) -> Any:
        return (parse_one(d, context) for d in request) if streaming_in else parse_one(request, context)

    def streaming(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from fn(prepare(request, context), context)
        except errors.KSpeedError as exc:
            convert(context, exc)

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(prepare(request, context), context)
        except errors.KSpeedError as exc:
            convert(context, exc)

    return streaming if streaming_out else unary


def _aio_behavior(fn: Callable, cls: type, limit: int, method: str, streaming_in: bool, streaming_out: bool):
    async def convert(context: grpc.aio.ServicerContext, exc: errors.KSpeedError) -> None:
        code, details, trailing = _abort_args(exc)
        context.set_trailing_metadata(trailing)
        await context.abort(code, details)

    async def parse_one(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        parsed = _parse(cls, data, limit, method)
        if isinstance(parsed, str):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, parsed)
        return parsed

    async def parse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async for data in request:
            yield await parse_one(data, context)

    async def prepare(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return parse_stream(request, context) if streaming_in else await parse_one(request, context)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        req = await prepare(request, context)
        try:
            async for item in fn(req, context):
                yield item
        except errors.KSpeedError as exc:
            await convert(context, exc)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        req = await prepare(request, context)
        try:
            return await fn(req, context)
        except errors.KSpeedError as exc:
            await convert(context, exc)

    return streaming if streaming_out else unary


def service_handler(service: str, servicer: object, *, max_request_bytes: int) -> grpc.GenericRpcHandler:
    """Handlers for every method of ``kspeed.v1.<service>``, implemented by ``servicer``.

    The servicer has one method per RPC, named as in the .proto, taking ``(request, context)``:
    plain functions for a sync server, coroutines / async generators for ``grpc.aio``. Requests
    arrive parsed; a malformed or oversized one is answered ``INVALID_ARGUMENT`` and never reaches
    the servicer; a :class:`~kspeed.errors.KSpeedError` raised by the servicer becomes the
    matching status with the error's class in trailing metadata.
    """
    descriptor = kspeed_pb2.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for method in descriptor.methods:
        fn = getattr(servicer, method.name)
        cls = getattr(kspeed_pb2, method.input_type.name)
        aio = inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)
        make = _aio_behavior if aio else _sync_behavior
        behavior = make(fn, cls, max_request_bytes, method.full_name, method.client_streaming, method.server_streaming)
        kind = (
            ("stream" if method.client_streaming else "unary")
            + "_"
            + ("stream" if method.server_streaming else "unary")
        )
        handlers[method.name] = getattr(grpc, f"{kind}_rpc_method_handler")(
            behavior, request_deserializer=None, response_serializer=lambda msg: msg.SerializeToString()
        )
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)
