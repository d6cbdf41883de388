"""Sample sets of the client benchmark: class folders of random files, one set per sample size.

Every system of the benchmark reads the same files. Sample IDs follow KSpeed's rule (``0..N-1``
over the sorted keys) and labels are the class-folder index, so a peer can map an ID to its file,
size and label without asking anyone. The first byte of every file is recorded: the training loop
of the benchmark reads that byte of each sample, and the sum over an epoch checks that every
system delivered every sample once with the right bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from _common import KIB, MIB

__all__ = [
    "SampleSet",
    "SizeSpec",
    "batch_size_for",
    "make_sample_set",
    "parse_sizes",
    "sample_count",
    "warm_page_cache",
]

CLASSES = 8  # class folders c0..c7; a file's label is its folder's index
BLOB_BYTES = 32 * MIB  # files are slices of one random blob, so writing them costs no RNG time
MAX_BATCH_BYTES = 64 * MIB  # batches of large samples are capped near this (same for every system)
SMALL_BATCH = 64
MIN_BATCHES = 4  # batches per epoch at least, so a set of 16 MiB samples still pipelines
VARIABLE = (24 * KIB, 40 * KIB)  # the variable-size set: uniform in [24 KiB, 40 KiB]


@dataclass(frozen=True)
class SizeSpec:
    """One sample size of the benchmark: fixed ``lo == hi`` or uniform in ``[lo, hi]`` bytes."""

    label: str | int  # the ``size`` field of a result: bytes, or e.g. "24-40K"
    lo: int
    hi: int

    @property
    def mean(self) -> float:
        """Mean sample size in bytes."""
        return (self.lo + self.hi) / 2


@dataclass
class SampleSet:
    """Files of one size on disk, in ID order, with what every peer needs to read them."""

    name: str
    root: str
    paths: list[str]  # absolute, index = sample ID
    sizes: np.ndarray  # int64 bytes per ID
    labels: np.ndarray  # int64 class index per ID
    first_bytes: np.ndarray  # uint8 first byte per ID (the loop's touch reads it)
    spec: SizeSpec

    @property
    def count(self) -> int:
        """Number of samples."""
        return len(self.paths)

    @property
    def total_bytes(self) -> int:
        """Bytes of one epoch."""
        return int(self.sizes.sum())

    @property
    def checksum(self) -> int:
        """Sum of the first bytes of every sample: what one epoch's touches add up to."""
        return int(self.first_bytes.astype(np.int64).sum())


def parse_sizes(text: str) -> list[SizeSpec]:
    """``"32K,24-40K,1M"`` -> size specs; a ``lo-hi`` item is the variable-size set."""

    def one(token: str) -> int:
        token = token.strip().upper().removesuffix("B").removesuffix("I")
        for suffix, mult in (("K", KIB), ("M", MIB)):
            if token.endswith(suffix):
                return int(float(token[:-1]) * mult)
        return int(token)

    specs = []
    for item in text.split(","):
        item = item.strip()
        if "-" in item:
            lo_text, hi_text = (t.strip().upper() for t in item.split("-", 1))
            if lo_text[-1:].isdigit():  # "24-40K": the low end takes the high end's unit
                lo_text += hi_text.lstrip("0123456789.")
            lo, hi = one(lo_text), one(hi_text)
            if not 0 < lo <= hi:
                raise ValueError(f"size range {item!r}: need 0 < lo <= hi")
            label = f"{lo // KIB}-{hi // KIB}K" if lo % KIB == 0 == hi % KIB else f"{lo}-{hi}"
            specs.append(SizeSpec(label, lo, hi))
        else:
            size = one(item)
            if size <= 0:
                raise ValueError(f"size {item!r}: must be positive")
            specs.append(SizeSpec(size, size, size))
    return specs


def batch_size_for(spec: SizeSpec) -> int:
    """64 for small samples; fewer for large ones so a batch stays near 64 MiB (at least 2)."""
    return max(2, min(SMALL_BATCH, MAX_BATCH_BYTES // spec.hi))


def sample_count(spec: SizeSpec, target_bytes: int, min_batches: int = MIN_BATCHES) -> int:
    """Samples of a set: about ``target_bytes`` of them, and at least ``min_batches`` batches."""
    return max(round(target_bytes / spec.mean), min_batches * batch_size_for(spec))


def make_sample_set(
    root: str, name: str, spec: SizeSpec, target_bytes: int, min_batches: int = MIN_BATCHES, seed: int = 0
) -> SampleSet:
    """Write :func:`sample_count` files of ``spec``'s size under ``root/name``.

    File ``i`` goes to class folder ``c{i % 8}``; IDs are then assigned over the sorted relative
    paths, as a KSpeed server lists a directory tree.
    """
    rng = np.random.default_rng(seed)
    count = sample_count(spec, target_bytes, min_batches)
    sizes = rng.integers(spec.lo, spec.hi + 1, count) if spec.lo != spec.hi else np.full(count, spec.lo)
    blob = rng.integers(0, 256, max(BLOB_BYTES, spec.hi + 1), dtype=np.uint8)
    starts = rng.integers(0, len(blob) - spec.hi, count)
    firsts = rng.integers(0, 256, count, dtype=np.uint8)
    base = os.path.join(root, name)
    entries = []
    for cls in range(CLASSES):
        os.makedirs(os.path.join(base, f"c{cls}"), exist_ok=True)
    view = memoryview(blob)
    for i in range(count):
        rel = f"c{i % CLASSES}/{i:07d}.bin"
        n, s = int(sizes[i]), int(starts[i])
        with open(os.path.join(base, rel), "wb", buffering=0) as fh:
            fh.write(bytes((int(firsts[i]),)))
            fh.write(view[s + 1 : s + n])
        entries.append((rel, n, i % CLASSES, firsts[i]))
    entries.sort()
    return SampleSet(
        name=name,
        root=base,
        paths=[os.path.join(base, e[0]) for e in entries],
        sizes=np.array([e[1] for e in entries], dtype=np.int64),
        labels=np.array([e[2] for e in entries], dtype=np.int64),
        first_bytes=np.array([e[3] for e in entries], dtype=np.uint8),
        spec=spec,
    )


def warm_page_cache(samples: SampleSet) -> None:
    """Read every file once so the file readers start from a warm page cache."""
    buf = bytearray(int(samples.sizes.max()))
    for path in samples.paths:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf) == len(buf):
                pass
