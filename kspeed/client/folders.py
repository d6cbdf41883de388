"""A torchvision-style folder dataset as KSpeed serves it: its files as a dataset spec, its stages,
and where they run (on the servers when they can be sent as data, else on the client).

Usage (through :meth:`kspeed.KSpeedClient.wrap`, which this module serves)::

    folder = ImageFolder("/data/imgs", transform=my_transform)    # any object with .samples, .loader
    loader = client.wrap(folder, batch_size=64)                    # registers and preloads the files
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, targets in loader:                             # as DataLoader(folder, ...) yields
            train(images, targets)

The wrapped dataset is duck-typed: ``.samples`` is a list of ``(path, target)`` pairs, ``.loader``
maps a file to a sample, ``.transform`` and ``.target_transform`` are optional. Its files become a
KSpeed dataset whose sample ``i`` is ``samples[i]``: a ``dir`` dataset over the files' common root
when the samples are exactly that tree in sorted order (no file is written), otherwise a ``list``
file of absolute paths in a hidden ``.kspeed`` directory under that root (``list_dir=`` moves it).
The dataset's name is a hash of the paths, so wrapping the same files again attaches to the data
already cached. Targets never travel: the client looks them up by the delivered sample IDs.

When the loader is torchvision's PIL loader and every transform is one of torchvision's common
ones (:func:`kspeed.client.prep.offload.folder_pipeline`), the dataset gets a pipeline: the servers
decode and run the transforms up to the last uint8 one, re-created from their parameters and
seeded per sample, and the client runs the float rest (``ToTensor``, ``Normalize``) and
``collate_fn``; the dataset's name then also hashes the pipeline. ``offload=`` keeps that pipeline
and only moves its server stages, for some or (``offload=0``) all of each batch's samples, to the
client's workers, where the same seeded stages give the same bytes. Otherwise (or when the servers
refuse the pipeline) the loader, transforms and ``collate_fn`` run in worker processes
(:mod:`kspeed.client.prep.workers`), with torch's, Python's and numpy's global generators seeded
per sample from ``(seed, epoch, sample)``, so a random transform gives a sample the same bytes
whatever the number of workers; why is logged once. The loader gets each sample's bytes as an
``io.BytesIO`` (torchvision's path-based ``pil_loader``/``default_loader`` are swapped for the
same PIL code on a file object). They must therefore be picklable (module-level functions or
objects), and the batches keep the sampler's order. The workers start before the dataset
registers, so that they get ready meanwhile (:func:`client_workers_needed` says whether it will
need them).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import default_collate

from kspeed.client.prep.offload import folder_pipeline
from kspeed.client.prep.workers import Stages, check_picklable, resolve_loader
from kspeed.client.spec import DatasetSpec
from kspeed.errors import ConfigError
from kspeed.preprocess.pipeline import CACHES, Pipeline

__all__ = [
    "LIST_PREFIX",
    "client_workers_needed",
    "folder_pipeline_choice",
    "folder_samples",
    "folder_spec",
    "folder_stages",
]

log = logging.getLogger(__name__)

#: A list file written beside the class folders is named ``<LIST_PREFIX><dataset>.list``: a hidden
#: *file* at the root, since torchvision's ``ImageFolder`` takes every directory there (hidden ones
#: too) for a class, and a directory of list files would break the next ``ImageFolder(root)``.
LIST_PREFIX = ".kspeed-"


def _tree_keys(root: str) -> list[str] | None:
    """The non-hidden files under ``root`` as the servers' ``dir`` listing keys them, sorted.

    ``None`` when a symbolic link is met: the servers check links against their allow-list, so
    such a tree is registered as a list instead.
    """
    keys = []
    for top, dirs, files in os.walk(root):
        if any(os.path.islink(os.path.join(top, d)) for d in dirs):
            return None
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for f in files:
            path = os.path.join(top, f)
            if os.path.islink(path):
                return None
            if not f.startswith("."):
                keys.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return sorted(keys)


def _write_list(path: str, paths: Sequence[str]) -> None:
    text = "".join(f"{p}\n" for p in paths).encode()
    try:
        with open(path, "rb") as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(text)
    os.replace(tmp, path)


def folder_spec(
    paths: Sequence[str],
    *,
    list_dir: str | None = None,
    name: str | None = None,
    pipeline: Pipeline | None = None,
    cache: str = "",
) -> DatasetSpec:
    """The dataset spec whose sample ``i`` is the file ``paths[i]`` (absolute paths), with ``pipeline``
    and ``cache``.

    A ``dir`` spec over the common root when the paths are exactly its non-hidden files in sorted
    order, else a ``list`` file written to ``list_dir``, or by default the hidden file
    ``<root>/.kspeed-<name>.list`` (never a directory beside the class folders).

    Raises:
        ConfigError: a path cannot be named in a list file, or the list file cannot be written.
    """
    root = os.path.commonpath(paths)
    if root in paths:
        root = os.path.dirname(root)
    keys = [os.path.relpath(p, root).replace(os.sep, "/") for p in paths]
    kind = "dir" if keys == sorted(keys) and _tree_keys(root) == keys else "list"
    digest = hashlib.sha256("\n".join([kind, *paths]).encode()).hexdigest()
    list_name = name or f"wrap-{digest[:24]}"  # the list file is the same with or without a pipeline
    if name is None:
        name = f"{list_name}-{pipeline.digest()[:12]}" if pipeline is not None else list_name
        name += f"-{cache}" if cache else ""
    if kind == "dir":
        return DatasetSpec(name=name, uri=root, kind="dir", pipeline=pipeline, cache=cache)
    for p in paths:
        if "\n" in p or p != p.strip():
            raise ConfigError(
                f"sample path {p!r} has a line break or surrounding spaces and cannot be named in a list file",
                field="samples",
                value=p,
            )
    directory = list_dir if list_dir is not None else root
    prefix = "" if list_dir is not None else LIST_PREFIX
    uri = os.path.join(os.path.abspath(directory), f"{prefix}{list_name}.list")
    try:
        os.makedirs(directory, exist_ok=True)
        _write_list(uri, paths)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the list file of the wrapped dataset to {uri}: {exc}; pass list_dir= a "
            "writable directory the servers are allowed to read",
            field="list_dir",
            value=directory,
        ) from exc
    log.debug("wrapped %d files as dataset %s (list %s)", len(paths), name, uri)
    return DatasetSpec(name=name, uri=uri, kind="list", pipeline=pipeline, cache=cache)


def folder_samples(dataset: Any) -> tuple[list[str], list[Any]]:
    """The dataset's sample files (absolute paths) and targets, from its ``.samples`` pairs.

    Raises:
        ConfigError: ``.samples`` is missing, empty, or holds something other than pairs (named).
    """
    samples = getattr(dataset, "samples", None)
    if not isinstance(samples, Sequence) or not samples:
        kind = type(dataset).__name__
        raise ConfigError(
            f"{kind} has no non-empty .samples list of (path, target) pairs (as torchvision's "
            "ImageFolder/DatasetFolder have)",
            field="dataset",
            value=kind,
        )
    paths, targets = [], []
    for i, entry in enumerate(samples):
        if not isinstance(entry, Sequence) or isinstance(entry, str) or len(entry) != 2:
            raise ConfigError(
                f"{type(dataset).__name__}.samples[{i}] is {entry!r}, not a (path, target) pair",
                field="samples",
                value=entry,
            )
        paths.append(os.path.abspath(os.fspath(entry[0])))
        targets.append(entry[1])
    return paths, targets


def folder_stages(dataset: Any, loader: Callable[..., Any] | None, collate_fn: Callable[..., Any] | None) -> Stages:
    """The dataset's loader (or ``loader``), transforms and ``collate_fn`` (default ``default_collate``)."""
    return Stages(
        loader=resolve_loader(loader if loader is not None else getattr(dataset, "loader", None)),
        transform=getattr(dataset, "transform", None),
        target_transform=getattr(dataset, "target_transform", None),
        collate_fn=collate_fn if collate_fn is not None else default_collate,
    )


