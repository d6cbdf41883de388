"""How one rank is fed one dataset: the options of :meth:`KSpeedClient.dataset`, checked once, frozen.

The client's public methods take these as keyword arguments (so a training script reads as a
``DataLoader`` call does) and turn them into one :class:`FeedOptions` at their first line; every
layer below passes that object on instead of threading a dozen parameters through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from kspeed import names
from kspeed.errors import ConfigError

__all__ = ["AUTO_OFFLOAD", "FeedOptions"]

#: The ``offload`` setting that lets the client decide the split while the job runs.
AUTO_OFFLOAD = "auto"
#: What a group shares (``docs/groups.md``): each sample's server-stage output, or its stored form.
SHARE_MODES = ("samples", "decoded")


@dataclasses.dataclass(frozen=True)
class FeedOptions:
    """The options of one rank's feed of one dataset.

    Attributes:
        batch_size: samples per batch.
        sampler: any torch sampler of sample IDs; ``None``: every sample (shuffled per epoch with
            ``seed`` when ``shuffle``), split over the ranks of the job (a ``DistributedSampler``).
        seed: seed of the built-in shuffle.
        shuffle: whether the built-in sampler shuffles.
        shuffle_buffer: tar shards only: 0 (default) for the exact order of the built-in sampler
            (any sample next: one ranged read each); N > 0 for WebDataset's order (shards
            shuffled and split over the ranks, samples shuffled within a buffer of N;
            :class:`kspeed.client.planning.sampling.ShardOrder`).
        drop_last: drop the last incomplete batch of each epoch.
        rank: this rank for the built-in sampler (default: from the job's launcher).
        world_size: ranks sharing each epoch for the built-in sampler.
        rail: the data-plane rail, or ``None`` for the client configuration's (``"auto"``: chosen
            from the rails' capabilities).
        ring_bytes: receive ring size, or ``None`` for the configuration's (0: sized from the
            batches).
        quiet: no progress bar in ``preload()``.
        device: where batches are delivered: ``"cpu"`` (zero-copy ring views), ``"cuda"`` or
            ``"cuda:N"``.
        offload: with a pipeline, the share (0..1) of each batch's samples whose ``server`` stages
            run on the servers (the rest run them on this client); ``"auto"`` (or ``None``, the
            default): decided and re-decided while the job runs (:mod:`kspeed.client.tuning`).
        model: with ``offload="auto"``, what the split is remembered under on the manager for the
            next run (FastFlow's metric store): a name, or the ``torch.nn.Module`` being trained
            (its structure, not its weights); ``None``: the job, the script and the batch size.
        on_error: with a pipeline or transforms, what a sample whose preparation fails (a corrupt
            image, a stage that raises, an output unlike its declaration) does: ``"raise"`` ends
            the iteration with an error naming it; ``"skip"`` leaves it out of its batch, logged
            and counted (``stats()["skipped"]``).
        group: shared preparation (``docs/groups.md``): the jobs that name the same group share
            the servers' work on the dataset; ``None``: none.
        share: in a group, what is shared: ``"samples"`` (the default: each sample's server-stage
            output per epoch, made once for every job of the group, which must then use the same
            ``seed``) or ``"decoded"`` (the dataset's stored, deterministic form, with
            ``cache="preprocessed"``; each job's random stages draw from its own ``seed``).
        group_lag: in a group, samples of the dataset the fastest job may lead the slowest by
            before the slowest is served alone for the samples it lags on (``None``: the servers'
            default, a quarter of their production window).

    Raises:
        ConfigError: a field is invalid (named), or an unknown option was given to
            :meth:`from_kwargs`.
    """

    batch_size: int
    sampler: Iterable[int] | None = None
    seed: int = 0
    shuffle: bool = True
    shuffle_buffer: int = 0
    drop_last: bool = False
    rank: int | None = None
    world_size: int | None = None
    rail: str | None = None
    ring_bytes: int | None = None
    quiet: bool = False
    device: str | torch.device = "cpu"
    offload: float | str | None = None
    model: Any = None
    on_error: str = "raise"
    group: str | None = None
    share: str = "samples"
    group_lag: int | None = None

    def __post_init__(self) -> None:
        if self.group is not None:
            names.GROUP.check(self.group, ConfigError, field="group", value=self.group)
        if self.share not in SHARE_MODES:
            raise ConfigError(
                f"share must be one of {', '.join(SHARE_MODES)}, got {self.share!r}", field="share", value=self.share
            )
        if self.group_lag is not None:
            _positive_int("group_lag", self.group_lag)
        if self.on_error not in ("raise", "skip"):
            raise ConfigError(
                f"on_error must be 'raise' or 'skip', got {self.on_error!r}", field="on_error", value=self.on_error
            )
        _positive_int("batch_size", self.batch_size)
        _non_negative_int("shuffle_buffer", self.shuffle_buffer)
        if (
            self.offload is not None
            and self.offload != AUTO_OFFLOAD
            and (
                isinstance(self.offload, bool)
                or not isinstance(self.offload, int | float)
                or not 0.0 <= float(self.offload) <= 1.0
            )
        ):
            raise ConfigError(
                f"offload must be a fraction between 0 and 1 or 'auto', got {self.offload!r}",
                field="offload",
                value=self.offload,
            )
        if self.ring_bytes is not None:
            _non_negative_int("ring_bytes", self.ring_bytes)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}", field="seed", value=self.seed)
        if self.rail is not None and not isinstance(self.rail, str):
            raise ConfigError(f"rail must be a rail name or 'auto', got {self.rail!r}", field="rail", value=self.rail)

    @property
    def auto_offload(self) -> bool:
        """Whether the split is decided while the job runs (``offload="auto"`` or left out)."""
        return self.offload is None or self.offload == AUTO_OFFLOAD

    @property
    def fixed_offload(self) -> float | None:
        """The fixed split asked for (``None``: ``"auto"``)."""
        return None if self.auto_offload else float(self.offload)  # type: ignore[arg-type]

    @classmethod
    def from_kwargs(cls, batch_size: int, sampler: Iterable[int] | None = None, **kwargs: Any) -> FeedOptions:
        """Options from keyword arguments; an unknown name is a :class:`ConfigError` listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(
                f"unknown dataset option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}",
                field=unknown[0],
                value=kwargs[unknown[0]],
            )
        return cls(batch_size=batch_size, sampler=sampler, **kwargs)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}", field=name, value=value)


def _non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}", field=name, value=value)
