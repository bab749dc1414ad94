"""helpers.turn, the lock that runs `serial` tests alone under pytest-xdist: parallel tests side by
side, a serial one alone, and a serial one waiting is not overtaken by tests that arrive after it.
Threads stand in for the workers (flock locks belong to each open(), so two threads conflict)."""

from __future__ import annotations

import fcntl
import threading
import time

import pytest
from helpers import Turns, turn


class OnThread:
    """A test on its own thread: enters its turn, records when, holds it until released."""

    def __init__(self, lock_dir, name: str, serial: bool, entered: list):
        self.release, self.inside = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(lock_dir, name, serial, entered), daemon=True)
        self.thread.start()

    def _run(self, lock_dir, name, serial, entered):
        with turn(lock_dir, serial):
            entered.append(name)
            self.inside.set()
            self.release.wait(30)

    def done(self):
        self.release.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


def held(path) -> bool:
    """Whether another open file holds `path` exclusively (flock, non-blocking probe)."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_parallel_tests_run_side_by_side(tmp_path):
    entered = []
    a = OnThread(tmp_path, "a", False, entered)
    assert a.inside.wait(10)
    b = OnThread(tmp_path, "b", False, entered)
    assert b.inside.wait(10)  # while a is still inside
    a.done()
    b.done()


@pytest.mark.parametrize("first, then", [(True, False), (False, True)], ids=["serial-first", "serial-second"])
def test_a_serial_test_runs_alone(tmp_path, first, then):
    """Whichever comes first, the second waits until it is done."""
    entered = []
    a = OnThread(tmp_path, "a", first, entered)
    assert a.inside.wait(10)
    b = OnThread(tmp_path, "b", then, entered)
    assert not b.inside.wait(0.5)
    a.done()
    assert b.inside.wait(10)
    b.done()


def test_a_waiting_serial_test_is_not_overtaken(tmp_path):
    """Without the gate, the parallel tests of a busy worker would keep the room shared forever."""
    entered = []
    first = OnThread(tmp_path, "first", False, entered)
    assert first.inside.wait(10)
    s = OnThread(tmp_path, "serial", True, entered)
    wait_until(lambda: held(tmp_path / "gate"))  # the serial test is waiting for the room
    late = OnThread(tmp_path, "late", False, entered)
    assert not late.inside.wait(0.5)  # arrived after the serial test: waits behind it
    first.done()
    assert s.inside.wait(10)
    assert not late.inside.wait(0.3)
    s.done()
    assert late.inside.wait(10)
    late.done()
    assert entered == ["first", "serial", "late"]


def test_a_workers_next_serial_test_keeps_the_room(tmp_path):
    """Worker A runs two serial tests in a row; worker B's parallel test, arriving during the first,
    enters only after the second: released in between, the room would have gone to B's test and
    A's second serial test would have waited for it."""
    entered, go = [], [threading.Event(), threading.Event()]
    turns = Turns(tmp_path)

    def worker_a():
        for i, nxt in enumerate([True, False]):
            with turns.around(serial=True, next_serial=nxt):
                entered.append(f"serial{i}")
                go[i].wait(30)

    a = threading.Thread(target=worker_a, daemon=True)
    a.start()
    wait_until(lambda: entered == ["serial0"])
    b = OnThread(tmp_path, "b", False, entered)
    assert not b.inside.wait(0.3)
    go[0].set()
    wait_until(lambda: entered == ["serial0", "serial1"])
    assert not b.inside.wait(0.3)  # still A's turn
    go[1].set()
    assert b.inside.wait(10)
    b.done()
    a.join(10)
    assert entered == ["serial0", "serial1", "b"]
