"""The preemption notice, on both sides: the training loop acts on it (StopSignal: finish the step,
checkpoint, stop), the elastic agent's process leaves it to the workers (LeaveStopToWorkers) and
hands it back to a handler installed before the run (hand_back). Both follow signals.Preemption."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time

import torch
import torch.distributed as dist

from goodput.resilience.signals import (
    DUPLICATE_WINDOW_S,
    HELPER_ENV,
    PREEMPT_SIGNALS,
    Action,
    GraceTimer,
    Preemption,
)

log = logging.getLogger(__name__)


class StopSignal:
    """SIGTERM, SIGINT, SIGUSR1, SIGUSR2 (a preemption notice, however the scheduler sends it): finish
    the step, checkpoint, wait for the upload, exit 0.

    The flag is acted on at the next step boundary, which all ranks must reach. If they do not
    within `grace_s` (a peer died and this rank is stuck in a collective: the elastic agent sends
    SIGTERM to the survivors in exactly that case), exit at once so the restart is not delayed.
    A second signal exits at once too (a second Ctrl-C), except the same signal again within
    `dup_s`: that is the same notice by two routes (sent to the process group, and forwarded by the
    elastic agent's process, LeaveStopToWorkers). The rule: signals.Preemption.
    """

    def __init__(
        self, grace_s: float, dup_s: float = DUPLICATE_WINDOW_S, last_words=None, notice: str | None = None
    ):
        """`last_words(reason)`: called before the grace runs out into an exit (a rescue). `notice`:
        the file where this node's elastic agent notes a notice it got (notice_file), read now."""
        self.received = None
        self.grace_s = grace_s
        self._notice = Preemption(dup_s)
        # runs even while the main thread is stuck in C++
        self._grace = GraceTimer(grace_s, dup_s, last_words=last_words)
        self._previous = {}
        self._env = os.environ.get(HELPER_ENV)
        os.environ[HELPER_ENV] = "1"
        for sig in PREEMPT_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave the default handlers
                pass
        # A notice the agent got before this worker listened (not yet forked, or still ignoring
        # signals as the forkserver does): the stop is agreed at the first boundary. Not counted
        # as a first signal: the agent's forwarded copy must not escalate into an exit.
        noted = read_notice(notice)
        if noted and self.received is None:
            self.received = noted

    def _handle(self, signum, frame):
        action = self._notice.notify(signum, time.monotonic())
        if action is Action.ESCALATE:
            os._exit(128 + signum)
        if action is Action.FIRST:
            self.received = signal.Signals(signum).name

    def agreed(self, world: int) -> bool:
        t = torch.tensor([1 if self.received else 0])
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if t.item():
            self._grace.cancel()  # every rank reached the boundary: the checkpoint can take its time
        return bool(t.item())

    def rescuing(self, last_words) -> StopSignal:
        """`last_words(reason)` from now on (the Trainer's rescue exists once it is built)."""
        self._grace.last_words = last_words
        return self

    def finishing(self) -> None:
        """The loop is over: a notice from now on has nothing to stop (the run is on its way out),
        so it starts no grace timer; a second signal still exits at once."""
        self._grace.cancel()

    def restore(self) -> None:
        """Put back the handlers found at start (SIG_DFL, or submitit's: see hand_back)."""
        for sig, h in self._previous.items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)
        self._previous = {}
        self._grace.close()
        if self._env is None:
            os.environ.pop(HELPER_ENV, None)


def hand_back(summary: dict | None, previous: dict, max_steps: int) -> None:
    """Whatever handled the preemption signals before the run (`previous`, signum -> handler;
    submitit: checkpoint + requeue + exit) gets the signal back once the loop has committed its
    checkpoint: requeueing stays its job."""
    name = (summary or {}).get("preempted")
    if name is None or summary["steps"] >= max_steps:  # finished anyway: nothing to requeue
        return
    handler = previous.get(getattr(signal, name or "", None))
    if callable(handler) and handler is not signal.default_int_handler:  # that one would raise
        log.info("checkpoint committed: passing %s on to the handler installed before the run", name)
        handler(getattr(signal, name), None)


NOTICE = "stop-notice"


def notice_file(run_dir: str) -> str:
    """Where the elastic agent of this node notes a preemption notice for its workers."""
    return os.path.join(run_dir, "elastic", NOTICE)


def read_notice(path: str | None) -> str | None:
    """The signal name noted at `path`, or None (no file, or not a preemption signal's name)."""
    if path is None:
        return None
    try:
        with open(path) as f:
            name = f.read(16).strip()
    except OSError:
        return None
    return name if name in {s.name for s in PREEMPT_SIGNALS} else None


def clear_notice(path: str) -> None:
    """A launch starts with no notice: one left by an earlier launch in the same run dir is not its."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class LeaveStopToWorkers:
    """While the elastic agent runs in this process: a preemption signal is the workers' to act on
    (they finish the step, checkpoint and exit 0, and the agent sees success). The agent's own
    handler would tear them down and exit non-zero, so it is kept off these signals (LaunchConfig
    signals_to_handle). A signal this process alone received is forwarded to the workers (a copy
    they also got from the process group counts once, see StopSignal); another signal later
    hands over to the agent's teardown, as its own handler would have done (Preemption's rule)."""

    def __init__(self, dup_s: float = DUPLICATE_WINDOW_S, notice: str | None = None):
        """`notice`: the file the first notice is noted in (notice_file), for workers that were
        not listening yet when it came; a signal forwarded to them then would be lost."""
        self._notice = Preemption(dup_s)
        self._notice_path = notice

    def __enter__(self):
        self._previous = {sig: signal.signal(sig, self._handle) for sig in PREEMPT_SIGNALS}
        # After a notice, a worker group that fails is not restarted: its workers were stuck (a
        # hang) and their grace timers ended them; new workers would train on into the kill.
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
        from torch.distributed.elastic.multiprocessing import SignalException

        self._agent_cls, self._restart = SimpleElasticAgent, SimpleElasticAgent._restart_workers
        guard = self

        def restart_unless_preempted(agent, worker_group):
            if guard._notice.first is not None:
                sig = signal.Signals(guard._notice.first[0])
                log.error("workers failed after %s: not restarting them, the job stops", sig.name)
                raise SignalException(f"preempted ({sig.name}) while the workers failed", sigval=sig)
            return guard._restart(agent, worker_group)

        SimpleElasticAgent._restart_workers = restart_unless_preempted
        return self

    def _handle(self, signum, frame):
        from torch.distributed.elastic.multiprocessing import SignalException

        action, sig = self._notice.notify(signum, time.monotonic()), signal.Signals(signum)
        if action is Action.DUPLICATE:
            return
        if action is Action.ESCALATE:
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)  # agent: shut down
        log.warning("received %s: asking the workers to checkpoint and stop", sig.name)
        if self._notice_path is not None:
            try:
                os.makedirs(os.path.dirname(self._notice_path), exist_ok=True)
                with open(self._notice_path, "w") as f:
                    f.write(sig.name)
            except OSError as e:  # the forwarded signal still reaches the workers that listen
                log.warning("could not note %s for the workers in %s: %s", sig.name, self._notice_path, e)
        for p in multiprocessing.active_children():  # the agent's workers (spawned by this process)
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass

    def __exit__(self, *exc):
        self._agent_cls._restart_workers = self._restart
        for sig, h in self._previous.items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)
