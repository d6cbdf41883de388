"""Refuse to be iterated through Hugging Face Accelerate's ``DataLoader`` wrappers.

``accelerator.prepare(DataLoader(ds, batch_size=None))`` replaces the loader with one that either
has the first process read and broadcast every batch (``DataLoaderDispatcher``, its default for an
iterable dataset) or has every process read the whole dataset and keep one slice of each group of
elements (``IterableDatasetShard``). A KSpeed dataset already gives each rank its own part of
every epoch, so both would split it again: the dispatcher fails on a batch it cannot broadcast
(``TypeError: Unsupported types``, with no word of why), and the shard needs a batch size a
KSpeed loader does not have. Handed the KSpeed dataset itself, ``prepare()`` returns it unchanged
and every rank reads its own part: :func:`check_not_resharded` says so when the wrappers iterate it.
"""

from __future__ import annotations

import sys

from kspeed.errors import StateError

__all__ = ["check_not_resharded"]

_ACCELERATE = "accelerate.data_loader"
_DEPTH = 16  # frames looked through: torch's DataLoader iterator sits between the wrapper and the dataset


def check_not_resharded(name: str) -> None:
    """Raise when the iteration of dataset ``name`` comes from Accelerate's loader wrappers.

    Raises:
        StateError: it does; the message says what to pass to ``prepare()`` instead.
    """
    frame = sys._getframe(1)
    for _ in range(_DEPTH):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return
        if frame.f_globals.get("__name__") == _ACCELERATE:
            raise StateError(
                f"dataset {name!r} is iterated through a DataLoader that accelerator.prepare() wrapped: Accelerate "
                "would split its batches over the processes again, but each rank already receives its own part "
                "of every epoch; pass the KSpeed dataset itself: ds = accelerator.prepare(ds) returns it unchanged "
                "(open it with device=accelerator.device, or move each batch with batch.to(accelerator.device))"
            )
