"""A small file system to fill up (needs root): a tmpfs mounted for one test, and a file that takes
every byte left on it.

::

    with small_disk(tmp_path / "disk", 64 << 10) as disk:
        filler = fill(disk)        # the disk is full now
        ...
        filler.unlink()            # room again

A test that cannot mount one (not root, no tmpfs) is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(where: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted on ``where`` (created), unmounted on the way out."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode:
        reason = mounted.stderr.strip() or f"exit status {mounted.returncode}"
        pytest.skip(f"cannot mount a tmpfs on {where} ({reason}): full-disk tests need root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def fill(directory: Path) -> Path:
    """Write a file into ``directory`` until its file system has no byte left; returns the file
    (unlink it to give the space back)."""
    path = directory / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for block in (bytes(1 << 20), bytes(4096), bytes(1)):
            while True:
                try:
                    os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return path
