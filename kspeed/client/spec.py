"""What a dataset is, as the training script names it: a frozen mirror of ``kspeed.v1.DatasetSpec``.

The manager checks the same rules again; checking them here too means a typo fails at the line
that made it, before any daemon is asked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kspeed import names, uris
from kspeed.errors import ConfigError
from kspeed.policies import POLICIES
from kspeed.preprocess.pipeline import Pipeline

__all__ = ["DatasetSpec"]

KINDS = ("auto", "dir", "list", "manifest", "npy", "tar")
LABELS = ("", "dirname", "cls")


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset definition; two registrations of one name must agree on every field.

    Attributes:
        name: the dataset's name in the cluster: 1-128 letters, digits, ``.``, ``_`` or ``-``,
            starting with a letter or digit.
        uri: a directory tree, list file, manifest file, ``.npy`` or tar shards (a ``.tar``, a brace
            pattern such as ``train-{000..099}.tar``, or a directory of them; path or fsspec URL) that the
            servers' operator allows. A relative path is made absolute against this process's
            working directory (the servers read the same path: a local cluster, or a shared mount).
            It names no credentials (``user:password@``, a token or a signature in the query):
            those belong to the servers' ``backend_options`` (:mod:`kspeed.uris`).
        kind: how to read ``uri``: ``auto`` (default), ``dir``, ``list``, ``manifest``, ``npy`` or ``tar``.
        labels: ``""`` (no labels), ``"dirname"`` (class index of each sample's parent directory) or
            ``"cls"`` (tar shards: the integer in each sample's ``.cls`` member).
        quota_bytes: most pooled memory the dataset may take (0: no quota).
        pipeline: what every sample goes through before the training loop sees it
            (:class:`kspeed.preprocess.Pipeline`); part of the dataset's identity (its stages and
            outputs, not where they run).
        policy: what the servers keep in memory (:mod:`kspeed.policies`): ``auto`` (default: the
            whole dataset when it fits, else ``stream``), ``cache``, ``stream``, or for comparison
            ``minio``, ``reuse``, ``lru``. The quota bounds the memory a policy uses.
        cache: what the servers keep: ``""`` (the backend's bytes, default) or ``"preprocessed"``
            (each sample after the pipeline's deterministic leading stages, applied once at preload
            by the servers' workers; the random rest runs every epoch). Part of the identity too.

    Raises:
        ConfigError: a field is invalid (the message names it).
    """

    name: str
    uri: str
    kind: str = "auto"
    labels: str = ""
    quota_bytes: int = 0
    pipeline: Pipeline | None = None
    cache: str = ""
    policy: str = "auto"

    def __post_init__(self) -> None:
        names.DATASET.check(self.name, ConfigError, what="DatasetSpec.name", field="name", value=self.name)
        uris.check(
            self.uri,
            ConfigError,
            what=f"DatasetSpec.uri of dataset {self.name!r}",
            field="uri",
            value=uris.redact(self.uri) if isinstance(self.uri, str) else self.uri,
        )
        if "://" not in self.uri and not os.path.isabs(self.uri):
            object.__setattr__(self, "uri", os.path.abspath(self.uri))
        if self.kind not in KINDS:
            raise ConfigError(
                f"DatasetSpec.kind {self.kind!r} of dataset {self.name!r} is not one of {', '.join(KINDS)}",
                field="kind",
                value=self.kind,
            )
        if self.labels not in LABELS:
            raise ConfigError(
                f"DatasetSpec.labels {self.labels!r} of dataset {self.name!r} is not one of '', 'dirname', 'cls'",
                field="labels",
                value=self.labels,
            )
        if isinstance(self.quota_bytes, bool) or not isinstance(self.quota_bytes, int) or self.quota_bytes < 0:
            raise ConfigError(
                f"DatasetSpec.quota_bytes {self.quota_bytes!r} of dataset {self.name!r} must be a non-negative integer",
                field="quota_bytes",
                value=self.quota_bytes,
            )
        if self.policy not in POLICIES:
            raise ConfigError(
                f"DatasetSpec.policy {self.policy!r} of dataset {self.name!r} is not one of {', '.join(POLICIES)}",
                field="policy",
                value=self.policy,
            )
        if self.pipeline is not None and not isinstance(self.pipeline, Pipeline):
            raise ConfigError(
                f"DatasetSpec.pipeline of dataset {self.name!r} must be a kspeed.preprocess.Pipeline, "
                f"got {type(self.pipeline).__name__}",
                field="pipeline",
            )
        if self.cache and self.pipeline is None:
            raise ConfigError(
                f"DatasetSpec.cache {self.cache!r} of dataset {self.name!r} needs a pipeline", field="cache"
            )
        cached = self.pipeline.cached_stages(self.cache) if self.pipeline is not None else 0
        on_gpu = [k for k in range(cached) if self.pipeline is not None and self.pipeline.stages[k].place == "gpu"]
        if on_gpu:
            raise ConfigError(
                f"dataset {self.name!r}: stage {on_gpu[0]} is placed on the gpu, but cache='preprocessed' applies "
                f"the first {cached} stage(s) once at preload on the servers",
                field="cache",
            )

    @property
    def cached_stages(self) -> int:
        """Leading pipeline stages the servers keep applied (see ``cache``)."""
        return self.pipeline.cached_stages(self.cache) if self.pipeline is not None else 0

    def to_proto(self):
        """The protobuf message sent to the manager."""
        from kspeed.proto import kspeed_pb2

        return kspeed_pb2.DatasetSpec(
            name=self.name,
            uri=self.uri,
            kind=self.kind,
            labels=self.labels,
            quota_bytes=self.quota_bytes,
            pipeline=self.pipeline.to_proto() if self.pipeline is not None else None,
            cache=self.cache,
            policy=self.policy,
        )
