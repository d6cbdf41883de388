"""Follow a dataset's preload and draw it as a progress bar (CLI and client library)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from kspeed.control.manager_client import ManagerClient
from kspeed.control.status import human_bytes
from kspeed.errors import DatasetError
from kspeed.proto import kspeed_pb2

BAR = 30
POLL = 0.25


def progress_line(info: kspeed_pb2.DatasetInfo, rate: float) -> str:
    """One line: bar, percent, samples, bytes, rate and ETA."""
    p = info.progress
    total = p.samples_total or 1
    done = p.samples_loaded / total
    filled = int(BAR * done)
    left = p.bytes_total - p.bytes_loaded
    eta = f"ETA {left / rate:5.1f}s" if rate > 0 and left > 0 else "ETA     -"
    return (
        f"{info.spec.name} [{'#' * filled}{'.' * (BAR - filled)}] {100 * done:5.1f}%  "
        f"{p.samples_loaded}/{p.samples_total} samples  {human_bytes(p.bytes_loaded)}/{human_bytes(p.bytes_total)}"
        f"  {human_bytes(rate)}/s  {eta}"
    )


def follow_preload(
    client: ManagerClient, name: str, *, out: TextIO | None = sys.stderr, timeout: float | None = None
) -> kspeed_pb2.DatasetInfo:
    """Start (or join) the preload of ``name`` and wait until every share is loaded.

    Args:
        client: a manager client.
        name: the dataset.
        out: where to draw the bar (a TTY gets one updating line); None for quiet.
        timeout: give up after this many seconds.

    Raises:
        DatasetError: samples failed to load (the first errors are named).
    """
    info = client.preload(name)
    started = time.monotonic()
    last_bytes, last_time, rate = info.progress.bytes_loaded, started, 0.0
    tty = out is not None and out.isatty()
    while True:
        p = info.progress
        if not p.running and (p.samples_loaded == p.samples_total or p.error_count):
            break
        if timeout is not None and time.monotonic() - started > timeout:
            raise DatasetError(f"dataset {name!r}: preload not finished after {timeout:.0f}s", dataset=name)
        time.sleep(POLL)
        info = client.dataset(name)
        now = time.monotonic()
        if now > last_time:
            rate = 0.7 * rate + 0.3 * max(info.progress.bytes_loaded - last_bytes, 0) / (now - last_time)
        last_bytes, last_time = info.progress.bytes_loaded, now
        if out is not None and tty:
            out.write("\r" + progress_line(info, rate))
            out.flush()
    if out is not None:
        out.write(("\r" if tty else "") + progress_line(info, rate) + "\n")
        out.flush()
    if info.progress.error_count:
        raise DatasetError(
            f"dataset {name!r}: {info.progress.error_count} sample(s) failed to load: "
            + "; ".join(info.progress.errors),
            dataset=name,
        )
    return info
