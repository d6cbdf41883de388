"""Admission of connections to a listener: caps per peer and in total, and one deadline for each.

A listener that spends a thread on each connection before it knows what the caller wants (a
handshake, an HTTP request being read) is exhausted by connections that never finish: one byte
every second renews any per-read timeout forever. A :class:`Gate` holds each such connection to a
deadline counted from its accept, whatever it sends, and caps how many one peer and all peers
hold at once. At a cap the newcomer is let in and the oldest connection of the busiest peer is
shut down instead (of the newcomer's own peer, when that peer is at its cap): a legitimate
handshake or request takes a round trip or two, so it is never the oldest for long, and slow
connections, however many, cannot lock it out; they only cost their sender its own connections.

The gate shuts a connection down (``shutdown(SHUT_RDWR)``, which wakes a thread blocked on it);
the thread that owns it closes it, after :meth:`Gate.leave`, so a descriptor is never shut down
once it may have been reused. A shut connection holds its thread and descriptor until its owner
gets the CPU to leave; on a busy host a flood of newcomers outran them (a manager capped at 32 HTTP
connections held 44 threads for them). So the gate also counts the connections shut but not yet
left, and :meth:`Gate.enter` lets at most :data:`WIND_DOWN` of them linger: past that it waits for
owners to leave, up to ``room_wait`` seconds, and refuses the newcomer if none does.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["Gate", "Ticket", "worth_telling"]

log = logging.getLogger(__name__)

#: Connections shut by a gate whose owners may still hold a thread and a descriptor for them.
WIND_DOWN = 4
#: How long :meth:`Gate.enter` waits for shut connections to be left before it refuses a newcomer.
ROOM_WAIT_S = 1.0


@dataclass(eq=False)
class Ticket:
    """One connection inside a gate.

    Attributes:
        peer: who called (an address, a process), as the gate's user names it.
        fd: the connection's descriptor (shut down, never closed, by the gate).
        deadline: monotonic time by which it must have left the gate.
        ended: why the gate shut it down ("expired", "displaced"), or "" while it has not.
        left: whether its owner has called :meth:`Gate.leave`.
    """

    peer: str
    fd: int
    deadline: float
    ended: str = field(default="")
    left: bool = field(default=False)


def worth_telling(count: int) -> bool:
    """Whether the ``count``-th of a repeated event an attacker can provoke (a refused or expired
    connection) is worth a log line: the 1st, 10th, 100th and every 1000th, so no peer floods a log."""
    return count in (1, 10, 100) or count % 1000 == 0


class Gate:
    """Connections of one listener in the phase that a slow caller could stretch (see the module docstring).

    Args:
        what: what the connections are doing, for logs ("tcp handshake", "HTTP request").
        total: connections inside at most.
        per_peer: connections of one peer inside at most.
        deadline: seconds a connection may stay inside, from :meth:`enter`.
        room_wait: seconds :meth:`enter` waits for shut connections to be left (see the module docstring).
    """

    def __init__(
        self,
        what: str,
        *,
        total: int,
        per_peer: int,
        deadline: float,
        room_wait: float = ROOM_WAIT_S,
    ) -> None:
        if total < 1 or per_peer < 1 or deadline <= 0 or room_wait < 0:
            raise ValueError(f"{what}: caps must be positive, the deadline too, and room_wait not negative")
        self.what, self.total, self.per_peer, self.deadline = what, total, per_peer, deadline
        self.room_wait = room_wait
        self._cond = threading.Condition()
        self._inside: list[Ticket] = []  # oldest first
        self._winding = 0  # tickets shut by the gate and not left yet
        self._closed = False
        self._reaper: threading.Thread | None = None
        #: connections shut down to make room for newer ones, and for their deadline
        self.displaced = 0
        self.expired = 0
        #: newcomers refused because shut connections were not left within ``room_wait``
        self.refused = 0

    def enter(self, sock: socket.socket, peer: str) -> Ticket | None:
        """Let ``sock`` in (it was just accepted from ``peer``), making room at a cap.

        The caller must call :meth:`leave` with the ticket before it closes ``sock``, and treat
        the connection as lost when ``sock`` fails: it may have been shut down to make room.

        Returns:
            The ticket; or None when more than :data:`WIND_DOWN` shut connections were still not
            left after ``room_wait`` seconds: the caller closes ``sock`` at once.
        """
        ticket = Ticket(peer, sock.fileno(), time.monotonic() + self.deadline)
        with self._cond:
            mine = [t for t in self._inside if t.peer == peer]
            if len(mine) >= self.per_peer:
                self._end(mine[0], "displaced")
            elif len(self._inside) >= self.total:
                busiest, _ = Counter(t.peer for t in self._inside).most_common(1)[0]
                self._end(next(t for t in self._inside if t.peer == busiest), "displaced")
            self._cond.wait_for(lambda: self._closed or self._winding <= WIND_DOWN, self.room_wait)
            if self._winding > WIND_DOWN:
                self.refused += 1
                if worth_telling(self.refused):
                    log.warning(
                        "%s from %s refused: %d connections shut and not yet left after %g s (%d refused so far)",
                        self.what,
                        peer,
                        self._winding,
                        self.room_wait,
                        self.refused,
                    )
                return None
            self._inside.append(ticket)
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name=f"kspeed-gate-{self.what}", daemon=True)
                self._reaper.start()
            self._cond.notify_all()
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """The connection is past the gated phase (or about to be closed): the gate forgets it."""
        with self._cond:
            if ticket.left:
                return
            ticket.left = True
            if ticket.ended:
                self._winding -= 1
                self._cond.notify_all()
            else:
                self._inside.remove(ticket)

    def held(self, peer: str | None = None) -> int:
        """Connections inside now (of ``peer``, or all)."""
        with self._cond:
            return sum(1 for t in self._inside if peer is None or t.peer == peer)

    def close(self) -> None:
        """Stop the gate's deadline thread (connections inside are left to their owners)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._reaper is not None:
            self._reaper.join(timeout=5)

    def _end(self, ticket: Ticket, why: str) -> None:
        """Shut ``ticket``'s connection down and forget it (under the lock)."""
        self._inside.remove(ticket)
        ticket.ended = why
        self._winding += 1
        if why == "displaced":
            self.displaced += 1
        else:
            self.expired += 1
        ended = self.displaced + self.expired
        if worth_telling(ended):
            log.warning(
                "%s from %s %s (so far %d displaced by newer ones, %d past %g s; at most %d at once, %d per peer)",
                self.what,
                ticket.peer,
                "shut to make room for a newer one" if why == "displaced" else f"not done within {self.deadline:g} s",
                self.displaced,
                self.expired,
                self.deadline,
                self.total,
                self.per_peer,
            )
        try:  # through a duplicate: shutdown acts on the connection, and the owner keeps its descriptor
            with socket.socket(fileno=os.dup(ticket.fd)) as dup:
                dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone: its owner finds out by itself

    def _reap(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                while self._inside and self._inside[0].deadline <= now:
                    self._end(self._inside[0], "expired")
                wait = self._inside[0].deadline - now if self._inside else None
                self._cond.wait(wait)
