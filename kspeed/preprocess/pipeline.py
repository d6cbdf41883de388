"""Pipelines: ordered stages of preprocessing, sent as data, placed per stage.

A :class:`Pipeline` is what every sample of a dataset goes through before the training loop sees
it: built-in ops (:mod:`kspeed.preprocess.ops`), torchvision transforms re-created from their
parameters (``"torchvision.transforms:RandomResizedCrop"``) or user functions named by import path
(``"pkg.module:function"``, called as ``function(x, rng, **params)``). It travels as op names and
JSON parameters, never pickled, and is part of the dataset's identity (:class:`kspeed.DatasetSpec`).

Each stage has a place: ``server`` (the servers' worker processes, producing into their
production window), ``client`` (the training node's worker processes) or ``gpu`` (torch ops on
the device after delivery). Places run in that order. The last ``server`` stage declares its
:class:`Output` (a fixed shape and dtype, or a maximum size with each sample's real shape in a
small header), so the client lays out its receive ring before the bytes exist.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kspeed.errors import ConfigError

__all__ = [
    "CACHES",
    "HEADER",
    "KINDS",
    "PLACES",
    "STATUS",
    "Output",
    "Pipeline",
    "Stage",
    "read_status",
    "write_status",
]

PLACES = ("server", "client", "gpu")
#: What a dataset's servers keep: the backend's bytes, or each sample after the pipeline's
#: deterministic leading stages (:meth:`Pipeline.cached_stages`), applied once at preload.
CACHES = ("", "preprocessed")
KINDS = ("array", "pil", "tensor")
#: Header of a variable-shape sample: payload bytes, dtype code, ndim, up to six dimensions.
_HEADER = struct.Struct("<IHH6I")
HEADER = _HEADER.size
MAX_DIMS = 6
#: Dtypes a stage may declare (a code in the header of variable outputs).
DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64", "bool")
#: With ``on_error="skip"`` a server-preprocessed sample starts with this status word: 0 and the
#: sample, or 1, the length and the UTF-8 reason it failed (so a failure travels with its bytes).
_STATUS = struct.Struct("<II")
STATUS = _STATUS.size
MAX_STAGES = 64
MAX_PARAMS = 64 * 1024
TORCHVISION = "torchvision.transforms"
#: The torchvision transforms that draw random numbers, named here so that telling whether a stage
#: is random imports no torch (a server's own process never imports a pipeline's libraries).
TORCHVISION_RANDOM = frozenset({"RandomResizedCrop", "RandomHorizontalFlip"})
_USER_OP = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class Output:
    """What a stage produces, as the receive ring holds it.

    Attributes:
        shape: a fixed shape (every sample exactly this); empty when ``max_bytes`` is given.
        dtype: the element type, one of :data:`DTYPES`.
        max_bytes: a variable shape of at most this many bytes; each sample then starts with a
            :data:`HEADER`-byte header giving its real shape.
        kind: what the next stage receives: ``array`` (numpy), ``pil`` (a PIL image, from an HWC
            or HW uint8 array) or ``tensor`` (torch).

    Raises:
        ConfigError: neither or both of ``shape`` and ``max_bytes``, a bad dtype or kind.
    """

    shape: tuple[int, ...] = ()
    dtype: str = "uint8"
    max_bytes: int = 0
    kind: str = "array"

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        object.__setattr__(self, "shape", shape)
        if bool(shape) == bool(self.max_bytes):
            raise ConfigError(
                f"an output declares either a fixed shape or max_bytes, got shape={shape} max_bytes={self.max_bytes}",
                field="output",
                value=(shape, self.max_bytes),
            )
        if len(shape) > MAX_DIMS or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
            raise ConfigError(
                f"output shape {shape} must be 1-{MAX_DIMS} positive integers", field="output.shape", value=shape
            )
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 0:
            raise ConfigError(
                f"output max_bytes {self.max_bytes!r} must be a positive integer",
                field="output.max_bytes",
                value=self.max_bytes,
            )
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"output dtype {self.dtype!r} is not one of {', '.join(DTYPES)}", field="output.dtype", value=self.dtype
            )
        if self.kind not in KINDS:
            raise ConfigError(
                f"output kind {self.kind!r} is not one of {', '.join(KINDS)}", field="output.kind", value=self.kind
            )
        if self.nbytes >= 1 << 32:
            raise ConfigError(f"output of {self.nbytes} bytes is larger than 4 GiB", field="output", value=shape)

    @property
    def nbytes(self) -> int:
        """Bytes one sample takes in the ring (with its header, for a variable shape)."""
        if self.shape:
            return math.prod(self.shape) * np.dtype(self.dtype).itemsize
        return HEADER + self.max_bytes

    def check(self, array: np.ndarray) -> str:
        """Why ``array`` does not match this declaration, or ``""``."""
        return self._mismatch(tuple(array.shape), array.dtype)

    def _mismatch(self, shape: tuple[int, ...], dtype: np.dtype) -> str:
        if dtype != np.dtype(self.dtype):
            return f"dtype {dtype} where {self.dtype} is declared"
        if self.shape and shape != self.shape:
            return f"shape {shape} where {self.shape} is declared"
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.shape and (nbytes > self.max_bytes or len(shape) > MAX_DIMS):
            return f"{nbytes} bytes in {len(shape)} dimensions where at most {self.max_bytes} bytes are declared"
        return ""

    def encode(self, array: np.ndarray, out: np.ndarray) -> int:
        """Write ``array`` (checked first) into ``out`` (uint8, at least :attr:`nbytes`); returns bytes written.

        Raises:
            ValueError: ``array`` does not match the declaration (the message says how).
        """
        place = self.place(tuple(array.shape), array.dtype, out)
        place[:] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        return self.written(place)

    def place(self, shape: tuple[int, ...], dtype: np.dtype, out: np.ndarray) -> np.ndarray:
        """Where in ``out`` the bytes of an array of ``shape`` and ``dtype`` go (checked first), for a
        stage that writes its result there itself: a uint8 view of ``out``, after the header (written
        here) of a variable shape; :meth:`written` tells the bytes written once it is filled.

        Raises:
            ValueError: such an array does not match the declaration (the message says how).
        """
        dtype = np.dtype(dtype)
        why = self._mismatch(shape, dtype)
        if why:
            raise ValueError(why)
        nbytes = math.prod(shape) * dtype.itemsize
        if self.shape:
            return out[:nbytes]
        dims = [*shape, *([0] * (MAX_DIMS - len(shape)))]
        out[:HEADER] = np.frombuffer(_HEADER.pack(nbytes, DTYPES.index(self.dtype), len(shape), *dims), dtype=np.uint8)
        return out[HEADER : HEADER + nbytes]

    def written(self, place: np.ndarray) -> int:
        """The bytes a sample takes in ``out`` once its :meth:`place` is filled (with its header, if any)."""
        return place.nbytes + (0 if self.shape else HEADER)

    def decode(self, data: np.ndarray) -> np.ndarray:
        """The array a sample's ring bytes hold (a view of ``data``, uint8).

        Raises:
            ValueError: a variable sample's header is inconsistent.
        """
        if self.shape:
            return data[: self.nbytes].view(np.dtype(self.dtype)).reshape(self.shape)
        size, code, ndim, *dims = _HEADER.unpack(data[:HEADER].tobytes())
        shape = tuple(dims[:ndim])
        dtype = np.dtype(DTYPES[code]) if code < len(DTYPES) else None
        if dtype is None or ndim > MAX_DIMS or size > self.max_bytes or math.prod(shape) * dtype.itemsize != size:
            raise ValueError(f"bad sample header (size {size}, dtype code {code}, shape {shape})")
        return data[HEADER : HEADER + size].view(dtype).reshape(shape)

    def to_proto(self):
        from kspeed.proto import kspeed_pb2

        return kspeed_pb2.TensorSpec(shape=list(self.shape), dtype=self.dtype, max_bytes=self.max_bytes, kind=self.kind)

    @classmethod
    def from_proto(cls, message) -> Output:
        return cls(tuple(message.shape), message.dtype or "uint8", message.max_bytes, message.kind or "array")


def write_status(out: np.ndarray, failure: str = "") -> None:
    """Write a sample's status word at the start of ``out`` (and the reason, when it failed)."""
    text = failure.encode()[: max(len(out) - STATUS, 0)]
    out[:STATUS] = np.frombuffer(_STATUS.pack(1 if failure else 0, len(text)), dtype=np.uint8)
    if text:
        out[STATUS : STATUS + len(text)] = np.frombuffer(text, dtype=np.uint8)


