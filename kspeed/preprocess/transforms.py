"""Torchvision transforms sent as data, re-created on another host and seeded per sample.

A dataset's transform is never pickled. :func:`describe` turns it into stages ``(op, params)``: ``op``
names the class (``"torchvision.transforms:Resize"``, or ``"torchvision.transforms.v2:Resize"`` for the
v2 class, whose kernels differ) and ``params`` holds, as JSON data, every constructor parameter that
changes what it does, defaults included, so that the receiver's own defaults never matter. :func:`build`
re-creates the transform from a stage. Only the classes in :data:`SENDABLE` travel, matched by exact
type (a subclass may override anything); any other transform runs on the client.

Random stages draw from torch's global generator, so :func:`apply` seeds it (with
:func:`kspeed.preprocess.rng.torch_seed`) right before the stage: a client and a server that apply the
same stage to the same sample with the same seed crop and flip alike. :func:`produces` and
:func:`default_cut` tell, without running anything, what each stage yields and how many leading stages
are worth running remotely; :func:`to_array` and :func:`from_array` carry a stage's output across.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torchvision.transforms as v1  # type: ignore[import-untyped]
import torchvision.transforms.v2 as v2  # type: ignore[import-untyped]
from PIL import Image
from torchvision.transforms import InterpolationMode

from kspeed.errors import ConfigError, PreprocessError
from kspeed.preprocess.pipeline import TORCHVISION_RANDOM

__all__ = [
    "SENDABLE",
    "Produces",
    "apply",
    "build",
    "default_cut",
    "describe",
    "from_array",
    "is_random",
    "produces",
    "to_array",
]

# Constructor parameters that change behaviour, per class; each is also the attribute that holds it.
_PARAMS: dict[str, tuple[str, ...]] = {
    "Resize": ("size", "interpolation", "max_size", "antialias"),
    "CenterCrop": ("size",),
    "RandomResizedCrop": ("size", "scale", "ratio", "interpolation", "antialias"),
    "RandomHorizontalFlip": ("p",),
    "PILToTensor": (),
    "ToTensor": (),
    "ConvertImageDtype": ("dtype",),
    "Normalize": ("mean", "std", "inplace"),
}
_RANDOM = TORCHVISION_RANDOM
_MODULES = {"torchvision.transforms": v1, "torchvision.transforms.v2": v2}
_CLASSES: dict[str, type] = {f"{ns}:{name}": getattr(mod, name) for ns, mod in _MODULES.items() for name in _PARAMS}
_OPS: dict[type, str] = {cls: op for op, cls in _CLASSES.items()}
_COMPOSES: tuple[type, ...] = (v1.Compose, v2.Compose)  # flattened into their members, never sent

SENDABLE: tuple[str, ...] = tuple(_CLASSES)
"""The ops :func:`build` accepts; a ``Compose`` of them (nested or not) is sent as its members."""

_PIL_MODES = ("RGB", "L", "RGBA")  # modes whose pixels round-trip exactly through a uint8 array


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{value!r} is not an integer")
    return int(value)


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    return float(value)  # a float is a double: JSON keeps it exactly


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not true or false")
    return value


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else check(value)


def _floats(value: Any, length: int | None = None) -> list[float]:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        value = value.tolist()
    if length is None and isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = [value]  # Normalize(0.5, 0.5) broadcasts exactly as Normalize([0.5], [0.5])
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{value!r} is not a sequence of numbers")
    if length is not None and len(value) != length:
        raise ValueError(f"{value!r} does not hold {length} numbers")
    return [_float(item) for item in value]


def _size(value: Any) -> int | list[int] | None:
    # An int stays an int: Resize(256) fixes the shorter side, Resize([256, 256]) both sides.
    if value is None or isinstance(value, numbers.Integral):
        return None if value is None else _int(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{value!r} is not a size (an integer or a sequence of integers)")
    return [_int(item) for item in value]


def _interpolation(value: Any) -> str:
    if isinstance(value, InterpolationMode):
        return str(value.value)
    if isinstance(value, str) and value in {mode.value for mode in InterpolationMode}:
        return value  # v2 keeps the string it was given
    if isinstance(value, int) and not isinstance(value, bool) and value in set(Image.Resampling):
        return Image.Resampling(value).name.lower()  # v2 keeps a Pillow constant; v1 converts it alike
    raise ValueError(f"{value!r} is not an InterpolationMode")


def _dtype_name(value: Any) -> str:
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{value!r} is not a torch.dtype")
    return str(value).removeprefix("torch.")


def _dtype(value: Any) -> torch.dtype:
    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{value!r} is not the name of a torch dtype (e.g. 'float32')")
    return dtype


# Per parameter: (attribute value -> JSON data, JSON data -> constructor argument). Each raises
# ValueError saying what is wrong with the value.
_CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "size": (_size, _size),
    "interpolation": (_interpolation, lambda value: InterpolationMode(_interpolation(value))),
    "max_size": (_optional(_int), _optional(_int)),
    "antialias": (_optional(_bool), _optional(_bool)),
    "scale": (lambda value: _floats(value, 2), lambda value: _floats(value, 2)),
    "ratio": (lambda value: _floats(value, 2), lambda value: _floats(value, 2)),
    "p": (_float, _float),
    "dtype": (_dtype_name, _dtype),
    "mean": (_floats, _floats),
    "std": (_floats, _floats),
    "inplace": (_bool, _bool),
}


def _label(member: object) -> str:
    return getattr(member, "__qualname__", "?") if inspect.isroutine(member) else type(member).__name__


def _members(transform: object, path: str = "") -> Iterator[tuple[str, object]]:
    """Yield ``(path, member)`` for every leaf of ``transform``; a path is ``"3"``, or ``"1.2"`` when nested."""
    if type(transform) not in _COMPOSES:
        yield path or "0", transform
        return
    for index, member in enumerate(transform.transforms):  # type: ignore[attr-defined]
        yield from _members(member, f"{path}.{index}" if path else str(index))


def describe(transform: object) -> list[tuple[str, dict[str, Any]]]:
    """The stages that re-create ``transform``, in order; a ``Compose`` is flattened, nested ones too.

    Raises:
        ConfigError: a member is not one of :data:`SENDABLE` (a subclass neither), or one of its
            parameters cannot be expressed as JSON data; the message names the member and its index.
    """
    stages: list[tuple[str, dict[str, Any]]] = []
    for path, member in _members(transform):
        label = _label(member)
        op = _OPS.get(type(member))
        if op is None:
            base = next((name for cls, name in _OPS.items() if isinstance(member, cls)), None)
            why = f" (a subclass of {base}, which may do anything)" if base else ""
            raise ConfigError(
                f"transform {path} ({label}) is not one KSpeed can send as data{why}; it runs on the client",
                field="transform",
                value=label,
            )
        params: dict[str, Any] = {}
        for name in _PARAMS[op.partition(":")[2]]:
            try:
                params[name] = _CODECS[name][0](getattr(member, name))
            except (ValueError, AttributeError) as exc:  # AttributeError: a torchvision that stores it elsewhere
                raise ConfigError(
                    f"transform {path} ({label}) has a {name} that KSpeed cannot send as data: {exc}; "
                    "it runs on the client",
                    field=f"transform.{name}",
                    value=getattr(member, name, None),
                ) from exc
        stages.append((op, params))
    return stages


def _class_name(op: str) -> str:
    if op not in _CLASSES:
        raise ConfigError(f"unknown transform op {op!r}; KSpeed knows {', '.join(SENDABLE)}", field="op", value=op)
    return op.partition(":")[2]


def build(op: str, params: Mapping[str, object]) -> Callable[[Any], Any]:
    """Re-create the transform of a stage, e.g. ``("torchvision.transforms:Resize", {"size": 256})``.

    A parameter left out takes the installed torchvision's default.

    Raises:
        ConfigError: ``op`` is unknown, or a parameter is unknown or has a bad value (both named).
    """
    name = _class_name(op)
    if not isinstance(params, Mapping):
        raise ConfigError(f"the params of {op} must be a mapping, not {params!r}", field="params", value=params)
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        if key not in _PARAMS[name]:
            raise ConfigError(
                f"{op} has no parameter {key!r}; it takes {list(_PARAMS[name])}", field=f"params.{key}", value=value
            )
        try:
            kwargs[key] = _CODECS[key][1](value)
        except ValueError as exc:
            raise ConfigError(f"{op} parameter {key!r}: {exc}", field=f"params.{key}", value=value) from exc
    try:
        return _CLASSES[op](**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{op} cannot be built from {dict(params)}: {exc}", field="params", value=params) from exc


def is_random(op: str) -> bool:
    """Whether the stage draws random numbers, and so needs a seed in :func:`apply`."""
    return _class_name(op) in _RANDOM


def apply(fn: Callable[[Any], Any], value: Any, seed: int | None) -> Any:
    """Apply a transform made by :func:`build`; with a seed, draw its random numbers from that seed.

    Torchvision's random transforms draw from torch's global CPU generator, so it is seeded right
    before the call (as ``torch.manual_seed(seed)`` seeds it; that call also seeds every accelerator
    and costs about a hundred times more) and its previous state is put back afterwards, so the
    caller's own random stream does not depend on which stages ran. Not thread-safe (the generator is
    global): run stages one at a time.

    Args:
        fn: the transform.
        value: its input.
        seed: from :func:`kspeed.preprocess.rng.torch_seed`, for a stage that :func:`is_random`; else None.
    """
    if seed is None:
        return fn(value)
    generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(seed)
    try:
        return fn(value)
    finally:
        generator.set_state(state)


@dataclass(frozen=True)
class Produces:
    """What a stage yields, known before it runs.

    Attributes:
        kind: ``"pil"`` (a PIL image) or ``"tensor"``.
        dtype: its element type by torch's name, ``"uint8"`` or ``"float32"`` mostly; a PIL image is uint8.
        size: its ``(height, width)`` if every sample has it after this stage, None if it depends on the input.
    """

    kind: str
    dtype: str
    size: tuple[int, int] | None

    def __post_init__(self) -> None:
        if self.kind not in ("pil", "tensor"):
            raise ConfigError(f"unknown kind {self.kind!r}; expected 'pil' or 'tensor'", field="kind", value=self.kind)
        try:
            _dtype(self.dtype)
        except ValueError as exc:
            raise ConfigError(f"unknown dtype: {exc}", field="dtype", value=self.dtype) from exc


def produces(op: str, params: Mapping[str, object], before: Produces) -> Produces:
    """What stage ``(op, params)`` yields when it receives ``before``.

    Raises:
        ConfigError: the stage is invalid, or cannot take ``before`` (e.g. Normalize on uint8).
    """
    fn: Any = build(op, params)
    name = _class_name(op)
    if name == "RandomHorizontalFlip":
        return before
    if name in ("Resize", "CenterCrop", "RandomResizedCrop"):
        # The crops always hold (height, width); Resize's int or 1-sequence fixes only the shorter side.
        fixed = isinstance(fn.size, Sequence) and len(fn.size) == 2
        return replace(before, size=(int(fn.size[0]), int(fn.size[1])) if fixed else None)
    wants = "pil" if name in ("PILToTensor", "ToTensor") else "tensor"
    if before.kind != wants:
        if op.startswith("torchvision.transforms.v2:") and name != "Normalize":
            return before  # v2 passes through an input its kernel does not take
        raise ConfigError(f"{op} needs a {wants} but receives a {before.kind}", field="op", value=op)
    if name == "Normalize":
        if not _dtype(before.dtype).is_floating_point:
            raise ConfigError(
                f"{op} needs a float tensor but receives {before.dtype}; put ToTensor or ConvertImageDtype first",
                field="op",
                value=op,
            )
        return before
    dtype = {"PILToTensor": "uint8", "ToTensor": "float32"}.get(name) or _dtype_name(fn.dtype)
    return Produces("tensor", dtype, before.size)


def default_cut(stages: Sequence[tuple[str, Mapping[str, object]]], start: Produces) -> int:
    """How many leading stages run on the servers by default.

    All stages up to and including the last one whose output is uint8: a float stage (ToTensor,
    Normalize) sends four times the bytes of its input, so it and what follows stay on the client.
    """
    cut, state = 0, start
    for index, (op, params) in enumerate(stages):
        state = produces(op, params, state)
        if state.dtype == "uint8":
            cut = index + 1
    return cut


def to_array(value: Any) -> np.ndarray:
    """A stage's output as a C-contiguous array: HWC uint8 for a PIL image (HW for mode "L"), a tensor's own.

    Raises:
        PreprocessError: the value is neither a PIL image of mode RGB, L or RGBA nor a tensor numpy can hold.
    """
    if isinstance(value, Image.Image):
        if value.mode not in _PIL_MODES:
            raise PreprocessError(f"a PIL image of mode {value.mode!r} cannot be sent; convert it to RGB or L first")
        return np.ascontiguousarray(np.asarray(value))
    if isinstance(value, torch.Tensor):
        try:
            return np.ascontiguousarray(value.detach().cpu().numpy())
        except (TypeError, RuntimeError) as exc:
            raise PreprocessError(f"a {value.dtype} tensor cannot be sent as an array: {exc}") from exc
    raise PreprocessError(f"a {type(value).__name__} cannot be sent; a stage must yield a PIL image or a tensor")


def from_array(array: np.ndarray, kind: str) -> Any:
    """The inverse of :func:`to_array`: a PIL image (``kind="pil"``) or a tensor sharing the array's memory.

    A read-only array is copied first, as torch cannot hold one.

    Raises:
        ConfigError: ``kind`` is neither "pil" nor "tensor".
        PreprocessError: the array is not a uint8 image (HW, or HWC with 3 or 4 channels) for "pil".
    """
    if kind == "pil":
        if array.dtype != np.uint8 or not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
            raise PreprocessError(f"a {array.dtype} array of shape {array.shape} is not an RGB, RGBA or L image")
        return Image.fromarray(array)
    if kind == "tensor":
        return torch.from_numpy(array if array.flags.writeable else array.copy())
    raise ConfigError(f"unknown kind {kind!r}; expected 'pil' or 'tensor'", field="kind", value=kind)
