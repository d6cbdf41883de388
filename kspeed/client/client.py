"""KSpeedClient: the training script's handle on a KSpeed cluster.

It talks to the manager (version handshake, dataset registration with a job lease) and builds a
:class:`~kspeed.client.dataset.KSpeedDataset` per dataset, which then talks to the servers
directly; training keeps going while the manager restarts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Any

import torch
from torch.utils.data import default_collate

from kspeed.client.dataset import KSpeedDataset
from kspeed.client.delivery.device import parse_device
from kspeed.client.feeding.builder import build_feed
from kspeed.client.feeding.links import ServerLink
from kspeed.client.feeding.rail_choice import ServerPlace
from kspeed.client.folders import (
    client_workers_needed,
    folder_pipeline_choice,
    folder_samples,
    folder_spec,
    folder_stages,
)
from kspeed.client.lease import LeaseKeeper
from kspeed.client.options import FeedOptions
from kspeed.client.prep.offload import attached_pipeline, plan_prep
from kspeed.client.prep.workers import preload_of, sample_bytes
from kspeed.client.prepared import PreparedDataset, start_workers
from kspeed.client.spec import DatasetSpec
from kspeed.config import ClientConfig, launcher_run_id, load_config, parse_address
from kspeed.control.manager_client import ManagerClient
from kspeed.errors import AccessDeniedError, ConfigError, DatasetError, KSpeedError, StateError, UnavailableError
from kspeed.preprocess.pipeline import Pipeline

__all__ = ["KSpeedClient"]

log = logging.getLogger(__name__)


class KSpeedClient:
    """A connection to the manager at ``manager`` (``host:port``).

    Args:
        manager: the manager's address; default ``config.manager`` (env ``KSPEED_MANAGER``).
        config: the client configuration; default: loaded from ``KSPEED_*`` (token, TLS, rail, ring).

    Raises:
        ConfigError: a bad address or configuration.
        UnavailableError: the manager cannot be reached.
        VersionMismatchError: the manager speaks no common protocol version.
    """

    def __init__(self, manager: str | None = None, *, config: ClientConfig | None = None) -> None:
        config = config if config is not None else load_config(ClientConfig)
        if manager is not None:
            try:
                address = parse_address(manager)
            except ValueError as exc:
                raise ConfigError(f"manager address {manager!r}: {exc}", field="manager", value=manager) from None
            config = dataclasses.replace(config, manager=address)
        self.config = config
        self._manager = ManagerClient(config, peer_name="kspeed-client")
        try:
            hello = self._manager.handshake()
        except KSpeedError:
            self._manager.close()
            raise
        self._datasets: list[KSpeedDataset | PreparedDataset] = []
        self._closed = False
        log.debug("connected to manager %s (cluster %s)", config.manager, hello.cluster_id)

    @property
    def manager(self) -> ManagerClient:
        """The control-plane client (status, datasets, leases)."""
        return self._manager

    def dataset(
        self,
        spec: DatasetSpec | str,
        batch_size: int,
        sampler: Any = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        rail: str | None = None,
        ring_bytes: int | None = None,
        quiet: bool = False,
        device: str | torch.device = "cpu",
        offload: float | str | None = None,
        model: Any = None,
        transform: Any = None,
        collate_fn: Any = None,
        num_workers: int | None = None,
        prefetch: int | None = None,
        on_error: str = "raise",
        group: str | None = None,
        share: str = "samples",
        group_lag: int | None = None,
        resume: str = "",
    ) -> KSpeedDataset | PreparedDataset:
        """Register (or attach to) a dataset under a job lease and open this rank's feed.

        Without a pipeline or ``transform`` this returns a :class:`KSpeedDataset` of raw
        :class:`~kspeed.client.batch.Batch` es. With a pipeline (``spec.pipeline``) or a
        ``transform``, it returns a :class:`~kspeed.client.prepared.PreparedDataset` yielding
        ``collate_fn`` of the prepared samples (with their labels if the dataset has any): the
        servers run the pipeline's ``server`` stages for ``offload`` of each batch's samples, client
        worker processes run the rest and ``transform`` (which, without a pipeline, gets each
        sample's bytes as a uint8 array), and ``gpu`` stages run on ``device``.

        Args:
            spec: the dataset's definition, or the name of a dataset already registered.
            batch_size: samples per batch.
            sampler: any torch sampler of sample IDs (``DistributedSampler`` for several ranks);
                ``None``: every sample, shuffled per epoch with ``seed`` when ``shuffle``.
            seed: seed of the built-in shuffle.
            shuffle: whether the built-in sampler shuffles.
            shuffle_buffer: tar shards: 0 (default) for the exact order (each sample one ranged
                read); N > 0 for WebDataset's order: shards shuffled and split over the ranks,
                samples shuffled within a buffer of N.
            drop_last: drop the last incomplete batch of each epoch.
            rank: this rank; with ``world_size``, builds a ``DistributedSampler``.
            world_size: ranks sharing each epoch.
            rail: ``"auto"`` (default: chosen from the rails' capabilities) or a rail's name;
                overrides ``config.rail``.
            ring_bytes: receive ring size; overrides ``config.ring_bytes``.
            quiet: no progress bar in ``preload()``.
            device: ``"cpu"`` (default: zero-copy views of the receive ring), ``"cuda"`` or ``"cuda:N"``
                (each batch copied asynchronously to that GPU); a CUDA device while none is
                available is a ``ConfigError``.
            offload: with a pipeline, the share (0..1) of each batch's samples whose ``server``
                stages run on the servers; ``"auto"`` (the default): decided and re-decided while
                the job runs from measured rates (docs/preprocessing.md).
            model: with ``offload="auto"``, what the split is remembered under on the manager for
                the next run: a name or the ``torch.nn.Module`` trained (default: the job, the
                script and the batch size).
            transform: applied to each prepared sample in the client's workers.
            collate_fn: list of samples (or ``(sample, label)`` pairs) -> batch (default
                ``default_collate``).
            num_workers: client worker processes (default: up to 4, one per CPU this process may use; 0:
                inline).
            prefetch: batches in flight in the workers (default: 2 per worker).
            on_error: ``"raise"`` (default) or ``"skip"``: a sample whose preparation fails is
                left out of its batch, logged with its ID and counted in ``stats()["skipped"]``.
            group: shared preparation (docs/groups.md): the jobs that name the same group share the
                servers' preprocessing (and, streamed, their reads) of each sample per epoch, each
                still receiving its own epochs exactly once in its own order.
            share: in a group, ``"samples"`` (default: each sample's server-stage output is made
                once for the group; every job of it uses the same ``seed``) or ``"decoded"``
                (the stored form of a dataset with ``cache="preprocessed"``; random stages per job).
            group_lag: in a group, samples the fastest job may lead the slowest by before the
                slowest is served alone for the samples it lags on (default: the servers').
            resume: ``"live"``: the servers keep this rank's position with every batch it is handed,
                and a job opened again under the same name (``KSPEED_JOB``, or torchrun's run ID,
                which its restarts keep) continues each epoch from where its ranks had got, at
                whatever world size, with no checkpoint (docs/resume.md); ``""`` (default): not.

        Raises:
            ConfigError: a bad argument (named).
            ConflictError: a job of ``group`` with ``share="samples"`` draws from another seed.
            NotFoundError: ``spec`` names a dataset that is not registered.
            DatasetError, AccessDeniedError: the dataset cannot be listed or read by the servers.
            UnavailableError: the manager or a server cannot be reached (named).
        """
        options = FeedOptions(
            batch_size=batch_size,
            sampler=sampler,
            seed=seed,
            shuffle=shuffle,
            shuffle_buffer=shuffle_buffer,
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
            rail=rail,
            ring_bytes=ring_bytes,
            quiet=quiet,
            device=device,
            offload=offload,
            model=model,
            on_error=on_error,
            group=group,
            share=share,
            group_lag=group_lag,
        )
        # Stages on this client's CPU read the bytes in host memory: the feed delivers there, and the
        # prepared batches move to the device (a raw dataset's batches are delivered to it directly).
        if resume not in ("", "live"):
            raise ConfigError(f"resume must be '' or 'live', got {resume!r}", field="resume", value=resume)
        job = (self.config.job or launcher_run_id()) if resume else ""
        if resume and not job:
            raise ConfigError(
                "resume='live' finds a job's position by the job's name, the same for its ranks and its restarts: "
                "set KSPEED_JOB (or the client's job setting), or run under torchrun (its run ID)",
                field="resume",
            )
        host = str(device) != "cpu" and (transform is not None or self._pipeline_of(spec) is not None)
        ds = self.open(spec, options, host=host)
        out: KSpeedDataset | PreparedDataset = ds
        try:
            if ds.pipeline is not None or transform is not None:
                out = PreparedDataset(
                    ds,
                    loader=sample_bytes if ds.pipeline is None else None,
                    transform=transform,
                    collate_fn=collate_fn if collate_fn is not None else default_collate,
                    num_workers=num_workers,
                    prefetch=prefetch,
                    device=device,
                )
            if job and out.resume_live(job):
                log.info("dataset %s: resumed live as job %s at epoch %d", ds.name, job, out.epoch)
        except BaseException:
            out.close()  # (a PreparedDataset closes its KSpeed dataset)
            raise
        self._datasets.append(out)
        return out

    def _pipeline_of(self, spec: DatasetSpec | str) -> Pipeline | None:
        """The pipeline ``spec`` declares (a registered dataset's, for a name)."""
        if isinstance(spec, DatasetSpec):
            return spec.pipeline
        if isinstance(spec, str):
            return attached_pipeline(self._manager.dataset(spec).spec.pipeline)
        return None  # open() names the wrong type

    def open(self, spec: DatasetSpec | str, options: FeedOptions, *, host: bool = False) -> KSpeedDataset:
        """:meth:`dataset` with its options as one object (the caller closes the dataset).

        Args:
            spec: as :meth:`dataset`.
            options: the feed's options.
            host: deliver into host memory whatever ``options.device`` (for a
                :class:`PreparedDataset`, whose CPU stages read the bytes there and which moves
                its batches to the device itself).

        Raises:
            as :meth:`dataset`.
        """
        if self._closed:
            raise StateError("KSpeedClient is closed; create a new one")
        if host:
            parse_device(options.device)  # the device the batches go to later is checked now all the same
            options = dataclasses.replace(options, device="cpu")
        if isinstance(spec, str):
            proto = self._manager.dataset(spec).spec
        elif isinstance(spec, DatasetSpec):
            proto = spec.to_proto()
        else:
            raise ConfigError(
                f"spec must be a DatasetSpec or a dataset name, got {type(spec).__name__}", field="spec", value=spec
            )
        holder = f"pid {os.getpid()} on {socket.gethostname()} rank {options.rank or 0}"
        reply = self._manager.create_dataset(proto, holder=holder)
        lease = LeaseKeeper(self._manager, reply.lease.id, reply.lease.ttl_s) if reply.lease.id else None
        links: list[ServerLink] = []
        try:
            info = reply.dataset
            records = self._manager.servers()
            places = {
                record.id: ServerPlace(record.address, record.inventory.hostname, tuple(record.inventory.transports))
                for record in records
            }
            for share in info.shares:
                address = info.server_addresses.get(share.server_id)
                if not address:
                    raise UnavailableError(
                        f"dataset {proto.name!r}: server {share.server_id} holds a share but the "
                        "manager knows no address for it (is it registered?)"
                    )
                links.append(
                    ServerLink(share.server_id, address, self.config, first_id=share.first_id, end_id=share.end_id)
                )
            pipeline = spec.pipeline if isinstance(spec, DatasetSpec) else attached_pipeline(proto.pipeline)
            prep = plan_prep(
                proto.name,
                pipeline,
                pipeline.cached_stages(proto.cache) if pipeline is not None else 0,
                options,
                {r.id: dict(r.inventory.libraries) for r in records if r.id in {s.server_id for s in info.shares}},
            )
            parts = build_feed(
                info, links, config=self.config, options=options, places=places, manager=self._manager, prep=prep
            )
            return KSpeedDataset(
                info, parts, options=options, manager=self._manager, lease=lease, pipeline=pipeline, prep=prep
            )
        except BaseException:
            for link in links:
                link.close()
            if lease is not None:
                lease.close()
            raise

    def wrap(
        self,
        dataset: Any,
        batch_size: int,
        sampler: Any = None,
        *,
        collate_fn: Any = None,
        loader: Any = None,
        num_workers: int | None = None,
        prefetch: int | None = None,
        list_dir: str | None = None,
        name: str | None = None,
        preload: bool = True,
        cache: str = "",
        region_decode: bool = False,
        **options: Any,
    ) -> PreparedDataset:
        """Serve a torchvision-style folder dataset (``.samples``, ``.loader``, transforms) from the servers.

        Registers the dataset's files (named by a hash of their paths, so wrapping them again
        attaches to the cached data), preloads them unless ``preload=False``, and returns an
        iterable of batches as ``DataLoader(dataset, batch_size, sampler, collate_fn)`` yields
        them; the loader and transforms run in worker processes on this host
        (:mod:`kspeed.client.prepared`), which start before the dataset registers and get ready
        meanwhile (the first batch waits for them). :meth:`close` joins those workers.

        Args:
            dataset: an ``ImageFolder``/``DatasetFolder``-like object.
            batch_size: samples per batch.
            sampler: as in :meth:`dataset` (``None``: shuffled per epoch with ``seed``).
            collate_fn: list of ``(sample, target)`` pairs -> batch (default ``default_collate``).
            loader: replaces ``dataset.loader``; called on a binary file object.
            num_workers: transform worker processes (default: up to 4, one per CPU this process may use).
            prefetch: batches in flight in the workers (default: 2 per worker).
            list_dir: where to write the list file when one is needed (default: the hidden file
                ``<root>/.kspeed-<name>.list``, which ``ImageFolder`` ignores).
            name: the dataset's name in the cluster (default: from a hash of the paths).
            preload: wait for the servers to cache the files before returning.
            cache: ``"preprocessed"``: the servers keep each image after the leading transforms
                that are not random and give a fixed size (``Resize``, ``CenterCrop``), applied
                once at preload, and run the rest every epoch; ``""``: they keep the files.
            region_decode: decode only the region a leading ``RandomResizedCrop`` keeps, with
                libjpeg-turbo, in one stage (:mod:`kspeed.preprocess.jpeg_region`): the same boxes,
                resampled differently (a different but equally distributed augmentation), faster.
            **options: the other options of :meth:`dataset` (``seed``, ``shuffle``, ``drop_last``,
                ``rank``, ``world_size``, ``rail``, ``ring_bytes``, ``quiet``).

        Raises:
            ConfigError: the dataset lacks ``.samples``/``.loader``, a stage cannot be pickled, the
                loader needs a path, an option is unknown, the list file cannot be written, or
                ``cache``/``region_decode`` cannot apply or the servers refuse it (named).
            StateError: called with workers from a top-level line of the main script outside
                ``if __name__ == "__main__":``, which each worker would run again (named).
            DatasetError, AccessDeniedError: the servers cannot list or read the files.
            UnavailableError: the manager or a server cannot be reached (named).
        """
        paths, targets = folder_samples(dataset)
        stages = folder_stages(dataset, loader, collate_fn)
        feed_options = FeedOptions.from_kwargs(batch_size, sampler, **options)
        offload = feed_options.fixed_offload
        pipeline, why = folder_pipeline_choice(
            stages, offload=offload, cache=cache, workers=num_workers, region_decode=region_decode
        )
        workers = None
        # with offload="auto" the split may leave samples to this client: its workers are made ready
        if client_workers_needed(stages, pipeline, offload=0.0 if feed_options.auto_offload else offload):
            # Started first, so that they get ready while the dataset registers and preloads; they
            # import what either way of running the stages needs.
            workers = start_workers(num_workers, preload_of(dataclasses.replace(stages, pipeline=pipeline)))
        inner, level = None, logging.DEBUG
        try:
            if pipeline is not None:
                spec = folder_spec(paths, list_dir=list_dir, name=name, pipeline=pipeline, cache=cache)
                try:
                    inner = self.open(spec, feed_options, host=True)
                    stages = dataclasses.replace(stages, loader=None, transform=None)
                    log.debug(
                        "dataset %s: loader and transforms run as a pipeline (%s), its server stages on the servers "
                        "for a share of %s of each batch",
                        spec.name,
                        pipeline,
                        1.0 if feed_options.offload is None else feed_options.offload,
                    )
                except (AccessDeniedError, ConfigError) as exc:
                    if cache or region_decode:  # asked for: not kept silently from the user
                        raise
                    why = f"the servers refused its pipeline: {exc}"
                    level = logging.WARNING  # the servers' preprocess_allow or workers, not the dataset: worth a word
            if inner is None:
                log.log(level, "wrapped dataset: its loader and transforms run in client workers (%s)", why)
                spec = folder_spec(paths, list_dir=list_dir, name=name)
                inner = self.open(spec, feed_options, host=True)
            if inner.num_samples != len(paths):
                raise DatasetError(
                    f"dataset {spec.name!r} ({spec.uri}) lists {inner.num_samples} files on the servers, "
                    f"the wrapped dataset has {len(paths)} samples (did the files change?)",
                    dataset=spec.name,
                )
            if preload:
                inner.preload()
            wrapped = PreparedDataset(
                inner,
                paths=paths,
                targets=targets,
                num_workers=num_workers,
                prefetch=prefetch,
                transform_workers=workers,
                device=feed_options.device,
                source=dataset,
                **stages.named(),
            )
        except BaseException:
            if workers is not None:
                workers.close()
            if inner is not None:
                inner.close()
            raise
        self._datasets.append(wrapped)  # close() closes it: its workers, then its KSpeed dataset
        return wrapped

    def close(self) -> None:
        """Close every dataset (feeds, rings, leases) and the manager channel."""
        if self._closed:
            return
        self._closed = True
        for ds in self._datasets:
            ds.close()
        self._datasets.clear()
        self._manager.close()

    def __enter__(self) -> KSpeedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
