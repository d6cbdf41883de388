"""Rates a rank measures while it trains, for the offload decision (:mod:`kspeed.client.tuning.decision`).

- :class:`LoopMeter`: the training loop's step from the calls of ``next()``: wall seconds from a
  batch handed over to the next one asked for, less the time the thread waited for a CPU (its
  run-queue wait, ``/proc/thread-self/schedstat``: a step slowed by this client's own workers on
  the same core is not a slow model), and the thread's CPU seconds meanwhile; also the CPU the
  thread spends inside ``next()`` (copying a batch out of the ring, collating).
- :class:`PrepMeter`: the client workers' CPU per sample, from each batch's per-stage seconds
  (scaled by the batch's CPU over wall time, so a worker waiting for a core does not look slow):
  Pcycle from the samples preprocessed here, Ocycle from those received preprocessed.
- :class:`ServerMeter`: the servers' preprocessing capacity for this job, from their counters
  (:class:`~kspeed.proto.kspeed_pb2.PrepFigures`) read twice: samples per busy worker-second
  times the workers, at most what their CPUs run at a sample's whole CPU cost on the server
  (workers, production, feeding: a core the workers share with the server's own work runs fewer
  samples than the workers' busy time says), less what the other jobs on them run.

Each keeps the last :data:`WINDOW_S` seconds (at least :data:`MIN_BATCHES` batches), so a change
of conditions shows within seconds and one odd batch does not.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LoopMeter", "PrepMeter", "Reading", "ServerMeter", "Window", "run_queue_wait"]

WINDOW_S = 4.0  # seconds of recent batches a rate is taken over
MIN_BATCHES = 4  # ... and at least this many batches
_SCHEDSTAT = "/proc/thread-self/schedstat"


def run_queue_wait() -> float:
    """Seconds the calling thread has waited for a CPU since it started (0 where the kernel does not say)."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            fields = f.read().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Window:
    """Sums of a few figures over the recent batches."""

    def __init__(self, width: int) -> None:
        self._rows: collections.deque[tuple[float, tuple[float, ...]]] = collections.deque()
        self._width = width

    def add(self, now: float, row: tuple[float, ...]) -> None:
        self._rows.append((now, row))
        while len(self._rows) > MIN_BATCHES and now - self._rows[0][0] > WINDOW_S:
            self._rows.popleft()

    def sums(self) -> tuple[float, ...]:
        total = [0.0] * self._width
        for _, row in self._rows:
            for k, value in enumerate(row):
                total[k] += value
        return tuple(total)

    def __len__(self) -> int:
        return len(self._rows)

    def clear(self) -> None:
        self._rows.clear()


class LoopMeter:
    """The training loop's step, per sample, from the calls of ``next()`` (see the module docstring).

    Call :meth:`asked` when ``next()`` is entered and :meth:`handed` when it returns a batch of
    ``samples``; both from the training loop's thread.
    """

    def __init__(self) -> None:
        self._window = Window(6)  # step wall, step run-queue wait, step cpu, next() wall, next() cpu, samples
        self._lock = threading.Lock()
        self._handed: tuple[float, float, float] | None = None  # wall, cpu, run-queue wait at the last hand-over
        self._asked: tuple[float, float, float] | None = None
        self._step: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self.consumed = 0  # samples handed over so far
        self.step_total_s = 0.0  # wall seconds of every step so far (kspeed_client_step_seconds_total)

    @staticmethod
    def _now() -> tuple[float, float, float]:
        return time.monotonic(), time.thread_time(), run_queue_wait()

    def asked(self) -> None:
        """``next()`` was entered: the step since the last batch ended."""
        now = self._now()
        if self._handed is not None:
            wall, cpu, queued = (a - b for a, b in zip(now, self._handed, strict=True))
            self._step = (wall, max(queued, 0.0), cpu)
            self.step_total_s += wall
        else:
            self._step = (0.0, 0.0, 0.0)
        self._asked = now

    def handed(self, samples: int) -> None:
        """``next()`` returns a batch of ``samples``."""
        now = self._now()
        self.consumed += samples
        if self._asked is not None and samples > 0 and self._handed is not None:
            wall, cpu = now[0] - self._asked[0], now[1] - self._asked[1]
            with self._lock:
                self._window.add(now[0], (*self._step, wall, cpu, float(samples)))
        self._handed = now

    def forget_step(self) -> None:
        """The time until the next ``next()`` is not a training step (e.g. an epoch ended)."""
        self._handed = None

    def figures(self) -> dict[str, float] | None:
        """Per sample over the recent batches: ``step_s`` (wall, net of the run-queue wait),
        ``step_cpu``, ``wait_s`` (wall inside ``next()``), ``next_cpu``; ``None`` before any."""
        with self._lock:
            if not len(self._window):
                return None
            wall, queued, cpu, next_wall, next_cpu, samples = self._window.sums()
        if samples <= 0:
            return None
        return {
            "step_s": max(wall - queued, cpu, 1e-9) / samples,
            "step_cpu": cpu / samples,
            "wait_s": next_wall / samples,
            "next_cpu": next_cpu / samples,
            "samples": samples,
        }


