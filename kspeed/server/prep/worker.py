"""A preprocessing worker process: it confines itself, then runs pipeline stages on the samples the
server hands it.

Started by :class:`kspeed.server.prep.workers.PrepWorkers` with a clean environment and one Unix socket
to the server (``python -I -c ...``, see :data:`BOOT`). The first message (:class:`Setup`) carries
the sandbox policy: the worker confines itself (:func:`kspeed.server.prep.sandbox.confine`) before it
imports numpy or any pipeline module, and reports the outcome. Then, one request at a time:

- a :class:`Scratch` message, followed by a memfd over the socket: the worker's scratch segment
  from now on (inputs are copied in by the server, outputs written here and copied out by it);
- a :class:`Resolve`: resolve a pipeline's first stages (importing their modules);
- a :class:`Job`: run samples whose inputs lie in the scratch through the stages, each result at
  its place in the scratch.

The server's messages are pickled (the worker trusts the server); the worker answers in JSON, so
that a worker taken over by user code can send the server nothing but plain data, which the server
checks (:mod:`kspeed.server.prep.workers`). This module imports nothing heavy at its top: what a
worker imports before it is confined runs with the server's privileges.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import mmap
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

from kspeed.control.logs import LogSettings
from kspeed.errors import ConfigError, KSpeedError
from kspeed.server.prep.sandbox import SandboxPolicy, confine, import_paths

__all__ = ["BOOT", "Job", "Resolve", "Scratch", "Setup", "main"]

#: What the server runs as ``python -I -c BOOT <sys.path as JSON> <socket fd> <server pid>``: the
#: server's import path first (``-I`` ignores the environment and the working directory).
BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from kspeed.server.prep.worker import main; main(int(sys.argv[2]), int(sys.argv[3]))"
)
#: Longest failure reason a worker sends per sample (the rest is cut).
MAX_REASON = 2000


@dataclasses.dataclass(frozen=True)
class Setup:
    """The first message: how to confine, which modules user functions may come from, how to log."""

    policy: SandboxPolicy
    allow: tuple[str, ...]
    logs: LogSettings


@dataclasses.dataclass(frozen=True)
class Scratch:
    """A new scratch segment of ``size`` bytes follows as a file descriptor."""

    size: int


@dataclasses.dataclass(frozen=True)
class Resolve:
    """Resolve a pipeline's first ``stages`` stages (importing what they need); the answer is
    ``{"error": null}`` or the error's type and message."""

    dataset: str
    pipeline: bytes
    stages: int


@dataclasses.dataclass(frozen=True)
class TaskHead:
    """Which samples run through which stages of which pipeline, seeded how: what the server's
    :class:`~kspeed.server.prep.link.PrepTask` and the worker's :class:`Job` made of it share.

    Attributes:
        dataset: the dataset's name (for messages).
        pipeline: the pipeline (a serialized ``kspeed.v1.Pipeline``).
        stages: run the stages before this one.
        seed: the job's seed.
        epoch: the epoch (random stages draw from ``(seed, epoch, sample, stage)``).
        samples: the sample IDs.
    """

    dataset: str
    pipeline: bytes
    stages: int
    seed: int
    epoch: int
    samples: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Job(TaskHead):
    """Samples to run through a pipeline's stages ``start..stages``; see :class:`kspeed.server.prep.link.PrepTask`.

    Attributes:
        inputs: per sample, ``(offset, length)`` of its bytes in the scratch.
        outputs: per sample, ``(offset, capacity)`` of its place in the scratch.
    """

    inputs: tuple[tuple[int, int], ...]
    outputs: tuple[tuple[int, int], ...]
    skip: bool
    start: int


def main(fd: int, parent: int) -> None:
    """Entry point: confine, report, then serve requests until the socket closes."""
    conn = Connection(fd)
    os.chdir("/")
    setup: Setup = conn.recv()
    sys.dont_write_bytecode = True  # (nowhere to write it)
    report = confine(setup.policy, import_paths(sys.path, setup.policy.protected))
    from kspeed.control.daemon import die_with_parent

    die_with_parent(parent, signal.SIGKILL)  # (after the identity switch, which clears it)
    setup.logs.apply("prep", helper=True)
    conn.send_bytes(json.dumps({"confinement": report.to_dict()}).encode())
    refusal = report.verdict(setup.policy.mode)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    except Exception as exc:  # (a torch that cannot start here fails the stages that need it, saying why)
        logging.getLogger(__name__).warning("torch cannot be imported in the sandbox: %s", exc)
    _serve(conn, setup.allow, refusal)


