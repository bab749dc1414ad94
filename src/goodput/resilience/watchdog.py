"""Hang watchdog: a rank that makes no progress for `trainer.hang_timeout_s` is ended, so the
ordinary restart path (the elastic agent, or a relaunch) takes over within seconds.

That bound is for progress between steps. The phases known to be long get their own: the start
until the first step is done (restore, a cold cache and the first fetch, warm-up), an evaluation
pass, a blocking save, and with `trainer.compile` the first step and first evaluation of each
process, which compile (`phase`). A slow phase is not a hang; a hang inside one is caught by its
bound. After the loop the worker stops the watchdog: the end of a run (model logging, the summary)
bounds its own waits (goodput.publish), and a finished run is never ended as hung.

The rank's main thread may be stuck anywhere: in a C++ collective whose peer hung, in a storage
request, waiting for a DataLoader worker. So the check runs on a thread of its own, which needs
nothing from the main thread (gloo, sleeps and socket waits release the GIL). Before the exit it
logs which rank, the last step done and what the rank was doing, dumps every Python thread's stack
(faulthandler, to stderr: the rank's log), and leaves a record beside the checkpoints so the next
attempt counts the stall as `hung` in the goodput ledger and its recovery starts at the stall.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import sys
import threading
import time

log = logging.getLogger(__name__)

HUNG_EXIT = 124  # the exit status of a rank ended for a hang (timeout(1)'s convention)
RECORDS = "faults"  # beside the fault markers: recovery reads the newest as the failure time


class Watchdog:
    """`beat(step)` after each step; `with phase(what)` around a known long phase; `doing(what)`
    names what the rank does now (each counts as progress). The time allowed without progress:
    `first_timeout_s` until the first beat, `timeout_s` between steps, `phase_timeout_s` inside a
    phase, plus `compile_timeout_s` inside one that compiles (0 when nothing is compiled)."""

    def __init__(
        self, timeout_s: float, first_timeout_s: float, rank: int, storage=None, attempt: int = 0,
        phase_timeout_s: float | None = None, compile_timeout_s: float = 0.0,
    ):  # fmt: skip
        self.timeout_s, self.first_timeout_s = timeout_s, max(first_timeout_s, timeout_s)
        self.phase_timeout_s = max(phase_timeout_s or 0.0, timeout_s)  # never below the step's
        self.compile_timeout_s = compile_timeout_s
        self.rank, self.storage, self.attempt = rank, storage, attempt
        self.step, self.what = None, "starting"
        # (last progress, the bound from it): one tuple, so the thread never pairs a new bound
        # with an old time
        self._since = (time.monotonic(), self.first_timeout_s)
        self._last_wall = time.time()
        self._stop = threading.Event()
        self._thread = None
        self.last_words = None  # called with the reason before the exit (a rescue: goodput.checkpoint.rescue)

    def start(self) -> Watchdog:
        if self.timeout_s and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int) -> None:
        self.step, self.what = step, f"after step {step}"
        self._progress(self.timeout_s)

    def doing(self, what: str) -> None:
        self.what = what
        self._progress(self._since[1])

    @contextlib.contextmanager
    def phase(self, what: str, compiles: bool = False):
        """A known long phase (an evaluation pass, a blocking save): until it ends the rank may go
        `phase_timeout_s` without progress (+ `compile_timeout_s` when it `compiles`), never less
        than the phase around it; its start and its end are progress."""
        outer_what, outer_bound = self.what, self._since[1]
        bound = self.phase_timeout_s + (self.compile_timeout_s if compiles else 0.0)
        self.what = what
        self._progress(max(bound, outer_bound))
        try:
            yield
        finally:
            self.what = outer_what
            self._progress(outer_bound)

    def stop(self) -> None:
        self._stop.set()

    def _progress(self, bound: float) -> None:
        self._since = (time.monotonic(), bound)
        self._last_wall = time.time()

    def _run(self) -> None:
        while not self._stop.wait(min(0.25, self.timeout_s / 4)):
            since, bound = self._since
            idle = time.monotonic() - since
            if idle > bound:
                self._fire(idle, bound)
                return

    def _fire(self, idle: float, bound: float) -> None:
        log.error(
            "hang watchdog: rank %d made no progress for %.1fs (limit %.0fs); last step done: %s; "
            "doing: %s. Python stacks of every thread follow; exiting (%d) for a restart.",
            self.rank, idle, bound, self.step, self.what, HUNG_EXIT,
        )  # fmt: skip
        for h in logging.getLogger().handlers:
            h.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        self._record(idle)
        if self.last_words is not None:  # bounded by its own timeout; the main thread is stuck
            try:
                self.last_words(self._message(idle))
            except Exception as e:
                log.error("hang watchdog: %r before the exit", e)
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            try:  # the error file the agent reports (what torch's @record leaves)
                from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

                ErrorHandler().record_exception(HangDetected(self._message(idle)))
            except Exception:
                pass
        os._exit(HUNG_EXIT)

    def _message(self, idle: float) -> str:
        return f"rank {self.rank}: no progress for {idle:.1f}s after step {self.step} ({self.what})"

    def _record(self, idle: float) -> None:
        """The stall's record (bounded: the store itself may be what hangs)."""
        if self.storage is None:
            return
        rec = {
            "time": self._last_wall,  # the stall began at the last progress
            "detected": time.time(),
            "rank": self.rank,
            "attempt": self.attempt,
            "step": self.step,
            "doing": self.what,
            "hung_seconds": idle,
        }
        path = f"{RECORDS}/hung-attempt{self.attempt}-rank{self.rank}.fired"
        th = threading.Thread(
            target=_quietly, args=(self.storage.write_bytes, path, json.dumps(rec).encode()), daemon=True
        )
        th.start()
        th.join(timeout=2.0)


class HangDetected(RuntimeError):
    pass


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:
        log.warning("could not record the hang: %r", e)


def hung_seconds(markers: dict[str, dict], since: float) -> float:
    """Seconds lost to stalls detected after wall time `since` (the restored checkpoint's save:
    the restored ledger holds none of them): per attempt, the longest stall any rank recorded."""
    per: dict[int, float] = {}
    for name, m in markers.items():
        if name.startswith("hung-") and m.get("detected", 0.0) > since:
            per[m["attempt"]] = max(per.get(m["attempt"], 0.0), float(m.get("hung_seconds", 0.0)))
    return sum(per.values())
