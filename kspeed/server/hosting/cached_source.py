"""A dataset cached preprocessed: its samples as its pipeline's deterministic leading stages leave them.

With ``cache="preprocessed"`` (:meth:`kspeed.preprocess.pipeline.Pipeline.cached_stages`) a server
keeps each sample after the first ``cached`` stages (e.g. decode, resize, center crop) instead of
the backend's bytes, so those stages run once, at preload, rather than every epoch. A
:class:`CachedSource` is the backend listing seen that way: every sample is the declared output of
stage ``cached - 1`` (its full size for a fixed shape; the header plus ``max_bytes`` for a
variable one, the unused tail zeroed so checksums are stable), and a read runs the backend's bytes
through those stages on the server's preprocessing workers. Everything that reads samples (the
preload, producers, repairs) reads them through it, so a sample is stored and served in one form.
The listing's checks of backend files (sizes, stamps) stay the raw source's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kspeed.errors import DatasetError, PreprocessError, StateError
from kspeed.preprocess.pipeline import Pipeline
from kspeed.server.backend.changes import Change
from kspeed.server.backend.sources import Source
from kspeed.server.memory.checksum import crc32c
from kspeed.server.prep.workers import PrepTask, PrepWorkers

__all__ = ["CachedSource"]

#: Samples one preprocessing task of a cached read runs (a read's samples are spread over the workers).
TASK_SAMPLES = 8


class CachedSource(Source):
    """``raw``'s samples after the first ``cached`` stages of ``pipeline``.

    Args:
        raw: the backend listing.
        pipeline: the dataset's pipeline (its first ``cached`` stages run here).
        cached: how many leading stages are applied (at least 1; the last declares its output).
        prep: the server's preprocessing workers (``None``: sizes and fingerprint only, e.g. to
            describe the dataset; a read then raises).
    """

    def __init__(self, raw: Source, pipeline: Pipeline, cached: int, prep: PrepWorkers | None) -> None:
        self.raw, self.pipeline, self.cached, self.prep = raw, pipeline, cached, prep
        self.output = pipeline.output(cached)
        self._message = pipeline.to_proto().SerializeToString(deterministic=True)
        prefix = hashlib.sha256(self._message + b"\0" + str(cached).encode()).hexdigest()
        super().__init__(
            raw.backend,
            raw.dataset,
            raw.uri,
            raw.kind,
            raw.root,
            raw.protocol,
            np.full(raw.count, self.output.nbytes, dtype=np.int64),
            f"{raw.fingerprint.digest}\0preprocessed {prefix}".encode(),
            keys=raw.keys,
            row_offset=raw.row_offset,
            labels=raw.labels,
            classes=raw.classes,
            stamps=raw.stamps,
            file_stamp=raw.file_stamp,
            unwatchable=raw.unwatchable,
        )

    def read_into(self, sample_id: int, buf: memoryview | bytearray | np.ndarray) -> int:
        """Read one sample, preprocessed, into the start of ``buf`` (at least its size).

        Raises:
            as :meth:`Source.read_into`, and PreprocessError: its stages failed.
        """
        i = self._check_id(sample_id)
        size = int(self.sizes[i])
        out = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
        _, errors = self.read_run([i], out.reshape(-1).view(np.uint8), [0], [size])
        if errors:
            raise errors[0]
        return size

    def read_run(
        self, ids: Sequence[int], out: np.ndarray, offsets: Sequence[int], sizes: Sequence[int]
    ) -> tuple[list[int], list[DatasetError]]:
        """Read the backend's bytes of ``ids``, run the cached stages on them and write each result
        into ``out`` at its offset; the crc32c of each sample (0 for a failed one) and one error
        per failed sample, naming it, its file and the failing stage.

        Raises:
            StateError: this source has no preprocessing workers, or they were closed.
        """
        if self.prep is None:
            raise StateError(f"dataset {self.dataset!r}: no preprocessing workers to read cached samples with")
        ids = [int(i) for i in ids]
        crcs = [0] * len(ids)
        if not ids:
            return crcs, []
        lengths = self.raw.sizes[ids]
        starts = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        buffer = np.empty(max(int(starts[-1]), 1), dtype=np.uint8)
        _, errors = self.raw.read_run(ids, buffer, starts[:-1].tolist(), lengths.tolist())
        failed = {e.sample for e in errors}
        keep = [j for j, i in enumerate(ids) if i not in failed]
        chunks = [keep[a : a + TASK_SAMPLES] for a in range(0, len(keep), TASK_SAMPLES)]
        tasks = [
            PrepTask(
                self.dataset,
                self._message,
                self.cached,
                0,
                0,
                tuple(ids[j] for j in chunk),
                tuple(buffer[starts[j] : starts[j + 1]].tobytes() for j in chunk),
                None,
            )
            for chunk in chunks
        ]
        for chunk, results in zip(chunks, self.prep.run_all(tasks), strict=True):
            for j, result in zip(chunk, results, strict=True):
                if not isinstance(result, bytes):
                    errors.append(self._failed(ids[j], str(result)))
                    continue
                slot = out[offsets[j] : offsets[j] + sizes[j]]
                if len(result) > len(slot):
                    errors.append(self._failed(ids[j], f"{len(result)} bytes for a {len(slot)}-byte place"))
                    continue
                slot[: len(result)] = np.frombuffer(result, dtype=np.uint8)
                slot[len(result) :] = 0
                crcs[j] = crc32c(slot)
        return crcs, errors

    def _failed(self, sample: int, why: str) -> PreprocessError:
        return PreprocessError(
            f"{why} (file {self.raw.path(sample)}, while caching it preprocessed)", dataset=self.dataset, sample=sample
        )

    def check(self, ids: Sequence[int] | np.ndarray) -> list[Change]:
        """The backend files' changes since the listing (:meth:`Source.check` of the raw listing)."""
        return self.raw.check(ids)

    def verify(self, ids: np.ndarray) -> list[Change]:
        """The attach-time comparison of the raw files (:meth:`Source.verify` of the raw listing)."""
        return self.raw.verify(ids)

    def reopen(self) -> Source:
        """List the backend again, seen through the same stages."""
        return CachedSource(self.raw.reopen(), self.pipeline, self.cached, self.prep)
