"""Keeping a thread-pool gRPC server responsive while streams stay open.

A synchronous gRPC server runs every call on one of its pool's threads, and a streaming call holds
its thread until the stream ends: twenty idle streams (of ``Lookup``, a stream then) on a pool of
sixteen starved the health checks until the manager called the server suspect. :class:`StreamGuard` is an interceptor
that keeps unary calls (health, ``GetInfo``) a share of the pool of their own:

- at most ``limit`` streaming calls at once, and at most ``per_peer`` of them from one address;
  one more is answered ``RESOURCE_EXHAUSTED`` at once (the caller retries), never queued;
- a stream that waits longer than ``idle_s`` for its caller's next message is cancelled, so idle
  or abandoned streams give their threads back.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kspeed.control.rpc import ERROR_HEADER
from kspeed.errors import BusyError

__all__ = ["StreamGuard"]

log = logging.getLogger(__name__)


class _Stream:
    """One open streaming call: who made it and whether (since when) it waits for a message."""

    def __init__(self, context: grpc.ServicerContext, peer: str) -> None:
        self.context = context
        self.peer = peer
        self.waiting_since: float | None = None


class StreamGuard(grpc.ServerInterceptor):
    """Bounds a sync server's streaming calls (see the module docstring).

    Args:
        limit: streaming calls at once (the pool's threads less those kept for unary calls).
        per_peer: streaming calls at once from one caller address.
        idle_s: longest wait for a caller's next message before its stream is cancelled.
    """

    def __init__(self, limit: int, per_peer: int, idle_s: float) -> None:
        self.limit, self.per_peer, self.idle_s = max(limit, 1), max(per_peer, 1), idle_s
        self.refused = 0
        self.cancelled = 0
        self._lock = threading.Lock()
        self._open: list[_Stream] = []
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="kspeed-stream-watch", daemon=True)
        self._watchdog.start()

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        method = handler_call_details.method
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                self._guarded(handler.stream_stream, method, streaming_requests=True),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                self._guarded(handler.stream_unary, method, streaming_requests=True),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return grpc.unary_stream_rpc_method_handler(
            self._guarded(handler.unary_stream, method, streaming_requests=False),
            handler.request_deserializer,
            handler.response_serializer,
        )

    def _guarded(self, behavior: Callable, method: str, *, streaming_requests: bool) -> Callable:
        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            stream = self._admit(context, method)
            try:
                result = behavior(self._watched(request, stream) if streaming_requests else request, context)
                if isinstance(result, Iterator):  # a response stream: the slot is held while it runs
                    return self._held(result, stream)
                self._leave(stream)
                return result
            except BaseException:
                self._leave(stream)
                raise

        return guarded

    def _admit(self, context: grpc.ServicerContext, method: str) -> _Stream:
        peer = _address(context.peer())
        with self._lock:
            mine = sum(1 for s in self._open if s.peer == peer)
            if len(self._open) < self.limit and mine < self.per_peer:
                stream = _Stream(context, peer)
                self._open.append(stream)
                return stream
            self.refused += 1
            busy = len(self._open)
        log.warning("refused stream %s from %s: %d open (%d of them from it)", method, peer, busy, mine)
        context.set_trailing_metadata(((ERROR_HEADER, BusyError.__name__),))
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"this server has {busy} streams open ({mine} from {peer}), at most {self.limit} "
            f"({self.per_peer} per caller); retry shortly",
        )
        raise AssertionError("unreachable: abort raises")

    def _watched(self, requests: Iterator[Any], stream: _Stream) -> Iterator[Any]:
        while True:
            stream.waiting_since = time.monotonic()
            try:
                message = next(requests)
            except StopIteration:
                return
            finally:
                stream.waiting_since = None
            yield message

    def _held(self, responses: Iterator[Any], stream: _Stream) -> Iterator[Any]:
        try:
            yield from responses
        finally:
            self._leave(stream)

    def _leave(self, stream: _Stream) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._open.remove(stream)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.idle_s / 2)):
            now = time.monotonic()
            with self._lock:
                idle = [s for s in self._open if s.waiting_since is not None and now - s.waiting_since > self.idle_s]
            for stream in idle:
                self.cancelled += 1
                log.warning("cancelled a stream from %s: no message for %.0f s", stream.peer, self.idle_s)
                stream.context.cancel()

    def open_streams(self) -> int:
        """Streaming calls open now."""
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        """Stop the watchdog."""
        self._stop.set()
        self._watchdog.join(timeout=5)


def _address(peer: str) -> str:
    """A gRPC peer without its port (``ipv4:10.0.0.1:5000`` -> ``ipv4:10.0.0.1``)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rsplit(':', 1)[0]}"
    return peer