class PrepMeter:
    """The client's preprocessing CPU per sample, from the batches its workers finish.

    Args:
        server_stages: the pipeline's stages the servers run for an offloaded sample (stage
            ``"<k>:<op>"`` with ``k`` below it is offloadable).
    """

    def __init__(self, server_stages: int) -> None:
        self._server_stages = server_stages
        self._lock = threading.Lock()
        self._window = Window(5)  # offloadable s, local samples, receive s, remote samples, common s
        self._samples = 0.0
        self.local_cpu: float | None = None  # last known Pcycle (kept while no sample runs here)
        self.receive_cpu: float | None = None
        self.common_cpu: float = 0.0

    def record(self, seconds: Mapping[str, float], cpu_s: float, wall_s: float, local: int, remote: int) -> None:
        """One batch: its per-stage wall seconds, its worker's CPU and wall seconds for the whole
        batch, and how many of its samples ran the offloadable stages here or arrived preprocessed."""
        scale = min(cpu_s / wall_s, 1.0) if wall_s > 0 and cpu_s > 0 else 1.0
        offloadable = receive = common = 0.0
        for name, value in seconds.items():
            head = name.split(":", 1)[0]
            if name == "receive":
                receive += value
            elif head.isdigit() and int(head) < self._server_stages:
                offloadable += value
            else:
                common += value
        with self._lock:
            self._window.add(time.monotonic(), (offloadable * scale, local, receive * scale, remote, common * scale))
            off, n_local, rec, n_remote, com = self._window.sums()
            if n_local > 0:
                self.local_cpu = off / n_local
            if n_remote > 0:
                self.receive_cpu = rec / n_remote
            if n_local + n_remote > 0:
                self.common_cpu = com / (n_local + n_remote)

    def known(self) -> bool:
        """Whether both Pcycle and Ocycle were measured."""
        return self.local_cpu is not None and self.receive_cpu is not None


@dataclass
class _Counters:
    at: float
    workers: int
    busy: float
    samples: int
    cpu: float  # the server's CPU seconds, workers and its own processes (0: not reported)
    job: int | None  # of samples, this job's (None: not reported)


@dataclass(frozen=True)
class Reading:
    """One reading of a server's preprocessing counters (:class:`~kspeed.proto.kspeed_pb2.PrepFigures`).

    Attributes:
        workers: worker processes that may run at once.
        busy_seconds: worker-seconds spent on tasks.
        samples: samples run through a pipeline.
        cpu_seconds: CPU seconds of its workers and its own processes (0: not reported).
        cores: CPUs the server may use (0: not reported).
        group: which CPUs (servers with the same group share them; empty: not reported).
        job_samples: of ``samples``, those run for this job (``None``: not reported).
    """

    workers: int
    busy_seconds: float
    samples: int
    cpu_seconds: float = 0.0
    cores: int = 0
    group: str = ""
    job_samples: int | None = None

    @classmethod
    def of(cls, figures: Any, *, counts_job: bool) -> Reading:
        """A server's :class:`~kspeed.proto.kspeed_pb2.PrepFigures` as a reading (``counts_job``:
        they were asked for with a job, whose samples they then count where the server does)."""
        total_cpu = figures.cpu_seconds + figures.daemon_cpu_seconds if figures.daemon_cpu_seconds > 0 else 0.0
        return cls(
            figures.workers,
            figures.busy_seconds,
            figures.samples,
            total_cpu,
            figures.cores,
            figures.cpu_group,
            figures.job_samples if counts_job and figures.HasField("job_samples") else None,
        )


