"""A deadline for the request of every unary call to a synchronous gRPC server.

A sync gRPC server takes one of its pool's threads for a call as soon as the call's headers
arrive, and the thread waits there for the request message. A caller that sends headers and never
the message holds the thread for as long as it likes; as many such calls as the pool has threads
starved every other call, health checks included, and needed no token (a token is refused only
once the request is read). :class:`ArrivalGuard` is an interceptor that takes each unary call's
request itself, as a stream of one message, so that the wait is seen and bounded:

- a request must arrive within ``deadline`` seconds, or the call is cancelled;
- when more than ``limit`` calls wait for their request at once, those that have waited longer than
  :data:`SLOW_S` are cancelled, the oldest of the address with the most first, until ``limit``
  remain. A legitimate caller's request follows its headers at once, so it is cut only when a
  message takes longer than :data:`SLOW_S` to arrive while the pool is under such pressure.

An asyncio server (the manager) waits for requests without a thread and needs none of this.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from kspeed.control.streams import peer_address

__all__ = ["SLOW_S", "ArrivalGuard"]

log = logging.getLogger(__name__)

#: Seconds a request may take to follow its call's headers before the call counts as slow.
SLOW_S = 0.05
_TICK_S = 0.05  # how often waiting calls are looked at
_NO_REQUEST = object()


@dataclass(eq=False)
class _Waiting:
    peer: str
    since: float
    cancel: Callable[[], Any]


class ArrivalGuard(grpc.ServerInterceptor):
    """Bounds how long and how many unary calls of a sync server wait for their request (see the module docstring).

    Args:
        deadline: seconds a call's request may take to arrive.
        limit: calls waiting for their request at once before slow ones are cancelled (a share of the pool's threads).
    """

    def __init__(self, deadline: float, limit: int) -> None:
        self.deadline, self.limit = deadline, max(limit, 1)
        self.cut = 0  # calls cancelled so far
        self._lock = threading.Lock()
        self._waiting: list[_Waiting] = []  # oldest first
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="kspeed-arrival-watch", daemon=True)
        self._watchdog.start()

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                self._taking(handler.unary_stream, handler_call_details.method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return grpc.stream_unary_rpc_method_handler(
            self._taking(handler.unary_unary, handler_call_details.method),
            handler.request_deserializer,
            handler.response_serializer,
        )

    def _taking(self, behavior: Callable, method: str) -> Callable:
        """``behavior`` of a unary request, called with the one message of a request stream."""

        def taking(requests: Iterator[Any], context: grpc.ServicerContext, *callback: Any) -> Any:
            waiting = _Waiting(peer_address(context.peer()), time.monotonic(), context.cancel)
            with self._lock:
                self._waiting.append(waiting)
                crowded = len(self._waiting) > self.limit
            if crowded:
                self._trim()
            try:
                request = next(requests, _NO_REQUEST)
            finally:
                self._leave(waiting)
            if request is _NO_REQUEST:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method} takes exactly one request message")
            return behavior(request, context, *callback)  # (a non-blocking stream's send_response_callback)

        # A health Watch answers through a callback, without a thread of its own once it has its request.
        for mark in ("experimental_non_blocking", "experimental_thread_pool"):
            if hasattr(behavior, mark):
                setattr(taking, mark, getattr(behavior, mark))
        return taking

    def _leave(self, waiting: _Waiting) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._waiting.remove(waiting)

    def _trim(self) -> None:
        """Cancel the calls past the deadline, and slow ones while more than ``limit`` wait."""
        now = time.monotonic()
        with self._lock:
            cut = [w for w in self._waiting if now - w.since > self.deadline]
            rest = [w for w in self._waiting if now - w.since <= self.deadline]
            while len(rest) > self.limit:
                slow = [w for w in rest if now - w.since > SLOW_S]
                if not slow:
                    break
                busiest, _ = Counter(w.peer for w in slow).most_common(1)[0]
                victim = next(w for w in slow if w.peer == busiest)
                rest.remove(victim)
                cut.append(victim)
            self._waiting = rest
            self.cut += len(cut)
            total = self.cut
        for waiting in cut:
            waiting.cancel()
        if cut and (total == len(cut) or total // 1000 != (total - len(cut)) // 1000):
            log.warning(
                "cancelled %d call(s) whose request did not come (from %s; %d so far): at most %g s to send one, "
                "and at most %d waiting at once",
                len(cut),
                ", ".join(sorted({w.peer for w in cut})),
                total,
                self.deadline,
                self.limit,
            )

    def _watch(self) -> None:
        while not self._stop.wait(_TICK_S):
            if self._waiting:
                self._trim()

    def close(self) -> None:
        """Stop the watchdog."""
        self._stop.set()
        self._watchdog.join(timeout=5)
