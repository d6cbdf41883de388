"""The registry of built-in preprocessing ops that pipelines name, and the checking of their parameters.

A pipeline stage is an op name and its parameters as JSON data (lists, numbers, strings). The
pipeline looks the op up with :func:`get`, checks the parameters with :func:`check_params` before
any sample is read, then runs it per sample with :func:`apply`, handing random ops the stage's
generator (see :mod:`kspeed.preprocess.rng`).
"""

from __future__ import annotations

import functools
import inspect
import math
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, TypeGuard

import numpy as np

from kspeed.errors import ConfigError
from kspeed.preprocess import audio, image, jpeg_region, tensor, volume

__all__ = ["OPS", "Op", "apply", "check_params", "get"]


@dataclass(frozen=True)
class Op:
    """A built-in op.

    Attributes:
        name: the name pipelines use.
        fn: the function; its keyword-only parameters are the op's parameters.
        random: ``fn`` takes the stage's ``np.random.Generator`` as its second positional argument.
        takes_bytes: ``fn``'s input is a sample's raw bytes (a decoder).
    """

    name: str
    fn: Callable[..., Any]
    random: bool
    takes_bytes: bool


def _op(fn: Callable[..., Any], *, random: bool = False, takes_bytes: bool = False) -> Op:
    return Op(fn.__name__, fn, random, takes_bytes)


OPS: Mapping[str, Op] = types.MappingProxyType(
    {
        op.name: op
        for op in (
            _op(image.decode_image, takes_bytes=True),
            _op(image.resize),
            _op(image.center_crop),
            _op(image.random_resized_crop, random=True),
            _op(jpeg_region.decode_random_resized_crop, random=True, takes_bytes=True),
            _op(image.flip, random=True),
            _op(image.to_chw),
            _op(tensor.cast),
            _op(tensor.normalize),
            _op(tensor.npy, takes_bytes=True),
            _op(audio.wav, takes_bytes=True),
            _op(audio.resample),
            _op(volume.log1p),
            _op(volume.random_crop_3d, random=True),
            _op(volume.flip_3d, random=True),
        )
    }
)
"""The built-in ops by name."""


def get(name: str) -> Op:
    """The op called ``name``.

    Raises:
        ConfigError: no op has that name; the message lists the known ones.
    """
    try:
        return OPS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown op {name!r}; known ops: {', '.join(sorted(OPS))}", value=name) from None


def check_params(name: str, params: Mapping[str, object]) -> None:
    """Check an op's parameters before anything runs.

    Names are bound against the op's keyword-only parameters (unknown and missing ones are
    errors), then values are checked for what can be known without data: sizes positive integers
    of the right length, interpolation, dtype and layout names known, probabilities in ``[0, 1]``,
    ``mean`` and ``std`` of equal lengths with no zero ``std``, and the like.

    Raises:
        ConfigError: naming the op and the parameter, with ``field="<op>.<param>"`` and the value.
    """
    allowed = _keyword_params(get(name))
    for pname, value in params.items():
        if pname not in allowed:
            known = ", ".join(allowed) or "none"
            raise ConfigError(
                f"op {name!r} has no parameter {pname!r}; its parameters: {known}", field=f"{name}.{pname}", value=value
            )
    for pname, p in allowed.items():
        if p.default is inspect.Parameter.empty and pname not in params:
            raise ConfigError(f"op {name!r} needs parameter {pname!r}", field=f"{name}.{pname}")
    checks = _CHECKS.get(name, {})
    for pname, value in params.items():
        if pname in checks:
            problem = checks[pname](value)
            if problem is not None:
                _fail(name, pname, value, problem)
    if name in _CROSS_CHECKS:
        _CROSS_CHECKS[name]({**{k: p.default for k, p in allowed.items()}, **params})


@functools.cache
def _keyword_params(op: Op) -> dict[str, inspect.Parameter]:
    """The op's parameters: the keyword-only parameters of its function."""
    parameters = inspect.signature(op.fn).parameters.items()
    return {name: p for name, p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def apply(op: Op, x: Any, rng: np.random.Generator | None, params: Mapping[str, object]) -> Any:
    """Run ``op`` on ``x``: ``fn(x, rng, **params)`` for a random op, ``fn(x, **params)`` otherwise.

    Raises:
        ValueError: a random op was given no generator (and whatever the op raises on bad input).
    """
    if op.random:
        if rng is None:
            raise ValueError(f"op {op.name!r} is random and needs the stage's generator")
        return op.fn(x, rng, **params)
    return op.fn(x, **params)


# Value checks: each returns what is wrong with a value, or None.
_Check = Callable[[object], str | None]


def _fail(name: str, param: str, value: object, problem: str) -> NoReturn:
    raise ConfigError(
        f"op {name!r}: parameter {param!r} {problem}, got {value!r}", field=f"{name}.{param}", value=value
    )


def _is_int(value: object) -> TypeGuard[int | np.integer]:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float | np.integer | np.floating]:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _positive_int(value: object) -> str | None:
    return None if _is_int(value) and int(value) > 0 else "must be a positive integer"