class ServerMeter:
    """The servers' preprocessing capacity left for this job, samples/s (see the module docstring).

    A server's capacity is its workers' samples per busy second times the workers; where the
    servers report their CPU, no more than their CPUs can run at the CPU a sample costs them in
    all (workers, production, feeding), counted once for servers that share their CPUs.
    """

    def __init__(self) -> None:
        self._last: dict[str, _Counters] = {}
        self._readings: dict[str, collections.deque[_Counters]] = {}  # the last WINDOW_S of each server's
        self._capacity: dict[str, float] = {}  # samples/s each server's workers can run, last measured
        self._spent: dict[str, tuple[float, float]] = {}  # samples and CPU seconds each ran, over the window
        self._cpus: dict[str, tuple[str, int]] = {}  # each server's CPU group and cores, where reported
        self._gone: list[float] = []  # the capacities of servers that left (their shares' new holders start cold)
        self._used: dict[str, float] = {}  # samples/s each server ran, over the window
        self._others: dict[str, float] = {}  # of those, samples/s for other jobs, where the server says
        self.capacity = math.inf
        self.used = 0.0

    def read(self, server_id: str, reading: Reading, now: float) -> None:
        """One reading of a server's counters; the rates are taken over the readings of the last
        :data:`WINDOW_S` (a reading every half second covers a few tasks: too few to go by)."""
        counters = _Counters(
            now, reading.workers, reading.busy_seconds, reading.samples, reading.cpu_seconds, reading.job_samples
        )
        last = self._last.get(server_id)
        self._last[server_id] = counters
        if reading.cores > 0 and reading.group:
            self._cpus[server_id] = (reading.group, reading.cores)
        readings = self._readings.setdefault(server_id, collections.deque())
        if last is not None and (
            now <= last.at or counters.samples < last.samples or counters.busy < last.busy or counters.cpu < last.cpu
        ):
            readings.clear()  # a restarted server (or one of its processes): counted from here
        readings.append(counters)
        while len(readings) > 2 and now - readings[1].at >= WINDOW_S:
            readings.popleft()
        first = readings[0]
        if len(readings) < 2 or now <= first.at:
            return
        ran, busy = counters.samples - first.samples, counters.busy - first.busy
        self._used[server_id] = ran / (now - first.at)
        if counters.job is not None and first.job is not None:
            self._others[server_id] = max(ran - (counters.job - first.job), 0) / (now - first.at)
        if ran > 0 and busy > 0:
            self._capacity[server_id] = max(counters.workers, 1) * ran / busy
            self._spent[server_id] = (ran, counters.cpu - first.cpu if first.cpu > 0 else 0.0)

    def capacities(self) -> dict[str, float]:
        """Each measured server's capacity, samples/s: its workers' rate, capped by what its CPUs
        (shared with the servers of its CPU group) can run at the CPU a sample costs."""
        groups: dict[str, list[str]] = {}
        for server_id in self._capacity:
            group = self._cpus.get(server_id, (f"server:{server_id}", 0))[0]
            groups.setdefault(group, []).append(server_id)
        out: dict[str, float] = {}
        for members in groups.values():
            workers = sum(self._capacity[m] for m in members)
            ran = sum(self._spent.get(m, (0.0, 0.0))[0] for m in members)
            cpu = sum(self._spent.get(m, (0.0, 0.0))[1] for m in members)
            cores = max(self._cpus.get(m, ("", 0))[1] for m in members)
            reported = all(self._spent.get(m, (0.0, 0.0))[1] > 0 for m in members)
            cap = min(workers, cores * ran / cpu) if reported and cores > 0 and cpu > 0 else workers
            for m in members:
                out[m] = self._capacity[m] * cap / workers
        return out

    def known(self) -> set[str]:
        """The servers read so far."""
        return set(self._last)

    def forget(self, server_id: str) -> None:
        """A server left the job (lost or replaced): its figures go (its capacity is kept as the
        estimate of a server not measured yet, such as the one its share moved to)."""
        if server_id in self._capacity:
            self._gone = [*self._gone[-7:], self.capacities()[server_id]]
        for table in (self._last, self._capacity, self._used, self._others, self._readings, self._spent, self._cpus):
            table.pop(server_id, None)

    def left_for(self, mine: float, servers: int) -> float:
        """Samples/s the servers can preprocess for a job that gets ``mine`` samples/s from them now
        (their capacity less what the others run: as each server counts it, where they all do,
        else what they ran less ``mine``; production runs ahead of delivery, so the servers' own
        count is the better). A server not measured yet counts as the average of those measured
        (and of those that left: a failover's new holder is taken to be like the lost one, not
        unlimited); ``inf`` while none was ever measured."""
        known = list(self.capacities().values())
        estimates = known + self._gone
        if not estimates:
            return math.inf
        missing = max(servers - len(known), 0)
        self.capacity = sum(known) + missing * (sum(estimates) / len(estimates))
        self.used = sum(self._used.values())
        if self._others and set(self._others) == set(self._used):
            others = sum(self._others.values())
        else:
            others = max(self.used - mine, 0.0)
        return max(self.capacity - others, mine, 0.0)
