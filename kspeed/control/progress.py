"""Follow a dataset's preload with a ``tqdm`` progress bar (CLI and client library)."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import TextIO

from tqdm import tqdm

from kspeed.control.manager_client import ManagerClient
from kspeed.control.status import dataset_state_name, human_bytes
from kspeed.errors import DatasetError
from kspeed.proto import kspeed_pb2

__all__ = ["PreloadSummary", "follow_preload"]

POLL = 0.25  # how often the manager is asked, once the preload has run for a while
FIRST_POLL = 0.02  # the first wait (doubled up to POLL): a small dataset loads in milliseconds


@dataclasses.dataclass(frozen=True)
class PreloadSummary:
    """A finished preload: what is in the servers' memory now."""

    dataset: str
    state: str  # ready, degraded, changed...
    samples: int
    bytes: int
    servers: int
    seconds: float  # how long this call waited (0 when it was already loaded)

    @classmethod
    def of(cls, info: kspeed_pb2.DatasetInfo, seconds: float) -> PreloadSummary:
        return cls(
            dataset=info.spec.name,
            state=dataset_state_name(info.state),
            samples=info.progress.samples_loaded,
            bytes=info.progress.bytes_loaded,
            servers=len(info.shares),
            seconds=seconds,
        )

    def __str__(self) -> str:
        return (
            f"{self.dataset}: {self.state}, {self.samples:,} samples ({human_bytes(self.bytes)}) "
            f"on {self.servers} server(s)"
        )


def follow_preload(
    client: ManagerClient, name: str, *, out: TextIO | None = sys.stderr, timeout: float | None = None
) -> kspeed_pb2.DatasetInfo:
    """Start (or join) the preload of ``name`` and wait until every share is loaded (a share
    served on demand after a failover loads nothing: it is named on ``out``).

    Args:
        client: a manager client.
        name: the dataset.
        out: where ``tqdm`` draws the bar (samples, bytes, rate, ETA); None for quiet.
        timeout: give up after this many seconds.

    Raises:
        DatasetError: samples failed to load (the first errors are named), or the timeout passed.
    """
    info = client.preload(name)
    started = time.monotonic()
    bar = tqdm(
        total=info.progress.samples_total,
        desc=name,
        unit=" samples",
        file=out,
        disable=out is None,
        mininterval=POLL,
        dynamic_ncols=True,
        bar_format="{desc} {percentage:3.0f}%|{bar}| {n}/{total} samples{postfix} [{elapsed}<{remaining}]",
    )
    wait = FIRST_POLL
    with bar:
        while True:
            _draw(bar, info, started)
            p = info.progress
            on_demand = [s for s in info.shares if s.on_demand]  # loads nothing (the dataset is degraded)
            streamed = all(s.policy for s in info.shares)  # held in part: loads as jobs consume
            if not p.running and (p.samples_loaded == p.samples_total or p.error_count or on_demand or streamed):
                for s in on_demand if out is not None else ():
                    bar.write(
                        f"dataset {name}: samples {s.first_id}..{s.end_id - 1} are served on demand by "
                        f"{s.server_id} (no server has the memory to hold them; they are read as jobs need them)",
                        file=out,
                    )
                break
            if timeout is not None and time.monotonic() - started > timeout:
                raise DatasetError(f"dataset {name!r}: preload not finished after {timeout:.0f}s", dataset=name)
            time.sleep(wait)
            wait = min(wait * 2, POLL)
            info = client.dataset(name)
    if info.progress.error_count:
        raise DatasetError(
            f"dataset {name!r}: {info.progress.error_count} sample(s) failed to load: "
            + "; ".join(info.progress.errors),
            dataset=name,
        )
    return info


def _draw(bar: tqdm, info: kspeed_pb2.DatasetInfo, started: float) -> None:
    """Move the bar to the dataset's progress; bytes and the byte rate go in its postfix (which
    tqdm writes after ", ")."""
    p = info.progress
    bar.total = p.samples_total
    bar.update(p.samples_loaded - bar.n)
    elapsed = time.monotonic() - started
    rate = p.bytes_per_s or (p.bytes_loaded / elapsed if elapsed > 0 else 0.0)
    bar.set_postfix_str(f"{human_bytes(p.bytes_loaded)}/{human_bytes(p.bytes_total)}, {human_bytes(rate)}/s")