def folder_pipeline_choice(
    stages: Stages, *, offload: float | None, cache: str, workers: int | None, region_decode: bool = False
) -> tuple[Pipeline | None, str]:
    """The pipeline the servers may run for ``stages``, or ``None`` and why not; kept with
    ``offload=0`` too (the client then runs all its stages, seeded per sample as on the servers).
    ``region_decode``: decode only the region of a leading ``RandomResizedCrop``
    (:mod:`kspeed.preprocess.jpeg_region`).

    Raises:
        ConfigError: a stage cannot be pickled for the workers, ``cache`` is unknown, or
            ``cache="preprocessed"`` or ``region_decode`` while the stages cannot run as a pipeline
            (named).
    """
    if workers != 0:  # the stages travel to worker processes
        check_picklable(stages)
    if cache not in CACHES:
        raise ConfigError(f"cache {cache!r} is not one of '', 'preprocessed'", field="cache", value=cache)
    pipeline, why = folder_pipeline(stages.loader, stages.transform, cache=bool(cache), region_decode=region_decode)
    for asked, field, value in ((cache, "cache", cache), (region_decode, "region_decode", region_decode)):
        if asked and pipeline is None:
            raise ConfigError(
                f"{field}={value!r} needs the loader and transforms to run as a pipeline, and {why}",
                field=field,
                value=value,
            )
    return pipeline, why


def client_workers_needed(stages: Stages, pipeline: Pipeline | None, *, offload: float | None) -> bool:
    """Whether the batches of a folder dataset with ``stages`` (and, if the servers take it,
    ``pipeline``) go through the client's workers: not when the servers run every stage, on every
    sample, and only the default collation is left (it runs in the training process)."""
    if pipeline is None:
        return True
    servers_run_all = pipeline.gpu_from == pipeline.server_stages and (offload is None or offload >= 1)
    return not (servers_run_all and stages.collate_fn is default_collate)
