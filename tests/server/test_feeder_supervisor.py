"""The main process's commands to a feeder process that exited fail with an error naming the
feeder and the command, whether or not the command waits for a reply (no daemon)."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import numpy as np
import pytest

from kspeed.errors import UnavailableError
from kspeed.server.feeder.protocol import Place
from kspeed.server.feeder.supervisor import FeederSupervisor, _Feeder


@pytest.fixture
def exited():
    """A supervisor whose one feeder process exited with status 3."""
    ctx = mp.get_context("fork")  # (it only exits: no thread of ours runs in it)
    ours, theirs = ctx.Pipe()
    events, their_events = ctx.Pipe(duplex=False)
    process = ctx.Process(target=os._exit, args=(3,), daemon=True)
    process.start()
    theirs.close()
    their_events.close()
    process.join(30)
    supervisor = FeederSupervisor.__new__(FeederSupervisor)  # (only its command path is used)
    supervisor._feeders = [_Feeder(process, ours, events, threading.Lock())]
    yield supervisor
    ours.close()
    events.close()


def place(*, quiet: bool) -> Place:
    one = np.zeros(1, np.int64)
    return Place("f", 1, one, one - 1, one, one, quiet=quiet)


@pytest.mark.parametrize("quiet", [False, True])
def test_a_command_to_a_feeder_that_exited_fails_naming_it(exited, quiet):
    with pytest.raises(UnavailableError, match=r"feeder process 0 exited \(status 3\): Place not delivered"):
        exited._command(0, place(quiet=quiet))
