"""Running a pipeline's stages on a sample, identically in every process that runs them.

A :class:`Runner` resolves each stage once (a built-in op, a torchvision transform re-created from
its parameters, or a user function imported by path if the caller's allow-list admits its module)
and then runs any contiguous range of stages on one sample. Every random stage draws from a
generator seeded by ``(seed, epoch, sample, stage index)`` (:mod:`kspeed.preprocess.rng`), so the
client, a server or a 50/50 split of them produce the same augmentation. torchvision transforms
draw from torch's global generator; they are seeded right before each call, so a runner must only
be used where nothing else draws from it concurrently (a single-threaded worker process).

Values flow as the ops want them: decoders take the sample's bytes, built-in ops numpy arrays,
torchvision transforms PIL images or tensors (an HWC uint8 array becomes a PIL image before one);
at a cut between places a value is written as the stage's declared :class:`~kspeed.preprocess.pipeline.Output`.
A ``PILToTensor`` stage at such a cut writes the planes of the PIL image it receives there itself
(:meth:`Runner.produce`): the same bytes, without the tensor, its transposing copy and the copy out.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kspeed.errors import AccessDeniedError, ConfigError, PreprocessError
from kspeed.preprocess import image, jpeg_region, ops, rng
from kspeed.preprocess.pipeline import TORCHVISION, Output, Pipeline, Stage

__all__ = ["Runner", "allowed", "check_allowed", "to_array"]


def allowed(module: str, rules: Sequence[str]) -> bool:
    """Whether ``module`` is one of ``rules`` or inside a package that one of them names."""
    return any(module == rule or module.startswith(rule + ".") for rule in rules)


def check_allowed(
    pipeline: Pipeline, allow: Sequence[str] | None, *, dataset: str = "", stages: int | None = None
) -> None:
    """Refuse a pipeline whose first ``stages`` stages name a module ``allow`` does not admit, importing
    nothing (a server's own process checks this; its preprocessing workers import the modules).

    Raises:
        AccessDeniedError: a stage's module is not allowed (the message names it and the rule).
    """
    for index, stage in enumerate(pipeline.stages[:stages]):
        _check_allowed(index, stage, allow, dataset)


def _check_allowed(index: int, stage: Stage, allow: Sequence[str] | None, dataset: str) -> None:
    module = stage.module
    if module and allow is not None and not allowed(module, allow):
        raise AccessDeniedError(
            f"dataset {dataset!r} stage {index} ({stage.op}): module {module!r} is not on this server's "
            f"preprocess allow-list ({', '.join(allow) or 'empty'}); the operator adds it to server.preprocess_allow",
            dataset=dataset or None,
        )


#: Decoders whose result is kept as the PIL image a following torchvision transform takes.
_PIL_DECODERS: dict[str, Callable[..., Any]] = {
    "decode_image": image.decode_pil,
    "decode_random_resized_crop": jpeg_region.decode_random_resized_crop_pil,
}


def to_array(value: Any) -> np.ndarray:
    """A stage's value as a numpy array (a PIL image as HWC uint8, a tensor as its CPU array)."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "numpy") and hasattr(value, "detach"):  # a torch tensor
        return value.detach().cpu().contiguous().numpy()
    return np.asarray(value)


def _as_image_input(value: Any) -> Any:
    """What a torchvision transform receives: an HWC/HW uint8 array becomes a PIL image."""
    from kspeed.preprocess import transforms

    if isinstance(value, np.ndarray):
        if value.dtype == np.uint8 and (value.ndim == 2 or (value.ndim == 3 and value.shape[2] in (1, 3, 4))):
            return transforms.from_array(value, "pil")
        return transforms.from_array(value, "tensor")
    return value


def _write_planes(value: Any, output: Output, out: np.ndarray) -> int | None:
    """``PILToTensor`` of ``value`` written into ``out`` as ``output`` declares it, straight from the
    PIL image; the bytes written, or None when it is no such image or does not match (the stage
    then runs as it is, and the mismatch is reported as for any stage)."""
    shape = image.planes_shape(value)
    if shape is None:
        return None
    try:
        place = output.place(shape, np.dtype(np.uint8), out)
    except ValueError:
        return None
    image.write_planes(value, place)
    return output.written(place)


@dataclasses.dataclass(frozen=True)
class _Step:
    index: int
    stage: Stage
    call: Callable[[Any, int, int, int], Any]  # (value, seed, epoch, sample) -> value
    # At a cut: write the stage's result of a value into ``out`` as declared; None when it cannot.
    write: Callable[[Any, Output, np.ndarray], int | None] | None = None


class Runner:
    """The resolved stages of one pipeline.

    Args:
        pipeline: the pipeline.
        allow: modules user functions may come from (``None``: any; the client runs its own code).
            torchvision transforms need ``torchvision.transforms`` in it too.
        dataset: the dataset's name, for error messages.
        stages: resolve only the first this many stages (a server resolves only those it runs).

    Raises:
        AccessDeniedError: a stage's module is not allowed (the message names it and the rule).
        ConfigError: a stage cannot be resolved (unknown op, a module that does not import).
    """

    def __init__(
        self, pipeline: Pipeline, *, allow: Sequence[str] | None = None, dataset: str = "", stages: int | None = None
    ) -> None:
        self.pipeline = pipeline
        self.dataset = dataset
        self._names = [f"{k}:{stage.op}" for k, stage in enumerate(pipeline.stages)]
        self._steps = [self._resolve(k, stage, allow) for k, stage in enumerate(pipeline.stages[:stages])]

    def _resolve(self, index: int, stage: Stage, allow: Sequence[str] | None) -> _Step:
        where = f"dataset {self.dataset!r} stage {index} ({stage.op})"
        module = stage.module
        _check_allowed(index, stage, allow, self.dataset)
        params = dict(stage.params)
        if module in (TORCHVISION, f"{TORCHVISION}.v2"):
            from kspeed.preprocess import transforms

            transform = transforms.build(stage.op, params)
            random = transforms.is_random(stage.op)

            def call_transform(value: Any, seed: int, epoch: int, sample: int) -> Any:
                return transforms.apply(
                    transform, _as_image_input(value), rng.torch_seed(seed, epoch, sample, index) if random else None
                )

            planes = stage.op.partition(":")[2] == "PILToTensor"
            return _Step(index, stage, call_transform, _write_planes if planes else None)
        if module:
            try:
                function = getattr(importlib.import_module(module), stage.op.split(":", 1)[1])
            except (ImportError, AttributeError) as exc:
                raise ConfigError(f"{where}: cannot import it: {exc}", field="pipeline", value=stage.op) from exc
            if not callable(function):
                raise ConfigError(f"{where}: not a function", field="pipeline", value=stage.op)

            def call_user(value: Any, seed: int, epoch: int, sample: int) -> Any:
                return function(value, rng.sample_rng(seed, epoch, sample, index), **params)

            return _Step(index, stage, call_user)
        op = ops.get(stage.op)
        following = self.pipeline.stages[index + 1] if index + 1 < len(self.pipeline.stages) else None
        if stage.op in _PIL_DECODERS and following is not None and following.module.startswith(TORCHVISION):
            # The same decode, kept as the PIL image the torchvision transform takes (no array round trip).
            decode_pil = _PIL_DECODERS[stage.op]

            def call_decode(value: Any, seed: int, epoch: int, sample: int) -> Any:
                if not op.random:
                    return decode_pil(value, **params)
                return decode_pil(value, rng.sample_rng(seed, epoch, sample, index), **params)

            return _Step(index, stage, call_decode)

        def call_op(value: Any, seed: int, epoch: int, sample: int) -> Any:
            if not op.takes_bytes and not isinstance(value, np.ndarray):
                value = to_array(value)
            generator = rng.sample_rng(seed, epoch, sample, index) if op.random else None
            return ops.apply(op, value, generator, params)

        return _Step(index, stage, call_op)

    def __len__(self) -> int:
        return len(self._steps)

    def stage_name(self, index: int) -> str:
        """``"<index>:<op>"``, how per-stage figures name a stage."""
        return self._names[index]

    def run(self, value: Any, *, seed: int, epoch: int, sample: int, start: int = 0, stop: int | None = None) -> Any:
        """Stages ``start`` to ``stop`` (exclusive; default: to the end) on one sample.

        Raises:
            PreprocessError: a stage failed (naming the sample, the stage and why).
        """
        for step in self._steps[start:stop]:
            try:
                value = step.call(value, seed, epoch, sample)
            except Exception as exc:
                raise self._failed(step, sample, exc) from exc
        return value

    def _failed(self, step: _Step, sample: int, exc: Exception) -> PreprocessError:
        return PreprocessError(
            f"dataset {self.dataset!r} sample {sample}: stage {step.index} ({step.stage.op}) failed: "
            f"{type(exc).__name__}: {exc}",
            dataset=self.dataset or None,
            sample=sample,
            stage=step.index,
            op=step.stage.op,
        )

    def produce(
        self,
        data: Any,
        out: np.ndarray,
        *,
        seed: int,
        epoch: int,
        sample: int,
        stop: int,
        start: int = 0,
        seconds: dict[str, float] | None = None,
    ) -> int:
        """Run stages ``start..stop`` on a sample (its raw bytes when ``start`` is 0) and write the
        result into ``out`` as stage ``stop - 1`` declares it; returns the bytes written.

        A last stage that can write its result itself (``PILToTensor`` given a PIL image) does: the
        same bytes as running it and :meth:`write`.

        Args:
            seconds: when given, each stage's seconds are added to it under its :meth:`stage_name`
                (a stage that writes its result itself counts the write).

        Raises:
            PreprocessError: a stage failed, or its result does not match its declaration.
        """
        value = data
        steps = self._steps[start:stop]
        last = steps[-1] if steps and steps[-1].write is not None and steps[-1].index == stop - 1 else None
        output = self.pipeline.output(stop) if last is not None else None
        for step in steps:
            begun = time.perf_counter() if seconds is not None else 0.0
            written = None
            try:
                if step is last and last.write is not None and output is not None:
                    written = last.write(value, output, out)
                if written is None:
                    value = step.call(value, seed, epoch, sample)
            except Exception as exc:
                raise self._failed(step, sample, exc) from exc
            if seconds is not None:
                name = self._names[step.index]
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - begun
            if written is not None:
                return written
        return self.write(value, out, stop, sample=sample)

    def write(self, value: Any, out: np.ndarray, stop: int, *, sample: int) -> int:
        """Write the value after the first ``stop`` stages into ``out`` as stage ``stop - 1`` declares it.

        Raises:
            PreprocessError: the value does not match the declaration.
        """
        try:
            return self.pipeline.output(stop).encode(to_array(value), out)
        except ValueError as exc:
            raise self._unlike(stop, sample, str(exc)) from exc

    def check(self, value: Any, stop: int, *, sample: int) -> None:
        """Check the value after the first ``stop`` stages against stage ``stop - 1``'s declaration,
        as :meth:`write` does on a server, so a sample fails alike wherever it is prepared.

        Raises:
            PreprocessError: the value does not match the declaration.
        """
        why = self.pipeline.output(stop).check(to_array(value))
        if why:
            raise self._unlike(stop, sample, why)

    def _unlike(self, stop: int, sample: int, why: str) -> PreprocessError:
        stage = self.pipeline.stages[stop - 1]
        return PreprocessError(
            f"dataset {self.dataset!r} sample {sample}: stage {stop - 1} ({stage.op}) produced {why}",
            dataset=self.dataset or None,
            sample=sample,
            stage=stop - 1,
            op=stage.op,
        )

    def receive(self, data: np.ndarray, stages: int, *, sample: int) -> Any:
        """The value after the first ``stages`` stages, from the bytes a server produced (a view of ``data``).

        Raises:
            PreprocessError: a variable-shape header is inconsistent.
        """
        output: Output = self.pipeline.output(stages)
        try:
            array = output.decode(data)
        except ValueError as exc:
            raise PreprocessError(
                f"dataset {self.dataset!r} sample {sample}: {exc}", dataset=self.dataset or None, sample=sample
            ) from exc
        if output.kind == "array":
            return array
        from kspeed.preprocess import transforms

        return transforms.from_array(np.ascontiguousarray(array), output.kind)
