"""Crew and thread tuner: every task once, failures surface, thread counts follow the backend."""

from __future__ import annotations

import threading

import pytest

from kspeed.server.hosting.crew import Crew, ThreadTuner


def feed(tuner, tasks, *, units, wall, cpu, dt):
    """Record ``tasks`` finished tasks, ``dt`` seconds apart; returns the targets seen."""
    now, seen = 0.0, []
    for _ in range(tasks):
        now += dt
        tuner.record(units, wall, cpu, now)
        seen.append(tuner.target)
    return seen


def test_a_waiting_backend_gets_every_thread_at_once():
    tuner = ThreadTuner(32, cores=2)
    tuner._reset(0.0)
    feed(tuner, 2, units=1, wall=0.004, cpu=0.0001, dt=0.004)
    assert tuner.target == 32


def test_cpu_bound_work_doubles_while_it_pays_and_stops_at_two_per_core():
    tuner = ThreadTuner(32, cores=2, window_s=0.001, window_tasks=1)
    tuner._reset(0.0)
    feed(tuner, 1, units=1, wall=0.001, cpu=0.001, dt=0.002)
    assert tuner.target == 2
    feed(tuner, 2, units=2, wall=0.001, cpu=0.001, dt=0.002)  # twice the rate: keep, try 4
    assert tuner.target == 4
    feed(tuner, 4, units=4, wall=0.001, cpu=0.001, dt=0.002)  # twice again, but 4 is the ceiling
    assert tuner.target == 4 and tuner.settled


def test_a_step_that_does_not_pay_is_undone():
    tuner = ThreadTuner(32, cores=2, window_s=0.001, window_tasks=1)
    tuner._reset(0.0)
    feed(tuner, 1, units=1, wall=0.001, cpu=0.001, dt=0.002)
    feed(tuner, 2, units=0.5, wall=0.001, cpu=0.001, dt=0.002)  # the GIL made two threads slower
    assert tuner.target == 1 and tuner.settled


def test_crew_does_every_task_once_and_reraises_failures():
    tasks = iter(range(500))
    lock = threading.Lock()
    done = []

    def claim():
        with lock:
            return next(tasks, None)

    def work(t):
        with lock:
            done.append(t)
        return 1.0

    tuner = ThreadTuner(8, cores=2, window_s=0.0, window_tasks=1)
    Crew(claim, work, tuner, name="t").run(tick_s=0.01)
    assert sorted(done) == list(range(500))

    def broken(t):
        raise ValueError(f"task {t}")

    with pytest.raises(ValueError, match="task"):
        Crew(iter(range(10)).__next__, broken, ThreadTuner(4), name="t").run(tick_s=0.01)
