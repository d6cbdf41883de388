"""The server's end of one preprocessing worker: its process, its socket and its scratch segment.

A :class:`WorkerLink` starts a worker (:mod:`kspeed.server.prep.worker`) as a fresh interpreter
with a clean environment (:func:`kspeed.config.preprocess_environment`), no file descriptor but
its socket, and ``/`` as its working directory; the worker confines itself before it runs anything
of a pipeline. The worker never maps the pool or the production window: for each task the server
copies the samples' bytes into the worker's **scratch** (a sealed memfd both map; sealed so that the
worker cannot shrink it under the server), the worker writes each result at its place in the
scratch, and the server copies what it reports written into the window slot (or returns it).

What a worker sends is JSON, read with a size limit and checked field by field: a worker runs
user code, and a worker taken over by it must not be able to make the server unpickle, allocate
or copy anything it chooses. A malformed reply, like a worker's death or silence, is
:class:`WorkerLost`: the pool replaces the worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import math
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any

import numpy as np

from kspeed.errors import AccessDeniedError, ConfigError, DatasetError, KSpeedError, PreprocessError
from kspeed.preprocess.pipeline import STATUS, Pipeline
from kspeed.proto import kspeed_pb2
from kspeed.server.prep.sandbox import Confinement, worker_user
from kspeed.server.prep.worker import BOOT, Job, Resolve, Scratch, Setup, TaskHead

__all__ = ["PrepTask", "WorkerLink", "WorkerLost", "sweep_temporary"]

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 5.0
MAX_REPLY = 16 << 20  # bytes of one reply (results and stage times of one task)
MAX_STAGE_KEY = 200  # characters of a stage's name in a reply
SCRATCH_MIN = 1 << 20
ALIGN = 64  # each input and output starts on a cache line of the scratch
TMP_PREFIX = "kspeed-prep-"  # a worker's temporary directory: kspeed-prep-<server pid>-<number>-<random>
#: The errors a worker may name when it cannot resolve a pipeline (any other is a ConfigError).
_DATASET_ERRORS: dict[str, type[DatasetError]] = {
    "AccessDeniedError": AccessDeniedError,
    "PreprocessError": PreprocessError,
}


@dataclasses.dataclass(frozen=True)
class PrepTask(TaskHead):
    """Samples to run through a pipeline's first ``stages`` stages (what they are: :class:`TaskHead`).

    Attributes:
        inputs: per sample, its stored bytes (a view of the pool, or bytes read from the backend).
        outputs: per sample, where its result goes (a window slot's view, at least as large as the
            declared output); ``None``: each result comes back as the bytes of the declared output.
        skip: each output starts with a status word; a failed sample's slot gets its failure
            record (the reason is still returned).
        start: the first stage to run; the inputs are stage ``start - 1``'s declared output
            (0: the backend's bytes).
    """

    inputs: tuple[bytes | np.ndarray, ...]
    outputs: tuple[np.ndarray, ...] | None
    skip: bool = False
    start: int = 0


class WorkerLost(KSpeedError):
    """A worker died, fell silent, or sent what a worker never sends (it is replaced)."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class WorkerLink:
    """One worker process and the server's side of its socket and scratch segment.

    Args:
        setup: what the worker is told first (policy, allow-list, logging).
        environment: its whole environment.
        number: its number, for its process name in messages.
    """

    def __init__(self, setup: Setup, environment: dict[str, str], number: int) -> None:
        # Its own temporary directory (libraries expect one), the only place it may write by default.
        self.tmp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-{number}-")
        user = worker_user(setup.policy)
        if user is not None:
            os.chown(self.tmp, user.uid, user.gid)
        policy = dataclasses.replace(setup.policy, write=(*setup.policy.write, self.tmp))
        setup = dataclasses.replace(setup, policy=policy)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            argv = [sys.executable, "-I", "-c", BOOT, json.dumps(sys.path), str(theirs.fileno()), str(os.getpid())]
            self.process = subprocess.Popen(
                argv,
                env={**environment, "TMPDIR": self.tmp},
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                cwd="/",
            )
        except OSError:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        finally:
            theirs.close()
        self.number = number
        self.conn = Connection(ours.detach())
        self.confinement: Confinement | None = None  # its report, read before its first request
        self._scratch = np.zeros(0, dtype=np.uint8)
        self._capacities: dict[tuple[bytes, int, bool], int] = {}
        self.conn.send(setup)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def report(self, timeout: float) -> Confinement:
        """The worker's confinement report (waited for, the first time).

        Raises:
            WorkerLost: it did not report, or sent something else.
        """
        if self.confinement is None:
            reply = self._reply(timeout)
            try:
                self.confinement = Confinement.from_dict(reply.get("confinement"))
            except ValueError as exc:
                raise WorkerLost(f"preprocessing worker {self.pid}: {exc}") from exc
        return self.confinement

    def resolve(self, request: Resolve, timeout: float) -> KSpeedError | None:
        """Have the worker resolve a pipeline's stages; the error that resolving raised, or ``None``.

        Raises:
            WorkerLost: see :meth:`_reply`.
        """
        self.report(timeout)
        self.conn.send(request)
        failure = self._reply(timeout).get("error")
        if failure is None:
            return None
        if not isinstance(failure, dict) or not isinstance(failure.get("message"), str):
            raise WorkerLost(f"preprocessing worker {self.pid} answered a resolve with {type(failure).__name__}")
        message = failure["message"][:2000]
        error = _DATASET_ERRORS.get(str(failure.get("type")))
        return ConfigError(message, field="pipeline") if error is None else error(message, dataset=request.dataset)

    def run(self, task: PrepTask, timeout: float) -> tuple[list[int | str | bytes], dict[str, float], float]:
        """Run ``task``: per sample, the bytes written to its output (or, without outputs, the bytes
        themselves) or why it failed; the seconds each stage took; and the worker's CPU seconds.

        Raises:
            WorkerLost: see :meth:`_reply`; or a result that does not fit its place.
        """
        self.report(timeout)
        job = self._stage(task)
        self.conn.send(job)
        reply = self._reply(timeout)
        results, seconds = reply.get("results"), reply.get("seconds")
        if not isinstance(results, list) or len(results) != len(task.samples) or not isinstance(seconds, dict):
            raise WorkerLost(f"preprocessing worker {self.pid} sent a malformed reply")
        out: list[int | str | bytes] = []
        for k, item in enumerate(results):
            n, reason = item if isinstance(item, list) and len(item) == 2 else (None, None)
            place, capacity = job.outputs[k]
            if type(n) is not int or not 0 <= n <= capacity or not (reason is None or isinstance(reason, str)):
                raise WorkerLost(f"preprocessing worker {self.pid} reported a result outside its place")
            written = self._scratch[place : place + n]
            if task.outputs is not None:
                task.outputs[k][:n] = written
                out.append(reason if reason is not None else n)
            else:
                out.append(reason if reason is not None else written.tobytes())
        cpu = reply.get("cpu")
        if not isinstance(cpu, (int, float)) or not math.isfinite(cpu) or cpu < 0:
            cpu = 0.0  # a worker that does not say
        return out, _stage_seconds(seconds), float(cpu)

    def _stage(self, task: PrepTask) -> Job:
        """Lay the task out in the scratch (grown if needed) and copy its inputs in."""
        sizes = [len(data) for data in task.inputs]
        if task.outputs is not None:
            capacities = [len(out) for out in task.outputs]
        else:
            capacities = [self._capacity(task)] * len(task.samples)
        starts, at = [], 0
        for n in [*sizes, *capacities]:
            starts.append(at)
            at += _aligned(n)
        self._ensure(at)
        for start, data, n in zip(starts, task.inputs, sizes, strict=False):  # (starts: inputs, then outputs)
            self._scratch[start : start + n] = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
        inputs = tuple(zip(starts[: len(sizes)], sizes, strict=True))
        outputs = tuple(zip(starts[len(sizes) :], capacities, strict=True))
        return Job(
            task.dataset,
            task.pipeline,
            task.stages,
            task.seed,
            task.epoch,
            task.samples,
            inputs,
            outputs,
            task.skip,
            task.start,
        )

    def _capacity(self, task: PrepTask) -> int:
        """The declared output size of a task without outputs (its result comes back as bytes)."""
        key = (task.pipeline, task.stages, task.skip)
        if key not in self._capacities:
            try:
                pipeline = Pipeline.from_proto(kspeed_pb2.Pipeline.FromString(task.pipeline), task.stages)
                size = pipeline.output(task.stages).nbytes
            except KSpeedError:
                size = 0  # the worker cannot resolve it either: every sample fails, saying why
            self._capacities[key] = size + (STATUS if task.skip else 0)
        return self._capacities[key]

    def _ensure(self, size: int) -> None:
        """Give the worker a scratch of at least ``size`` bytes (a new sealed memfd when it is too small)."""
        if size <= len(self._scratch):
            return
        size = max(size, 2 * len(self._scratch), SCRATCH_MIN)
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.memfd_create(f"kspeed-prep-{self.number}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._scratch = np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
            self.conn.send(Scratch(size))
            send_handle(self.conn, fd, self.pid)
        finally:
            os.close(fd)

    def _reply(self, timeout: float) -> dict[str, Any]:
        """The worker's next reply, parsed.

        Raises:
            WorkerLost: it died, sent nothing within ``timeout``, or sent something that is not a
                JSON object of at most :data:`MAX_REPLY` bytes.
        """
        try:
            if not self.conn.poll(timeout):
                raise WorkerLost(f"preprocessing worker {self.pid}: no answer within {timeout:g}s")
            data = json.loads(self.conn.recv_bytes(MAX_REPLY))
        except (EOFError, OSError, ValueError) as exc:
            raise WorkerLost(f"preprocessing worker {self.pid}: {str(exc) or type(exc).__name__}") from exc
        if not isinstance(data, dict):
            raise WorkerLost(f"preprocessing worker {self.pid} sent a {type(data).__name__}, not an object")
        return data

    def stop(self) -> None:
        """Close its socket and wait for it a moment (kill it if it lingers); remove its temporary directory."""
        with contextlib.suppress(OSError):
            self.conn.close()
        try:
            self.process.wait(JOIN_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(JOIN_TIMEOUT)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()


def sweep_temporary() -> None:
    """Remove the temporary directories that workers of servers no longer running left behind
    (a server killed, its workers with it, never removed theirs); named after the server's pid."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name.removeprefix(TMP_PREFIX).split("-", 1)[0]
        if not name.startswith(TMP_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except OSError:
            continue  # alive (another user's): not ours to remove


def _stage_seconds(raw: dict[Any, Any]) -> dict[str, float]:
    """Stage times from a reply: names of bounded length, finite non-negative seconds."""
    seconds: dict[str, float] = {}
    for name, value in raw.items():
        if isinstance(name, str) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0:
            seconds[name[:MAX_STAGE_KEY]] = float(value)
    return seconds
