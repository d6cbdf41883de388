"""A crew of worker threads draining a queue of tasks, as many as measured throughput rewards.

How many threads pay off depends on the backend. With a remote store (milliseconds per open)
dozens of reads in flight multiply throughput; from a warm page cache a sample costs a few
microseconds of Python and system calls, and extra threads mostly hand the GIL back and forth:
on two cores, 32 threads preloaded small files at a fifth of the speed of one. So
:class:`ThreadTuner` starts with one thread and watches its first tasks: if they spent most of
their wall time waiting rather than on the CPU, the backend is slow and it goes straight to the
most threads allowed. Otherwise the work is CPU-bound and many more threads than cores cannot help;
it doubles the count up to two per core while each doubling raises throughput by
:attr:`ThreadTuner.gain`, and settles on the last count that did.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Crew", "ThreadTuner"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Tasks the first window needs before a backend that mostly waits is recognized.
_PROBE_TASKS = 2


class ThreadTuner:
    """Chooses the number of worker threads from the first tasks and successive throughput windows.

    Not thread-safe: :class:`Crew` calls it under its lock.

    Args:
        max_threads: never more threads than this.
        cores: CPU cores this process may use (default: its CPU affinity).
        window_s: a measurement window lasts at least this long ...
        window_tasks: ... and covers at least this many tasks per thread.
        gain: a step up is kept only if throughput rose by this factor.
        wait_ratio: if the first tasks took this many times more wall time than CPU time, they
            mostly waited on the backend: go straight to ``max_threads``.

    Attributes:
        target: the number of threads to run now.
        settled: no more steps will be tried.
    """

    def __init__(
        self,
        max_threads: int,
        *,
        cores: int | None = None,
        window_s: float = 0.005,
        window_tasks: int = 4,
        gain: float = 1.15,
        wait_ratio: float = 2.0,
    ) -> None:
        self.max_threads = max(int(max_threads), 1)
        self.cores = max(int(cores or _usable_cores()), 1)
        self.window_s, self.window_tasks, self.gain, self.wait_ratio = window_s, window_tasks, gain, wait_ratio
        self.target = 1
        self.settled = self.max_threads == 1
        self._before: tuple[int, float] | None = None  # (threads, rate) before the last step
        self._ceiling = self.max_threads
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self._start, self._units, self._wall, self._cpu, self._tasks = now, 0.0, 0.0, 0.0, 0

    def record(self, units: float, wall_s: float, cpu_s: float, now: float) -> bool:
        """Account one finished task; returns True if :attr:`target` changed.

        Args:
            units: work the task did (e.g. samples plus bytes over a constant).
            wall_s: the task's wall time.
            cpu_s: the CPU time its thread spent on it.
            now: ``time.monotonic()`` at its end.
        """
        if self.settled:
            return False
        self._units += units
        self._wall += wall_s
        self._cpu += cpu_s
        self._tasks += 1
        elapsed = now - self._start
        first = self._before is None
        waiting = first and self._tasks >= _PROBE_TASKS and self._wall >= self.wait_ratio * self._cpu
        if not waiting and (elapsed < self.window_s or self._tasks < self.window_tasks * self.target):
            return False
        rate = self._units / max(elapsed, 1e-9)
        threads = self.target
        before = self._before
        if before is None:
            # A backend that mostly waits gets every thread allowed; CPU-bound work at most two
            # threads per core (one in a system call or checksum while the other runs Python).
            self._ceiling = self.max_threads if waiting else min(2 * self.cores, self.max_threads)
            self._before = (threads, rate)
            self.target = self._ceiling if waiting else min(2 * threads, self._ceiling)
        elif rate >= self.gain * before[1]:
            self._before = (threads, rate)
            self.target = min(2 * threads, self._ceiling)
        else:
            self.target = before[0]
        self.settled = self.target == threads or (not first and self.target < threads)
        log.debug("threads %d -> %d (%.0f units/s)%s", threads, self.target, rate, ", settled" if self.settled else "")
        self._reset(now)
        return self.target != threads


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Crew(Generic[T]):
    """Runs ``work(task)`` for every task ``claim()`` hands out, on :attr:`tuner.target` threads.

    Args:
        claim: returns the next task, or ``None`` when there is none left; called from the worker
            threads, so it must be thread-safe.
        work: does one task and returns the units of work done (for the tuner).
        tuner: decides how many threads run.
        name: thread name prefix.
    """

    def __init__(
        self, claim: Callable[[], T | None], work: Callable[[T], float], tuner: ThreadTuner, *, name: str
    ) -> None:
        self.claim, self.work, self.tuner, self.name = claim, work, tuner, name
        self._cond = threading.Condition()
        self._live: set[int] = set()
        self._exhausted = False
        self._failure: BaseException | None = None
        self.peak_threads = 0

    def run(self, tick: Callable[[], None] | None = None, tick_s: float = 0.5) -> None:
        """Work until every task is done, calling ``tick()`` about every ``tick_s`` seconds.

        Raises:
            BaseException: whatever a ``work`` or ``claim`` call raised (the other threads stop
                taking tasks and are waited for first).
        """
        with self._cond:
            while True:
                if not self._exhausted:
                    for slot in range(self.tuner.target):
                        if slot not in self._live:
                            self._live.add(slot)
                            threading.Thread(
                                target=self._worker, args=(slot,), name=f"{self.name}-{slot}", daemon=True
                            ).start()
                    self.peak_threads = max(self.peak_threads, len(self._live))
                if self._exhausted and not self._live:
                    break
                self._cond.wait(tick_s)
                if tick is not None:
                    self._cond.release()
                    try:
                        tick()
                    finally:
                        self._cond.acquire()
        if self._failure is not None:
            raise self._failure

    def stop(self) -> None:
        """Take no more tasks: :meth:`run` returns once the tasks being done now are done."""
        with self._cond:
            self._exhausted = True
            self._cond.notify_all()

    def _worker(self, slot: int) -> None:
        try:
            while slot < self.tuner.target and not self._exhausted:
                task = self.claim()
                if task is None:
                    with self._cond:
                        self._exhausted = True
                    break
                t0, c0 = time.perf_counter(), time.thread_time()
                units = self.work(task)
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                with self._cond:
                    if self.tuner.record(units, wall, cpu, time.monotonic()):
                        self._cond.notify_all()
        except BaseException as exc:  # handed to run(), which re-raises it in the caller's thread
            with self._cond:
                self._failure = self._failure or exc
                self._exhausted = True
        finally:
            with self._cond:
                self._live.discard(slot)
                self._cond.notify_all()