def _serve(conn: Connection, allow: tuple[str, ...], refusal: str) -> None:
    import numpy as np

    scratch = np.zeros(0, dtype=np.uint8)
    runners: dict[tuple[bytes, int], Any] = {}
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if isinstance(request, Scratch):
            handle = recv_handle(conn)
            with contextlib.suppress(ValueError):
                scratch = np.frombuffer(mmap.mmap(handle, request.size), dtype=np.uint8)
            os.close(handle)
            continue
        runner = (
            ConfigError(f"dataset {request.dataset!r}: {refusal}", field="server.preprocess_sandbox")
            if refusal
            else _runner(runners, request.dataset, request.pipeline, request.stages, allow)
        )
        if isinstance(request, Resolve):
            failure = _error(runner) if isinstance(runner, KSpeedError) else None
            conn.send_bytes(json.dumps({"error": failure}).encode())
            continue
        began = time.process_time()
        results, seconds = _run(runner, request, scratch)
        cpu = time.process_time() - began
        conn.send_bytes(json.dumps({"results": results, "seconds": seconds, "cpu": cpu}).encode())


def _error(exc: KSpeedError) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc)[:MAX_REASON]}


def _runner(
    runners: dict[tuple[bytes, int], Any], dataset: str, pipeline: bytes, stages: int, allow: tuple[str, ...]
) -> Any:
    """The runner of a pipeline's first ``stages`` stages, resolved on first use (or why it cannot be)."""
    from kspeed.preprocess.pipeline import Pipeline
    from kspeed.preprocess.runner import Runner
    from kspeed.proto import kspeed_pb2

    key = (pipeline, stages)
    runner = runners.get(key)
    if runner is None:
        try:
            message = kspeed_pb2.Pipeline.FromString(pipeline)
            runner = Runner(Pipeline.from_proto(message, stages), allow=allow, dataset=dataset, stages=stages)
        except KSpeedError as exc:
            runner = exc
        if len(runners) > 16:
            runners.clear()
        runners[key] = runner
    return runner


def _run(runner: Any, job: Job, scratch: Any) -> tuple[list[tuple[int, str | None]], dict[str, float]]:
    """Run a job's samples; per sample, the bytes its place now holds and why it failed (or None)."""
    from kspeed.preprocess.pipeline import STATUS, write_status

    results: list[tuple[int, str | None]] = []
    seconds: dict[str, float] = {}
    for sample, (at, length), (place, capacity) in zip(job.samples, job.inputs, job.outputs, strict=True):
        if place + capacity > len(scratch) or at + length > len(scratch):
            results.append((0, f"dataset {job.dataset!r} sample {sample}: its place is outside the scratch segment"))
            continue
        out = scratch[place : place + capacity]
        if isinstance(runner, KSpeedError):
            outcome: int | str = str(runner)
        else:
            outcome = _run_one(
                runner, job, sample, scratch[at : at + length], out[STATUS:] if job.skip else out, seconds
            )
        if isinstance(outcome, str):
            reason = outcome[:MAX_REASON]
            if job.skip:  # the place holds the failure record, served to the client as the sample
                write_status(out, reason)
                results.append((min(STATUS + len(reason.encode()), capacity), reason))
            else:
                results.append((0, reason))
            continue
        if job.skip:
            write_status(out)
            outcome += STATUS
        results.append((outcome, None))
    return results, seconds


def _run_one(runner: Any, job: Job, sample: int, data: Any, out: Any, seconds: dict[str, float]) -> int | str:
    """Run one sample's stages into ``out``; the bytes written, or why it failed."""
    try:
        if job.start:
            data = runner.receive(data, job.start, sample=sample)
        return int(
            runner.produce(
                data,
                out,
                seed=job.seed,
                epoch=job.epoch,
                sample=sample,
                start=job.start,
                stop=job.stages,
                seconds=seconds,
            )
        )
    except KSpeedError as exc:
        return str(exc)
