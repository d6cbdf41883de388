"""Where the ranks of jobs stand in their epochs, kept for a live resume (docs/resume.md).

A rank opened with ``resume="live"`` sends its position (its dataset's ``state_dict()`` as JSON)
with every batch it is handed; a restarted job asks for them and continues each epoch from there,
with no checkpoint file. The newest per (dataset, job, world size, rank) is kept; the store holds
at most :data:`MAX_BYTES` of them, the least recently updated going first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kspeed.errors import ProtocolError
from kspeed.proto import kspeed_pb2

__all__ = ["MAX_BYTES", "MAX_STATE", "Positions"]

MAX_STATE = 4096  # bytes of one position's state (a dataset's state is a few hundred)
MAX_BYTES = 16 << 20  # bytes of states kept in all
MAX_NAME = 256  # characters of a dataset's or job's name
MAX_WORLD = 1 << 20

Key = tuple[str, str, int, int]


class Positions:
    """The newest position of each rank of each job on each dataset, within :data:`MAX_BYTES`."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self._max_bytes = max_bytes
        self._kept: OrderedDict[Key, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def keep(self, position: kspeed_pb2.Position) -> None:
        """Keep ``position`` in place of the rank's last one.

        Raises:
            ProtocolError: a name empty or too long, a rank outside the world, or a state too large (named).
        """
        for what, name in (("dataset", position.dataset), ("job", position.job)):
            if not 0 < len(name) <= MAX_NAME:
                raise ProtocolError(f"KeepPosition: the {what} name must be 1..{MAX_NAME} characters, got {len(name)}")
        if not 0 < position.world_size <= MAX_WORLD or position.rank >= position.world_size:
            raise ProtocolError(
                f"KeepPosition: rank {position.rank} of world size {position.world_size} "
                f"(a world of 1..{MAX_WORLD} ranks, a rank below it)"
            )
        if len(position.state) > MAX_STATE:
            raise ProtocolError(f"KeepPosition: a state of {len(position.state)} bytes, over {MAX_STATE}")
        key = (position.dataset, position.job, position.world_size, position.rank)
        state = bytes(position.state)
        with self._lock:
            old = self._kept.pop(key, None)
            self._bytes += len(state) - (len(old) if old is not None else 0)
            self._kept[key] = state
            while self._bytes > self._max_bytes and self._kept:
                _, gone = self._kept.popitem(last=False)
                self._bytes -= len(gone)

    def of(self, dataset: str, job: str) -> list[kspeed_pb2.Position]:
        """Every position kept of ``job``'s ranks on ``dataset``."""
        with self._lock:
            found = [(k, v) for k, v in self._kept.items() if k[0] == dataset and k[1] == job]
        return [
            kspeed_pb2.Position(dataset=d, job=j, world_size=w, rank=r, state=state) for (d, j, w, r), state in found
        ]

    @property
    def nbytes(self) -> int:
        """Bytes of states kept."""
        return self._bytes
