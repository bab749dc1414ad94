"""Preemption signals and helper processes: what the main process acts on, what its helpers ignore.

Standard library only: the entry script imports it first thing in a spawned helper, before any
other import can start a thread that would take a signal meant to be ignored.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import threading

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
DUPLICATE_WINDOW_S = 2.0  # one notice by two routes: sent to the process group, forwarded by the agent


class Action(enum.Enum):
    FIRST = "first"  # the notice: checkpoint and stop at the step boundary (or forward it)
    DUPLICATE = "duplicate"  # the same notice again by another route: nothing to do
    ESCALATE = "escalate"  # a second notice: stop now


class Preemption:
    """The rule for preemption signals, written once for every process that handles them (the
    worker's StopSignal and GraceTimer, the elastic agent's LeaveStopToWorkers).

    idle -> notified on the first signal (FIRST); the same signal again less than `dup_s` after the
    first is DUPLICATE, any other signal or a later one ESCALATE (-> escalated; the same rule keeps
    applying after it). Pure: the caller passes the clock's reading `now` and acts on the Action."""

    def __init__(self, dup_s: float = DUPLICATE_WINDOW_S):
        self.dup_s = dup_s
        self.first: tuple[int, float] | None = None  # (signal number, time) of the notice
        self.escalated = False

    @property
    def state(self) -> str:
        return "escalated" if self.escalated else "idle" if self.first is None else "notified"

    def notify(self, signum: int, now: float) -> Action:
        if self.first is None:
            self.first = (signum, now)
            return Action.FIRST
        if signum == self.first[0] and now - self.first[1] < self.dup_s:
            return Action.DUPLICATE
        self.escalated = True
        return Action.ESCALATE


# Set while the loop runs: a helper *spawned* meanwhile (DCP's async-checkpoint daemon with
# checkpoint.backend.async_type=process) imports the entry script as __mp_main__, which then calls
# obey_parent_only(). (A spawn child starts with an empty signal mask and default handlers.)
HELPER_ENV = "GOODPUT_HELPER_IGNORES_PREEMPTION"


def obey_parent_only() -> None:
    """For helper processes (DataLoader workers, DCP's daemon): a preemption signal from anyone but
    the parent is ignored (it was sent to the whole process group; the main process alone decides
    when to stop, and stops its helpers), one from the parent acts as usual (multiprocessing
    terminates daemonic children with SIGTERM at exit, DataLoader stuck workers too).

    SIG_IGN cannot tell the two apart; sigwaitinfo can, so the signals are blocked in every thread
    (threads started later inherit the mask) and one thread waits for them and reads the sender."""
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPT_SIGNALS)
    for sig in PREEMPT_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)  # what the parent's signal should do

    def wait() -> None:
        while True:
            info = signal.sigwaitinfo(PREEMPT_SIGNALS)
            if info.si_pid == parent:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [info.si_signo])  # this thread only
                os.kill(os.getpid(), info.si_signo)  # the default action: the process ends

    threading.Thread(target=wait, name="preemption-from-parent-only", daemon=True).start()


@contextlib.contextmanager
def signals_blocked():
    """Block the preemption signals in this thread while it starts helpers (DataLoader workers,
    background threads): a fork inherits the mask, so a signal sent to the whole process group
    stays pending in the new worker until its worker_init_fn takes it (obey_parent_only; a worker
    killed by it would fail the main process). Threads started meanwhile keep it blocked; the main
    thread's handler still acts, as other threads of this process take the signal for it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPT_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class GraceTimer:
    """The preemption grace period, started by the signal itself, not by a Python handler.

    Python runs a signal handler only when the main thread returns to the interpreter: a rank
    blocked in a C++ collective whose peer hung never does, so a timer started from the handler
    never starts. The C-level handler does write the signal's number to the wakeup fd
    (`signal.set_wakeup_fd`) at once, whatever the main thread does; a thread of ours reads it and
    runs the timer: after `grace_s`, the process exits (128 + signal) unless `cancel()` came first
    (every rank reached the step boundary); `last_words(reason)` first (a rescue of the last
    finished step: goodput.checkpoint.rescue). A second signal exits at once (Preemption's ESCALATE).
    Main thread only; elsewhere it does nothing."""

    def __init__(self, grace_s: float, dup_s: float = DUPLICATE_WINDOW_S, last_words=None):
        import socket

        self.grace_s, self.last_words = grace_s, last_words
        self._lock = threading.Lock()
        self._notice = Preemption(dup_s)
        self._cancelled = False
        self._timer = None
        self._old = None
        self._r, self._w = socket.socketpair()
        self._w.setblocking(False)
        try:
            self._old = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            self._r.close(), self._w.close()
            self._r = None
            return
        threading.Thread(target=self._run, name="preemption-grace", daemon=True).start()

    def _run(self) -> None:
        r = self._r  # (close() drops the attribute: this thread then reads the closed socket's end)
        while True:
            try:
                data = r.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in PREEMPT_SIGNALS:
                    self._on(signum)

    def _on(self, signum: int) -> None:
        import time

        now = time.monotonic()
        with self._lock:
            action = self._notice.notify(signum, now)
            if action is Action.DUPLICATE:
                return
            if action is Action.ESCALATE:
                os._exit(128 + signum)
            if not self._cancelled:
                self._timer = threading.Timer(self.grace_s, self._expire, args=(signum,))
                self._timer.daemon = True
                self._timer.start()

    def _expire(self, signum: int) -> None:
        if self.last_words is not None:  # bounded by its own timeout
            try:
                self.last_words(f"no step boundary {self.grace_s:g}s after {signal.Signals(signum).name}")
            except Exception:
                pass
        os._exit(128 + signum)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._timer is not None:
                self._timer.cancel()

    def close(self) -> None:
        if self._r is None:
            return
        signal.set_wakeup_fd(self._old if self._old is not None else -1)
        self._w.close()
        self._r.close()
        self._r = None
