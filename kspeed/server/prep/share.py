"""Who runs on a server's preprocessing workers: how many at once, and which job next.

- **How many** (:class:`WorkerSizer`, after Lobster's observation that preprocessing does not gain
  from an arbitrary number of threads, and its rule to use the fewest that reach the peak): while
  the workers are saturated (tasks wait for one the whole time), the pool's throughput is measured
  at the active-worker limit in force, one window at a time; the limit then steps down while that
  keeps within :data:`TOLERANCE` of the best measured, and back up when it does not. The limit in
  force is the smallest that reached the peak; the table is measured again every
  :data:`REMEASURE_S` (what runs on the workers changes). Workers above the limit stay started,
  idle: the cores they would have taken go to the server's feeders and producers.
- **Which job** (:class:`FairShare`): a free worker goes to the job, among those with a task
  waiting, whose busy worker-seconds over its weight are the least (weighted fair queueing; a job
  that was idle starts level with the others rather than with credit for its idle time). Weights
  are the operator's (``preprocess_weights``, 1 by default), so two jobs of weight 1 with demand
  get half the workers each, and a job alone gets them all.

:class:`PrepScheduler` holds both; :meth:`PrepScheduler.figures` is what the server reports in its
inventory (``kspeed status`` shows it).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping

__all__ = ["FairShare", "PrepScheduler", "WorkerSizer"]

WINDOW_S = 5.0  # seconds of saturated work one throughput measurement takes
TOLERANCE = 0.05  # a smaller limit within this of the best measured throughput is as good
REMEASURE_S = 120.0  # the table of throughputs is forgotten this often
SATURATED = 0.9  # share of a window tasks must have waited for a worker for it to count
SHARE_WINDOW_S = 30.0  # the busy seconds a job's share is shown over
MAX_JOBS = 1024  # jobs whose samples are counted (GetInfo's PrepFigures.job_samples)
PRELOAD = "(preload)"  # the job name of work no feed asked for (caching a dataset preprocessed)


class WorkerSizer:
    """The active-worker limit, from throughput measured at each limit (see the module docstring).

    Args:
        workers: worker processes started (the largest limit).
        clock: the time source (tests).
    """

    def __init__(self, workers: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.workers = max(int(workers), 1)
        self.limit = self.workers
        self._clock = clock
        self.table: dict[int, float] = {}  # limit -> samples/s measured saturated
        self._window_start = clock()
        self._samples = 0
        self._saturated_s = 0.0
        self._forgotten = clock()
        self.changes = 0

    def note(self, samples: int) -> None:
        """``samples`` were run through a pipeline."""
        self._samples += samples

    def saturated_for(self, seconds: float) -> None:
        """Tasks waited for a worker for ``seconds`` (while every allowed worker was busy)."""
        self._saturated_s += seconds

    def step(self) -> int | None:
        """At the end of a window: the new limit, if it changes."""
        now = self._clock()
        span = now - self._window_start
        if span < WINDOW_S:
            return None
        saturated = self._saturated_s >= SATURATED * span
        rate = self._samples / span
        self._window_start, self._samples, self._saturated_s = now, 0, 0.0
        if now - self._forgotten >= REMEASURE_S:
            self.table.clear()
            self._forgotten = now
        if not saturated:
            return None  # the workers are not the bottleneck: nothing to learn about them
        old = self.table.get(self.limit)
        self.table[self.limit] = rate if old is None else (old + rate) / 2
        wanted = self._choose()
        if wanted == self.limit:
            return None
        self.limit = wanted
        self.changes += 1
        return wanted

    def _choose(self) -> int:
        """The next limit: a neighbour not measured yet (one fewer first), else the smallest as good
        as the best measured."""
        best = max(self.table.values())
        good = [k for k, rate in self.table.items() if rate >= (1.0 - TOLERANCE) * best]
        if self.limit in good and self.limit > 1 and (self.limit - 1) not in self.table:
            return self.limit - 1
        if self.limit < self.workers and (self.limit + 1) not in self.table:
            return self.limit + 1
        return min(good)


class FairShare:
    """Weighted fair choice of the job a free worker goes to (see the module docstring).

    Args:
        weights: per job name, its weight (missing: 1).
    """

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self.weights = {k: float(v) for k, v in (weights or {}).items() if v > 0}
        self.waiting: collections.Counter[str] = collections.Counter()
        self._vtime: dict[str, float] = {}

    def weight(self, job: str) -> float:
        return self.weights.get(job, 1.0)

    def arrive(self, job: str) -> None:
        """A task of ``job`` waits for a worker."""
        if self.waiting[job] == 0:
            active = [self._vtime.get(j, 0.0) for j, n in self.waiting.items() if n > 0 and j != job]
            floor = min(active) if active else max(self._vtime.values(), default=0.0)
            self._vtime[job] = max(self._vtime.get(job, 0.0), floor)
        self.waiting[job] += 1

    def leave(self, job: str) -> None:
        """A task of ``job`` stopped waiting (it got a worker, or gave up)."""
        self.waiting[job] -= 1
        if self.waiting[job] <= 0:
            del self.waiting[job]

    def next(self) -> str | None:
        """The job the next free worker goes to (``None``: none waits)."""
        jobs = [j for j, n in self.waiting.items() if n > 0]
        if not jobs:
            return None
        return min(jobs, key=lambda j: (self._vtime.get(j, 0.0), j))

    def served(self, job: str, seconds: float) -> None:
        """A task of ``job`` kept a worker ``seconds``."""
        self._vtime[job] = self._vtime.get(job, 0.0) + seconds / self.weight(job)


class PrepScheduler:
    """The workers' admission: at most the sizer's limit busy at once, handed out fairly by job.

    Args:
        workers: worker processes started.
        weights: the operator's weights per job name.
        clock: the time source (tests).
    """

    def __init__(
        self, workers: int, weights: Mapping[str, float] | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.sizer = WorkerSizer(workers, clock)
        self.share = FairShare(weights)
        self._clock = clock
        self._cond = threading.Condition()
        self.busy = 0
        self._saturated_since: float | None = None
        self._recent: collections.deque[tuple[float, str, float]] = collections.deque()  # (when, job, busy s)
        self._samples: collections.OrderedDict[str, int] = collections.OrderedDict()  # per job, the last MAX_JOBS

    def acquire(self, job: str, timeout: float | None = None) -> bool:
        """Wait until a task of ``job`` may take a worker; ``False`` after ``timeout`` seconds."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            self.share.arrive(job)
            try:
                while not (self.busy < self.sizer.limit and self.share.next() == job):
                    self._note_saturation()
                    left = None if deadline is None else deadline - self._clock()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(0.05 if left is None else min(left, 0.05))
                self.busy += 1
                self._note_saturation()
                return True
            finally:
                self.share.leave(job)

    def release(self, job: str, seconds: float, samples: int) -> None:
        """A task of ``job`` gave its worker back after ``seconds``, having run ``samples``."""
        with self._cond:
            self.busy -= 1
            self.share.served(job, seconds)
            self.sizer.note(samples)
            self._samples[job] = self._samples.pop(job, 0) + samples
            while len(self._samples) > MAX_JOBS:
                self._samples.popitem(last=False)  # the job served longest ago
            now = self._clock()
            self._recent.append((now, job, seconds))
            while self._recent and now - self._recent[0][0] > SHARE_WINDOW_S:
                self._recent.popleft()
            self._note_saturation()
            self.sizer.step()
            self._cond.notify_all()

    def _note_saturation(self) -> None:
        """Count the time tasks waited while every allowed worker was busy (under the lock)."""
        now = self._clock()
        saturated = bool(self.share.waiting) and self.busy >= self.sizer.limit
        if self._saturated_since is not None:
            self.sizer.saturated_for(now - self._saturated_since)
        self._saturated_since = now if saturated else None

    def samples_of(self, job: str) -> int:
        """Samples run for ``job`` since it was first served (0 for a job not among the last
        :data:`MAX_JOBS` served)."""
        with self._cond:
            return self._samples.get(job, 0)

    def figures(self) -> tuple[int, dict[str, float], dict[str, float]]:
        """The active-worker limit, each job's share of the busy worker-seconds over the last
        :data:`SHARE_WINDOW_S`, and the weights of the jobs in it."""
        with self._cond:
            spent: dict[str, float] = collections.defaultdict(float)
            for _, job, seconds in self._recent:
                spent[job] += seconds
            total = sum(spent.values())
            shares = {job: s / total for job, s in spent.items()} if total > 0 else {}
            return self.sizer.limit, shares, {job: self.share.weight(job) for job in shares}
