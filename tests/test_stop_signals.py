"""Stop signals: a barrage of SIGTERMs stops a process once, never deadlocks it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

from kspeed.control.daemon import StopSignals
from kspeed.errors import StateError

BARRAGE = textwrap.dedent(
    """
    import os, signal, threading
    from kspeed.control.daemon import StopSignals

    signals = StopSignals()
    def barrage():
        for _ in range(20000):
            os.kill(os.getpid(), signal.SIGTERM)
    sender = threading.Thread(target=barrage)
    sender.start()
    while not signals.wait(0.5):
        pass
    while sender.is_alive():  # signals keep coming while the process winds down: noted, not fatal
        signals.wait(0.001)
    sender.join()
    print("stopped after", len(signals.received) > 0)
    """
)


def test_a_barrage_of_sigterms_stops_the_process_without_deadlock():
    # With a handler that sets a threading.Event, a second signal arriving inside the first
    # handler's Event.set waited for the lock that handler held: this script hung on the first run.
    done = subprocess.run([sys.executable, "-c", BARRAGE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped after True"


def test_wait_returns_once_a_signal_came_and_close_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals(signals=(signal.SIGTERM,))
    try:
        assert signals.wait(0.01) is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.wait(5.0) is True
        assert signals.received == [signal.SIGTERM]
        assert signals.wait(0.0) is True  # stays stopped
    finally:
        signals.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_it_must_be_made_on_the_main_thread():
    errors: list[BaseException] = []
    before = signal.getsignal(signal.SIGTERM)

    def make() -> None:
        try:
            StopSignals()
        except StateError as exc:
            errors.append(exc)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert [str(e) for e in errors] == [
        "stop signals are set up on the main thread (Python runs signal handlers there)"
    ]
    assert signal.getsignal(signal.SIGTERM) is before