def _optional_positive_int(value: object) -> str | None:
    return None if value is None else _positive_int(value)


def _size(*lengths: int, scalar: bool = True) -> _Check:
    """A size: a positive int (when ``scalar``) or a list of positive ints of one of ``lengths``."""
    counts = " or ".join(str(n) for n in lengths)
    problem = f"must be {'a positive integer or ' if scalar else ''}a list of {counts} positive integers"

    def check(value: object) -> str | None:
        if _is_int(value):
            return None if scalar and int(value) > 0 else problem
        if isinstance(value, (list, tuple)) and len(value) in lengths and all(_positive_int(v) is None for v in value):
            return None
        return problem

    return check


def _choice(known: Mapping[str, object] | tuple[str, ...]) -> _Check:
    def check(value: object) -> str | None:
        return None if isinstance(value, str) and value in known else f"must be one of {', '.join(known)}"

    return check


def _bool(value: object) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _probability(value: object) -> str | None:
    return None if _is_number(value) and 0.0 <= float(value) <= 1.0 else "must be a number in [0, 1]"


def _interval(value: object) -> str | None:
    problem = "must be [low, high] with 0 < low <= high"
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_number(v) for v in value)):
        return problem
    low, high = float(value[0]), float(value[1])
    return None if 0.0 < low <= high and math.isfinite(high) else problem


def _numbers(value: object) -> list[float] | None:
    """``value`` as a non-empty list of finite floats (a single number counts), or None."""
    values = value if isinstance(value, (list, tuple)) else [value]
    numbers = [float(v) for v in values if _is_number(v)]
    if not numbers or len(numbers) != len(values) or not all(map(math.isfinite, numbers)):
        return None
    return numbers


def _means(value: object) -> str | None:
    return None if _numbers(value) is not None else "must be a number or a non-empty list of finite numbers"


def _stds(value: object) -> str | None:
    numbers = _numbers(value)
    if numbers is None:
        return "must be a number or a non-empty list of finite numbers"
    return None if all(numbers) else "must not contain 0"


def _axes(value: object) -> str | None:
    ok = isinstance(value, (list, tuple)) and value and all(map(_is_int, value)) and len(set(value)) == len(value)
    return None if ok else "must be a non-empty list of distinct integer axes"


def _check_resize(params: Mapping[str, object]) -> None:
    size, max_size = params["size"], params["max_size"]
    if not _is_int(max_size):
        return
    if isinstance(size, (list, tuple)) and len(size) == 2:
        _fail("resize", "max_size", max_size, "applies only when size is the shorter side (an int or [s])")
    short = size[0] if isinstance(size, (list, tuple)) else size
    if _is_int(short) and int(max_size) <= int(short):
        _fail("resize", "max_size", max_size, f"must be greater than the shorter side size {short}")


def _check_normalize(params: Mapping[str, object]) -> None:
    means, stds = _numbers(params["mean"]) or [], _numbers(params["std"]) or []
    if len(means) != len(stds) and 1 not in (len(means), len(stds)):
        _fail("normalize", "std", params["std"], f"must have as many values as mean ({len(means)})")


_CHECKS: dict[str, dict[str, _Check]] = {
    "decode_image": {"mode": _choice(image.MODES)},
    "resize": {
        "size": _size(1, 2),
        "interpolation": _choice(image.INTERPOLATIONS),
        "antialias": _bool,
        "max_size": _optional_positive_int,
    },
    "center_crop": {"size": _size(1, 2)},
    "random_resized_crop": {
        "size": _size(1, 2),
        "scale": _interval,
        "ratio": _interval,
        "interpolation": _choice(image.INTERPOLATIONS),
        "antialias": _bool,
    },
    "decode_random_resized_crop": {
        "size": _size(1, 2),
        "scale": _interval,
        "ratio": _interval,
        "interpolation": _choice(image.INTERPOLATIONS),
    },
    "flip": {"p": _probability, "layout": _choice(image.LAYOUTS)},
    "cast": {"dtype": _choice(tensor.DTYPES), "scale": _bool},
    "normalize": {"mean": _means, "std": _stds, "layout": _choice(tensor.NORMALIZE_LAYOUTS)},
    "resample": {"orig_rate": _positive_int, "new_rate": _positive_int},
    "random_crop_3d": {"size": _size(3, scalar=False)},
    "flip_3d": {"p": _probability, "axes": _axes},
}

# Checks of parameters against each other, run after each value passed its own check.
_CROSS_CHECKS: dict[str, Callable[[Mapping[str, object]], None]] = {
    "decode_random_resized_crop": lambda params: jpeg_region.require(),
    "resize": _check_resize,
    "normalize": _check_normalize,
}
