"""Preemption signals and helper processes: what the main process acts on, what its helpers ignore.

Standard library only: the entry script imports it first thing in a spawned helper, before any
other import can start a thread that would take a signal meant to be ignored.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
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
