"""The preemption notice the training loop acts on: finish the step, checkpoint, stop (goodput.run.loop)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from goodput.resilience.signals import HELPER_ENV, PREEMPT_SIGNALS, GraceTimer


class StopSignal:
    """SIGTERM, SIGINT, SIGUSR1, SIGUSR2 (a preemption notice, however the scheduler sends it): finish
    the step, checkpoint, wait for the upload, exit 0.

    The flag is acted on at the next step boundary, which all ranks must reach. If they do not
    within `grace_s` (a peer died and this rank is stuck in a collective: the elastic agent sends
    SIGTERM to the survivors in exactly that case), exit at once so the restart is not delayed.
    A second signal exits at once too (a second Ctrl-C), except the same signal again within
    `dup_s`: that is the same notice by two routes (sent to the process group, and forwarded by the
    elastic agent's process, goodput.run.launch).
    """

    def __init__(self, grace_s: float, dup_s: float = 2.0):
        self.received = None
        self.grace_s, self.dup_s = grace_s, dup_s
        self._first = None  # (signum, monotonic time)
        self._grace = GraceTimer(grace_s, dup_s)  # runs even while the main thread is stuck in C++
        self._previous = {}
        self._env = os.environ.get(HELPER_ENV)
        os.environ[HELPER_ENV] = "1"
        for sig in PREEMPT_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave the default handlers
                pass

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self._first is not None:
            if signum == self._first[0] and now - self._first[1] < self.dup_s:
                return
            os._exit(128 + signum)
        self._first = (signum, now)
        self.received = signal.Signals(signum).name

    def agreed(self, world: int) -> bool:
        t = torch.tensor([1 if self.received else 0])
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if t.item():
            self._grace.cancel()  # every rank reached the boundary: the checkpoint can take its time
        return bool(t.item())

    def restore(self) -> None:
        """Put back the handlers found at start (SIG_DFL, or submitit's: see goodput.run.launch)."""
        for sig, h in self._previous.items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)
        self._previous = {}
        self._grace.close()
        if self._env is None:
            os.environ.pop(HELPER_ENV, None)
