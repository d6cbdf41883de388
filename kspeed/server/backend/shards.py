"""WebDataset-style tar shards: the member index a ``tar`` dataset is listed into.

A shard is an uncompressed POSIX tar file whose members are grouped into samples by **key**: a
member's path up to the first dot of its file name (``train/000017.jpg`` and ``train/000017.cls``
are the sample ``train/000017``), the members of one sample adjacent, as WebDataset writes them.
Of each sample:

- the **bytes** the training loop receives are its first member that is not a label, in tar order
  (``000017.jpg``);
- its **label** (``labels="cls"``) is the decimal integer in its ``.cls`` member; classes are then
  ``"0"`` .. ``"max"``.

Shards are named by a path, a brace pattern (``train-{000000..000099}.tar``, zero-padded ranges
and ``{a,b}`` alternatives, expanded in order) or a directory (its ``*.tar`` files, sorted).
Sample IDs follow the shards' order, then tar order within a shard: the order is stable as long as
the shards are. Listing reads every member header once (through the file system's buffered reads)
and each ``.cls`` member; a sample is then one ranged read of its member's bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import posixpath
import re
import tarfile

import fsspec
import numpy as np

from kspeed.errors import DatasetError

__all__ = ["LABEL_EXT", "ShardIndex", "expand_braces", "index_shards", "sample_key"]

LABEL_EXT = "cls"
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(\d+)\.\.(\d+)$")
MAX_EXPANDED = 1_000_000  # shard names a pattern may expand to


def expand_braces(pattern: str) -> list[str]:
    """The names a brace pattern stands for, in order (``{0..9}``-style zero-padded ranges, ``{a,b}``).

    Raises:
        ValueError: a range that runs backwards, or more than :data:`MAX_EXPANDED` names.
    """
    parts: list[list[str]] = []
    at = 0
    for match in _BRACE.finditer(pattern):
        parts.append([pattern[at : match.start()]])
        body = match.group(1)
        numbers = _RANGE.match(body)
        if numbers:
            lo, hi = numbers.groups()
            if int(hi) < int(lo):
                raise ValueError(f"brace range {{{body}}} runs backwards")
            width = len(lo) if lo.startswith("0") else 0
            parts.append([str(k).zfill(width) for k in range(int(lo), int(hi) + 1)])
        else:
            parts.append(body.split(","))
        at = match.end()
    parts.append([pattern[at:]])
    count = int(np.prod([len(p) for p in parts], dtype=np.float64))
    if count > MAX_EXPANDED:
        raise ValueError(f"brace pattern {pattern!r} names {count} shards (at most {MAX_EXPANDED})")
    return ["".join(combo) for combo in itertools.product(*parts)]


def sample_key(member: str) -> tuple[str, str]:
    """``(key, extension)`` of a member path: the key ends at the first dot of the file name."""
    folder, _, name = member.rpartition("/")
    stem, dot, ext = name.partition(".")
    return (f"{folder}/{stem}" if folder else stem), (ext if dot else "")


@dataclasses.dataclass(frozen=True)
class ShardIndex:
    """Where each sample's bytes are: its shard, the byte offset of its member's data, its size."""

    shards: tuple[str, ...]
    shard_of: np.ndarray  # int32 per sample
    offsets: np.ndarray  # int64 per sample
    sizes: np.ndarray  # int64 per sample
    keys: list[str]  # "<shard file name>/<sample key>.<ext>" per sample
    labels: np.ndarray | None  # int64 per sample, from the .cls members (None when any lacks one)


def index_shards(fs: fsspec.AbstractFileSystem, dataset: str, shards: list[str]) -> ShardIndex:
    """Read the member headers of ``shards`` (and each ``.cls`` member) into a :class:`ShardIndex`.

    Raises:
        DatasetError: a shard is not an uncompressed tar, or a sample has no member besides its label.
    """
    shard_of: list[int] = []
    offsets: list[int] = []
    sizes: list[int] = []
    keys: list[str] = []
    labels: list[int | None] = []
    for s, shard in enumerate(shards):
        name = posixpath.basename(shard)
        with fs.open(shard, "rb") as f, _open_tar(f, dataset, shard) as archive:
            members = [m for m in archive if m.isfile()]  # one shard's headers at a time
            for key, group in itertools.groupby(members, key=lambda m: sample_key(m.name)[0]):
                data: tarfile.TarInfo | None = None
                label: int | None = None
                for member in group:
                    ext = sample_key(member.name)[1]
                    if ext == LABEL_EXT:
                        label = _label(archive, member, dataset, shard)
                    elif data is None:
                        data = member
                if data is None:
                    raise DatasetError(
                        f"dataset {dataset!r}: sample {key!r} of shard {shard} has no member besides its "
                        f".{LABEL_EXT} label",
                        dataset=dataset,
                    )
                shard_of.append(s)
                offsets.append(data.offset_data)
                sizes.append(data.size)
                keys.append(f"{name}/{data.name}")
                labels.append(label)
    known = [v for v in labels if v is not None]
    return ShardIndex(
        tuple(shards),
        np.asarray(shard_of, dtype=np.int32),
        np.asarray(offsets, dtype=np.int64),
        np.asarray(sizes, dtype=np.int64),
        keys,
        np.asarray(known, dtype=np.int64) if labels and len(known) == len(labels) else None,
    )


def _open_tar(f: object, dataset: str, shard: str) -> tarfile.TarFile:
    try:
        return tarfile.open(fileobj=f, mode="r:")  # type: ignore[call-overload]  # (uncompressed only: ranged reads)
    except tarfile.TarError as exc:
        raise DatasetError(
            f"dataset {dataset!r}: shard {shard} is not an uncompressed tar file: {exc}", dataset=dataset
        ) from exc


def _label(archive: tarfile.TarFile, member: tarfile.TarInfo, dataset: str, shard: str) -> int:
    raw = archive.extractfile(member)
    text = raw.read(64).decode("ascii", "replace").strip() if raw is not None else ""
    try:
        return int(text)
    except ValueError:
        raise DatasetError(
            f"dataset {dataset!r}: {shard} member {member.name}: label {text!r} is not an integer", dataset=dataset
        ) from None
