"""Bounding the streams of the daemons' gRPC servers: how many, from whom, and how long idle.

A synchronous gRPC server runs every call on one of its pool's threads, and a streaming call holds
its thread until the stream ends: twenty idle streams (of ``Lookup``, a stream then) on a pool of
sixteen starved the health checks until the manager called the server suspect. An asyncio server
holds no thread per stream, but each open stream still costs memory. The guards are interceptors:

- at most ``limit`` streaming calls at once, and at most ``per_peer`` of them from one address;
  one more is answered ``RESOURCE_EXHAUSTED`` at once (:class:`~kspeed.errors.BusyError`: the
  caller retries), never queued;
- ``grpc.health.v1`` ``Watch`` streams need no token (:data:`~kspeed.control.rpc.OPEN_METHODS`), so
  they have a budget of their own (``watches``, a quarter of it per address) and never take a
  stream a token holder needs: 28 of them from one address made that address's ``StreamPlan``
  calls ``BusyError``; an asyncio daemon answers a refused one after :data:`REFUSAL_DELAY_S`, so
  that a caller renewing them pays the wait instead of the daemon paying the refusals;
- a stream that waits longer than ``idle_s`` for its caller's next message is cancelled, and a
  ``Watch`` that has had no change of status to send for ``idle_s`` is ended (its caller watches
  again and hears the current status at once), so idle or abandoned streams give back what they
  hold. Streams of token holders that wait on the daemon (the manager's ``WatchMembership``) stay
  open as long as their caller keeps them.

``Watch`` is served the way grpc_health means it to be on a sync server, without a thread of its
own (``experimental_non_blocking``); a guard that wrapped it in a plain function made it block a
pool thread for as long as the stream lasted.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from kspeed.admission import worth_telling
from kspeed.control.rpc import ERROR_HEADER, OPEN_METHODS
from kspeed.errors import BusyError

__all__ = ["AioStreamGuard", "StreamGuard", "peer_address"]

log = logging.getLogger(__name__)

# An asyncio daemon answers a health Watch refused at its cap after this long: a caller without a
# token that renews refused watches at once made the manager refuse ~180 a second (a tenth of a
# core, taken from whatever shares it). Waiting costs an asyncio server nothing but the stream.
REFUSAL_DELAY_S = 1.0
MAX_DELAYED = 256  # refusals waiting at once; beyond, answered at once


class _Stream:
    """One open streaming call.

    Attributes:
        peer: the caller's address.
        watch: a stream without a token (a health ``Watch``): its own budget.
        idle_since: since when it has waited for its caller (request streams) or had nothing to send
            (watches); ``None`` while it is not idle, or when idleness is not held against it.
        end: ends it (cancel, or finish cleanly), for the watchdog.
        sent: messages written so far (asyncio streams).
    """

    def __init__(self, peer: str, watch: bool) -> None:
        self.peer = peer
        self.watch = watch
        self.idle_since: float | None = time.monotonic() if watch else None
        self.end: Callable[[], Any] = lambda: None
        self.sent = 0


class _Admission:
    """Which streams are open, and whether one more may open (shared by both guards)."""

    def __init__(self, limit: int, per_peer: int, watches: int, idle_s: float) -> None:
        self.limit, self.per_peer, self.idle_s = max(limit, 1), max(per_peer, 1), idle_s
        self.watches, self.watches_per_peer = max(watches, 1), max(watches // 4, 1)
        self.refused = 0
        self.ended = 0
        self._lock = threading.Lock()
        self._open: list[_Stream] = []

    def admit(self, peer: str, method: str) -> _Stream | str:
        """A new stream of ``method`` from ``peer``, or why it is refused."""
        watch = method.startswith(OPEN_METHODS)
        limit, per_peer = (self.watches, self.watches_per_peer) if watch else (self.limit, self.per_peer)
        with self._lock:
            same = [s for s in self._open if s.watch == watch]
            mine = sum(1 for s in same if s.peer == peer)
            if len(same) < limit and mine < per_peer:
                stream = _Stream(peer, watch)
                self._open.append(stream)
                return stream
            self.refused += 1
            refused, busy = self.refused, len(same)
        what = "health watches" if watch else "streams"
        log.log(
            logging.WARNING if worth_telling(refused) else logging.DEBUG,
            "refused %s from %s: %d %s open (%d of them from it; %d refused so far)",
            method,
            peer,
            busy,
            what,
            mine,
            refused,
        )
        return (
            f"this daemon has {busy} {what} open ({mine} from {peer}), at most {limit} ({per_peer} per caller); "
            "retry shortly"
        )

    def leave(self, stream: _Stream) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._open.remove(stream)

    def end_idle(self) -> None:
        """End every stream idle for longer than ``idle_s``."""
        now = time.monotonic()
        with self._lock:
            idle = [s for s in self._open if s.idle_since is not None and now - s.idle_since > self.idle_s]
        for stream in idle:
            self.ended += 1
            stream.idle_since = None  # (ended once)
            if stream.watch:
                log.info("ended a health watch from %s: nothing to send for %.0f s", stream.peer, self.idle_s)
            else:
                log.warning("cancelled a stream from %s: no message for %.0f s", stream.peer, self.idle_s)
            stream.end()

    def open_watches(self) -> list[_Stream]:
        """The health ``Watch`` streams open now."""
        with self._lock:
            return [s for s in self._open if s.watch]

    def count(self) -> int:
        with self._lock:
            return len(self._open)


def _kind(handler: grpc.RpcMethodHandler) -> str:
    return (
        ("stream" if handler.request_streaming else "unary")
        + "_"
        + ("stream" if handler.response_streaming else "unary")
    )


class _Counted:
    """What both guards report of their admission."""

    _admission: _Admission

    @property
    def refused(self) -> int:
        """Streams refused at a cap so far."""
        return self._admission.refused

    @property
    def cancelled(self) -> int:
        """Streams ended for idleness so far."""
        return self._admission.ended


class StreamGuard(_Counted, grpc.ServerInterceptor):
    """Bounds a sync server's streaming calls (see the module docstring).

    Args:
        limit: streaming calls of token holders at once (the pool's threads less those kept for unary calls).
        per_peer: such calls at once from one caller address.
        idle_s: longest wait for a caller's next message, or a watch's for something to send.
        watches: health ``Watch`` streams at once (a quarter of them per address); they hold no thread.
    """

    def __init__(self, limit: int, per_peer: int, idle_s: float, *, watches: int = 16) -> None:
        self._admission = _Admission(limit, per_peer, watches, idle_s)
        self.limit, self.per_peer, self.idle_s = self._admission.limit, self._admission.per_peer, idle_s
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="kspeed-stream-watch", daemon=True)
        self._watchdog.start()

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        kind = _kind(handler)
        guarded = self._guarded(getattr(handler, kind), handler_call_details.method, handler.request_streaming)
        return getattr(grpc, f"{kind}_rpc_method_handler")(
            guarded, handler.request_deserializer, handler.response_serializer
        )

    def _guarded(self, behavior: Callable, method: str, streaming_requests: bool) -> Callable:
        if getattr(behavior, "experimental_non_blocking", False):
            return self._guarded_non_blocking(behavior, method)

        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            stream = self._admit(context, method)
            stream.end = context.cancel
            try:
                result = behavior(self._watched(request, stream) if streaming_requests else request, context)
                if isinstance(result, Iterator):  # a response stream: the slot is held while it runs
                    return self._held(result, stream)
                self._admission.leave(stream)
                return result
            except BaseException:
                self._admission.leave(stream)
                raise

        return guarded

    def _guarded_non_blocking(self, behavior: Callable, method: str) -> Callable:
        """A response stream that sends through a callback, holding no thread (health ``Watch``)."""

        def guarded(request: Any, context: grpc.ServicerContext, send_response_callback: Callable) -> Any:
            stream = self._admit(context, method)
            if not context.add_callback(lambda: self._admission.leave(stream)):
                self._admission.leave(stream)  # (already over)
            stream.end = lambda: send_response_callback(None)  # the end of the stream, status OK

            def send(response: Any) -> None:
                if response is not None and stream.idle_since is not None:
                    stream.idle_since = time.monotonic()
                send_response_callback(response)

            return behavior(request, context, send_response_callback=send)

        guarded.experimental_non_blocking = True  # type: ignore[attr-defined]
        guarded.experimental_thread_pool = getattr(behavior, "experimental_thread_pool", None)  # type: ignore[attr-defined]
        return guarded

    def _admit(self, context: grpc.ServicerContext, method: str) -> _Stream:
        admitted = self._admission.admit(peer_address(context.peer()), method)
        if isinstance(admitted, _Stream):
            return admitted
        context.set_trailing_metadata(((ERROR_HEADER, BusyError.__name__),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, admitted)
        raise AssertionError("unreachable: abort raises")

    def _watched(self, requests: Iterator[Any], stream: _Stream) -> Iterator[Any]:
        while True:
            stream.idle_since = time.monotonic()
            try:
                message = next(requests)
            except StopIteration:
                return
            finally:
                stream.idle_since = None
            yield message

    def _held(self, responses: Iterator[Any], stream: _Stream) -> Iterator[Any]:
        try:
            for response in responses:
                if stream.idle_since is not None:
                    stream.idle_since = time.monotonic()
                yield response
        finally:
            self._admission.leave(stream)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.idle_s / 2)):
            self._admission.end_idle()

    def open_streams(self) -> int:
        """Streaming calls open now."""
        return self._admission.count()

    def end_watches(self) -> int:
        """End every health ``Watch`` (status OK, after the NOT_SERVING the daemon sent as it began
        to stop): a stopping server's gRPC grace period waits for the calls still open, and a
        watcher's stream held it for the whole ``drain_timeout``. Returns how many were ended."""
        watches = self._admission.open_watches()
        for stream in watches:  # (a sync health servicer has sent the new status already)
            stream.end()
        return len(watches)

    def close(self) -> None:
        """Stop the watchdog."""
        self._stop.set()
        self._watchdog.join(timeout=5)


class AioStreamGuard(_Counted, grpc.aio.ServerInterceptor):
    """Bounds an asyncio server's streaming calls (see the module docstring).

    Args:
        limit: streaming calls of token holders at once.
        per_peer: such calls at once from one caller address.
        idle_s: longest wait for a caller's next message, or a watch's for something to send.
        watches: health ``Watch`` streams at once (a quarter of them per address).
    """

    def __init__(self, limit: int, per_peer: int, idle_s: float, *, watches: int = 16) -> None:
        self._admission = _Admission(limit, per_peer, watches, idle_s)
        self.idle_s = idle_s
        self._watchdog: asyncio.Task[None] | None = None
        self._delayed = 0  # refused watches waiting for their answer

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch(), name="kspeed-stream-watch")
        kind = _kind(handler)
        behavior = getattr(handler, kind)
        method = handler_call_details.method
        if inspect.isasyncgenfunction(behavior):
            guarded: Callable = self._guarded_generator(behavior, method, handler.request_streaming)
        else:
            guarded = self._guarded_coroutine(behavior, method, handler.request_streaming)
        return getattr(grpc, f"{kind}_rpc_method_handler")(
            guarded, handler.request_deserializer, handler.response_serializer
        )

    async def _admit(self, context: grpc.aio.ServicerContext, method: str) -> _Stream:
        admitted = self._admission.admit(peer_address(context.peer()), method)
        if isinstance(admitted, _Stream):
            return admitted
        if method.startswith(OPEN_METHODS) and self._delayed < MAX_DELAYED:
            self._delayed += 1
            try:
                await asyncio.sleep(REFUSAL_DELAY_S)
            finally:
                self._delayed -= 1
        context.set_trailing_metadata(((ERROR_HEADER, BusyError.__name__),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, admitted)
        raise AssertionError("unreachable: abort raises")

    def _guarded_generator(self, behavior: Callable, method: str, streaming_requests: bool) -> Callable:
        """A response stream that yields its messages (``WatchMembership``)."""

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            stream = await self._admit(context, method)
            task = asyncio.current_task()
            if task is not None:  # (always: gRPC runs each call in a task)
                stream.end = task.cancel
            try:
                requests = _marking(request, stream) if streaming_requests else request
                async for response in behavior(requests, context):
                    if stream.idle_since is not None:
                        stream.idle_since = time.monotonic()
                    yield response
            finally:
                self._admission.leave(stream)

        return guarded

    def _guarded_coroutine(self, behavior: Callable, method: str, streaming_requests: bool) -> Callable:
        """A call that writes its responses through the context (health ``Watch``) or returns one."""

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            stream = await self._admit(context, method)
            inner = asyncio.ensure_future(
                behavior(_marking(request, stream) if streaming_requests else request, _Touching(context, stream))
            )
            ended = False

            def end() -> None:
                nonlocal ended
                ended = True
                inner.cancel()

            stream.end = end
            try:
                return await inner
            except asyncio.CancelledError:
                if not ended:
                    raise
                return None  # ended for idleness: the stream closes with status OK
            finally:
                self._admission.leave(stream)

        return guarded

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.idle_s / 2))
            self._admission.end_idle()

    def open_streams(self) -> int:
        """Streaming calls open now."""
        return self._admission.count()

    async def end_watches(self, settle_s: float = 0.5) -> int:
        """End every health ``Watch`` (as :meth:`StreamGuard.end_watches`), each once it has written
        the status the daemon set as it began to stop (an asyncio servicer writes it on its own
        turn of the loop), or after ``settle_s``. Returns how many were ended."""
        watches = self._admission.open_watches()
        marks = [stream.sent for stream in watches]
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and any(s.sent == m for s, m in zip(watches, marks, strict=True)):
            await asyncio.sleep(0.01)
        for stream in watches:
            stream.end()
        return len(watches)

    async def close(self) -> None:
        """Stop the watchdog."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog


async def _marking(requests: AsyncIterator[Any], stream: _Stream) -> AsyncIterator[Any]:
    """``requests``, with ``stream`` marked idle while it waits for the next one."""
    iterator = requests.__aiter__()
    while True:
        stream.idle_since = time.monotonic()
        try:
            message = await iterator.__anext__()
        except StopAsyncIteration:
            return
        finally:
            stream.idle_since = None
        yield message


class _Touching:
    """An asyncio servicer context whose ``write`` tells a watch it had something to send."""

    def __init__(self, context: grpc.aio.ServicerContext, stream: _Stream) -> None:
        self._context = context
        self._stream = stream

    async def write(self, message: Any) -> None:
        if self._stream.idle_since is not None:
            self._stream.idle_since = time.monotonic()
        await self._context.write(message)
        self._stream.sent += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def peer_address(peer: str) -> str:
    """A gRPC peer without its port (``ipv4:10.0.0.1:5000`` -> ``ipv4:10.0.0.1``)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rsplit(':', 1)[0]}"
    return peer