def read_status(data: np.ndarray) -> str:
    """The reason a sample with a status word failed, or ``""``."""
    failed, length = _STATUS.unpack(data[:STATUS].tobytes())
    return bytes(data[STATUS : STATUS + length]).decode(errors="replace") if failed else ""


def _canonical(params: Mapping[str, Any], op: str) -> str:
    try:
        text = json.dumps(params, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"parameters of stage {op!r} are not JSON data ({exc}); a pipeline is sent as data, never pickled",
            field=f"{op}.params",
            value=params,
        ) from exc
    if len(text) > MAX_PARAMS:
        raise ConfigError(f"parameters of stage {op!r} exceed {MAX_PARAMS} bytes of JSON", field=f"{op}.params")
    return text


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a pipeline.

    Attributes:
        op: a built-in op (``"random_resized_crop"``), ``"torchvision.transforms:<Class>"`` or a
            user function ``"pkg.module:function"`` (imported by a server only if its operator
            allows the module).
        params: the op's keyword parameters, JSON data.
        place: ``server``, ``client`` or ``gpu``.
        output: what the stage produces; required on the last ``server`` stage.

    Raises:
        ConfigError: a malformed op name, parameters that are not JSON data or that a built-in op
            does not take, an unknown place.
    """

    op: str
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    place: str = "server"
    output: Output | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or not self.op:
            raise ConfigError(f"stage op must be a non-empty string, got {self.op!r}", field="op", value=self.op)
        if not isinstance(self.params, Mapping):
            raise ConfigError(f"parameters of stage {self.op!r} must be a mapping", field=f"{self.op}.params")
        object.__setattr__(self, "params", json.loads(_canonical(self.params, self.op)))
        if self.place not in PLACES:
            raise ConfigError(
                f"stage {self.op!r}: place {self.place!r} is not one of {', '.join(PLACES)}",
                field=f"{self.op}.place",
                value=self.place,
            )
        if ":" in self.op:
            if not _USER_OP.match(self.op):
                raise ConfigError(f"stage op {self.op!r} is not 'package.module:function'", field="op", value=self.op)
        else:
            from kspeed.preprocess import ops

            ops.get(self.op)
            ops.check_params(self.op, self.params)

    @property
    def params_json(self) -> str:
        """The parameters as canonical JSON (sorted keys, compact): how they travel."""
        return _canonical(self.params, self.op)

    @property
    def module(self) -> str:
        """The module a server must import (``""`` for a built-in op)."""
        return self.op.split(":", 1)[0] if ":" in self.op else ""

    @property
    def random(self) -> bool:
        """Whether the stage may differ between epochs: a random built-in op or torchvision
        transform, and every user function (nothing says whether it draws from its generator)."""
        if not self.module:
            from kspeed.preprocess import ops

            return ops.get(self.op).random
        if self.module in (TORCHVISION, f"{TORCHVISION}.v2"):
            return self.op.partition(":")[2] in TORCHVISION_RANDOM
        return True


class Pipeline:
    """An ordered list of stages (see the module docstring).

    Args:
        stages: the stages, ``server`` ones first, then ``client``, then ``gpu``.

    Raises:
        ConfigError: places out of order, no stages or too many, or a last ``server`` stage
            without a declared output.
    """

    def __init__(self, stages: Iterable[Stage]) -> None:
        self.stages: tuple[Stage, ...] = tuple(stages)
        if not self.stages or len(self.stages) > MAX_STAGES:
            raise ConfigError(f"a pipeline has 1-{MAX_STAGES} stages, got {len(self.stages)}", field="pipeline")
        for k, stage in enumerate(self.stages):
            if not isinstance(stage, Stage):
                raise ConfigError(f"pipeline stage {k} is a {type(stage).__name__}, not a Stage", field="pipeline")
        order = [PLACES.index(s.place) for s in self.stages]
        if order != sorted(order):
            places = ", ".join(f"{k}:{s.op}@{s.place}" for k, s in enumerate(self.stages))
            raise ConfigError(
                f"pipeline stages must be placed server first, then client, then gpu; got {places}",
                field="pipeline.place",
            )
        self.server_stages = sum(s.place == "server" for s in self.stages)
        self.gpu_from = next((k for k, s in enumerate(self.stages) if s.place == "gpu"), len(self.stages))
        if self.server_stages and self.stages[self.server_stages - 1].output is None:
            stage = self.stages[self.server_stages - 1]
            raise ConfigError(
                f"stage {self.server_stages - 1} ({stage.op}) is the last one on the servers and declares no "
                "output: give it output=Output(shape=..., dtype=...) or Output(max_bytes=...)",
                field="pipeline.output",
            )

    def output(self, stages: int) -> Output:
        """The declared output after the first ``stages`` stages.

        Raises:
            ConfigError: that stage declares none.
        """
        stage = self.stages[stages - 1]
        if stage.output is None:
            raise ConfigError(
                f"stage {stages - 1} ({stage.op}) declares no output, so the pipeline cannot be cut after it",
                field="pipeline.output",
            )
        return stage.output

    def cached_stages(self, cache: str) -> int:
        """How many leading stages a dataset with this ``cache`` keeps applied in its servers' memory.

        With ``cache="preprocessed"``: the longest run of leading stages that are not random
        (:attr:`Stage.random`) and end at a stage that declares its output (that declaration is
        how the cached samples are stored and read back); 0 with ``cache=""``.

        Raises:
            ConfigError: an unknown ``cache``, or ``"preprocessed"`` with no such run (named).
        """
        if cache not in CACHES:
            raise ConfigError(f"cache {cache!r} is not one of '', 'preprocessed'", field="cache", value=cache)
        if not cache:
            return 0
        cached = 0
        for k, stage in enumerate(self.stages):
            if stage.random:
                break
            if stage.output is not None:
                cached = k + 1
        if not cached:
            first = self.stages[0]
            why = (
                f"its first stage ({first.op}) is random"
                if first.random
                else "no stage before the first random one declares its output"
            )
            raise ConfigError(
                f"cache='preprocessed' keeps samples after the pipeline's deterministic leading stages, but {why}; "
                "declare the output of the last deterministic stage (output=Output(...)) or use cache=''",
                field="cache",
                value=cache,
            )
        return cached

    def to_proto(self):
        """The pipeline as the dataset's identity carries it (places are the client's choice, not sent)."""
        from kspeed.proto import kspeed_pb2

        return kspeed_pb2.Pipeline(
            stages=[
                kspeed_pb2.Stage(
                    op=s.op, params=s.params_json, output=s.output.to_proto() if s.output is not None else None
                )
                for s in self.stages
            ]
        )

    @classmethod
    def from_proto(cls, message, server_stages: int | None = None) -> Pipeline:
        """A pipeline received as data; the first ``server_stages`` stages are placed on the servers
        (default: every stage up to the last that declares its output), the rest on the client.

        Raises:
            ConfigError: malformed stages or parameters (named).
        """
        stages = []
        if server_stages is None:
            declared = [k for k, stage in enumerate(message.stages) if stage.HasField("output")]
            server_stages = declared[-1] + 1 if declared else 0
        count = server_stages
        for k, stage in enumerate(message.stages):
            try:
                params = json.loads(stage.params or "{}")
            except ValueError as exc:
                raise ConfigError(f"stage {k} ({stage.op}): parameters are not JSON: {exc}", field="pipeline") from exc
            if not isinstance(params, dict):
                raise ConfigError(f"stage {k} ({stage.op}): parameters are not a JSON object", field="pipeline")
            output = Output.from_proto(stage.output) if stage.HasField("output") else None
            stages.append(Stage(stage.op, params, "server" if k < count else "client", output))
        return cls(stages)

    def digest(self) -> str:
        """A hash of the stages and outputs (the pipeline's identity)."""
        return hashlib.sha256(self.to_proto().SerializeToString(deterministic=True)).hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pipeline) and self.stages == other.stages

    def __repr__(self) -> str:
        return "Pipeline([" + ", ".join(f"{s.op}@{s.place}" for s in self.stages) + "])"
