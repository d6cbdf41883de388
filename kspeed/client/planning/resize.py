"""What is left of an epoch, and each rank's part of it, when a job resumes at another world size.

An epoch whose order splits the way ``DistributedSampler`` splits it (the built-in sampler, or a
``DistributedSampler`` of the caller's) has one **global order**: a permutation of the dataset
drawn from (seed, epoch) alone, whatever the world size. A **pass** over it splits the order
among ``world`` ranks: padded to a multiple of ``world`` by repeating its start, rank ``r`` takes
positions ``r, r + world, r + 2 * world, ...``. A rank that consumed ``k`` samples of its part
delivered its first ``k`` positions.

A job that stops part way through a pass and resumes with another world size starts a new pass
over what is left: the samples of the previous pass's order that no rank delivered (padding
copies do not count), in that order. Resized again, the next pass splits what that one left, and
so on; a pass is recorded as its world size and each rank's count (:class:`Pass`), never as a
list of IDs. Each rank of a pass is padded as ``DistributedSampler`` pads, so the ranks of a pass
get equal parts; over the whole epoch every sample is delivered once, apart from those pads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kspeed.errors import ConfigError

__all__ = ["Pass", "part_of", "remainder"]


@dataclass(frozen=True)
class Pass:
    """One split of an epoch's order: ``world`` ranks, rank ``r`` having consumed ``positions[r]``
    samples of its part."""

    world: int
    positions: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.world < 1 or len(self.positions) != self.world or min(self.positions, default=0) < 0:
            raise ConfigError(
                f"a pass of {self.world} ranks needs one non-negative position per rank, got {list(self.positions)}",
                field="state",
            )

    def to_state(self) -> list:
        return [self.world, list(self.positions)]

    @classmethod
    def from_state(cls, value: object) -> Pass:
        """A pass as :meth:`to_state` writes it.

        Raises:
            ConfigError: it is not one.
        """
        bad = ConfigError(f"not a pass of a KSpeed state (world, positions): {value!r:.200}", field="state")
        if not isinstance(value, list | tuple) or len(value) != 2 or not isinstance(value[1], list | tuple):
            raise bad
        try:
            return cls(int(value[0]), tuple(int(p) for p in value[1]))
        except (TypeError, ValueError) as exc:
            raise bad from exc


def part_of(order: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s part of ``order`` split over ``world`` ranks as ``DistributedSampler``
    splits (padded from its start to a multiple of ``world``)."""
    total = -(-len(order) // world) * world
    if total > len(order) and len(order):
        order = np.concatenate([order, np.resize(order, total - len(order))])
    return np.ascontiguousarray(order[rank:total:world])


def remainder(order: np.ndarray, passes: Sequence[Pass]) -> np.ndarray:
    """What of the epoch's global ``order`` no rank of ``passes`` (in the order they ran) delivered,
    in that order."""
    rest = np.asarray(order)
    for p in passes:
        n = len(rest)
        per_rank = -(-n // p.world)
        done = np.zeros(n, dtype=bool)
        for rank, k in enumerate(p.positions):
            at = rank + p.world * np.arange(min(k, per_rank), dtype=np.int64)
            done[at[at < n]] = True  # (positions past the order are padding copies)
        rest = rest[~done]
    return rest
