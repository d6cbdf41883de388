"""The causes a rank's data wait is attributed to (docs/analyze.md, Attribution while a job runs):
one vocabulary for the client that splits the wait, the manager that sums it and the tools that show it."""

from __future__ import annotations

__all__ = ["CAUSES", "CLIENT_CAUSES", "SERVER_CAUSES"]

#: The client's own causes (reported with server ``""``): waiting for the ring or the pacing window
#: to let the batch's grants go, a recovery from a lost server (which names it), the client's
#: preprocessing workers, and the rest of ``next()`` (delivery, copies, collation).
CLIENT_CAUSES = ("pacing", "failover", "client_prep", "client")
#: A server's causes: its production, split into reading samples (``fetch``) and preprocessing
#: (``prep``, per stage) where it reports the figures; the link (its feeder's queue and the
#: transfer); ``server`` where the client cannot tell which.
SERVER_CAUSES = ("production", "fetch", "prep", "link", "server")
CAUSES = CLIENT_CAUSES + SERVER_CAUSES
