"""A server's lifecycle state as the rest of the cluster reads it: its name, and whether it serves data.

The states and their transitions are drawn in :mod:`kspeed.manager.membership`, which owns them;
clients, the CLI and the manager's own catalog ask only the two questions below.
"""

from __future__ import annotations

from kspeed.proto import kspeed_pb2

__all__ = ["GONE", "SERVING", "state_name"]

_S = kspeed_pb2.ServerState
#: Servers that answer lookups and feeds: ready ones, and draining ones until their shares are held elsewhere.
SERVING = (_S.SERVER_STATE_READY, _S.SERVER_STATE_DRAINING)
#: Servers whose data-plane paths are lost: failed, stopped (a restart may bring them back) or left.
GONE = (_S.SERVER_STATE_FAILED, _S.SERVER_STATE_LEFT, _S.SERVER_STATE_STOPPED)


def state_name(state: kspeed_pb2.ServerState | int) -> str:
    """``"ready"`` for ``SERVER_STATE_READY`` and so on."""
    return _S.Name(state).removeprefix("SERVER_STATE_").lower()
