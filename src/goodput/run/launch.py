"""Start the job's processes: in this process, or elastic workers through torch.distributed.

- RANK/WORLD_SIZE already set (torchrun, a SLURM srun wrapper): this process is one rank; run it.
- One process and no restarts wanted: run in this process.
- Otherwise: torch.distributed's elastic agent (what torchrun uses) starts `nproc_per_node` workers
  on this machine and restarts the whole group up to `max_restarts` times when one dies; each
  restart resumes from the newest committed checkpoint.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import uuid

from goodput.config import Config
from goodput.parallel import free_port
from goodput.resilience.recovery import AgentPhases
from goodput.resilience.signals import PREEMPT_SIGNALS
from goodput.run.context import RunContext
from goodput.run.worker import worker

log = logging.getLogger(__name__)


class RendezvousUnreachable(RuntimeError):
    pass


def external_world() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def preload_forkserver() -> None:
    """Workers are forked from a forkserver that has already imported torch and this package: a
    restart then costs a fork (tens of ms) instead of a new interpreter importing torch (seconds).
    The forkserver is a clean single-threaded process (no inherited threads, locks or CUDA state,
    which is why workers are not forked from this process). The preload must be set here, in the
    process that owns the forkserver (the elastic agent's), before it first starts."""
    # MLflow's SQL store is imported on the first client (about a second): preload it too.
    multiprocessing.set_forkserver_preload(
        [
            "goodput.resilience.forkserver_init",
            "torch",
            "goodput.run.worker",
            "mlflow.store.tracking.sqlalchemy_store",
        ]
    )


def launch(c: Config, ctx: RunContext) -> dict | None:
    # Whatever handled the preemption signals before us (submitit: checkpoint + requeue + exit)
    # gets the signal back once the loop has committed its checkpoint: requeueing stays its job.
    previous = {sig: signal.getsignal(sig) for sig in PREEMPT_SIGNALS}
    par = c.parallel
    if external_world() or (par.nproc_per_node == 1 and par.max_restarts == 0):
        summary = worker(c, ctx)
    else:
        summary = _elastic(c, ctx)
    _hand_back(summary, previous, c.trainer.max_steps)
    return summary


def _hand_back(summary: dict | None, previous: dict, max_steps: int) -> None:
    name = (summary or {}).get("preempted")
    if name is None or summary["steps"] >= max_steps:  # finished anyway: nothing to requeue
        return
    handler = previous.get(getattr(signal, name or "", None))
    if callable(handler) and handler is not signal.default_int_handler:  # that one would raise
        log.info("checkpoint committed: passing %s on to the handler installed before the run", name)
        handler(getattr(signal, name), None)


class _LeaveStopToWorkers:
    """While the elastic agent runs in this process: a preemption signal is the workers' to act on
    (they finish the step, checkpoint and exit 0, and the agent sees success). The agent's own
    handler would tear them down and exit non-zero, so it is kept off these signals (LaunchConfig
    signals_to_handle). A signal this process alone received is forwarded to the workers (a copy
    they also got from the process group counts once, see loop.StopSignal); another signal later
    hands over to the agent's teardown, as its own handler would have done."""

    def __init__(self, dup_s: float = 2.0):
        self.dup_s, self._first = dup_s, None

    def __enter__(self):
        self._previous = {sig: signal.signal(sig, self._handle) for sig in PREEMPT_SIGNALS}
        # After a notice, a worker group that fails is not restarted: its workers were stuck (a
        # hang) and their grace timers ended them; new workers would train on into the kill.
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
        from torch.distributed.elastic.multiprocessing import SignalException

        self._agent_cls, self._restart = SimpleElasticAgent, SimpleElasticAgent._restart_workers
        guard = self

        def restart_unless_preempted(agent, worker_group):
            if guard._first is not None:
                sig = signal.Signals(guard._first[0])
                log.error("workers failed after %s: not restarting them, the job stops", sig.name)
                raise SignalException(f"preempted ({sig.name}) while the workers failed", sigval=sig)
            return guard._restart(agent, worker_group)

        SimpleElasticAgent._restart_workers = restart_unless_preempted
        return self

    def _handle(self, signum, frame):
        from torch.distributed.elastic.multiprocessing import SignalException

        now, sig = time.monotonic(), signal.Signals(signum)
        if self._first is not None:
            if self._first[0] == signum and now - self._first[1] < self.dup_s:
                return
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)  # agent: shut down
        self._first = (signum, now)
        log.warning("received %s: asking the workers to checkpoint and stop", sig.name)
        for p in multiprocessing.active_children():  # the agent's workers (spawned by this process)
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass

    def __exit__(self, *exc):
        self._agent_cls._restart_workers = self._restart
        for sig, h in self._previous.items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)


def _elastic(c: Config, ctx: RunContext) -> dict | None:
    par = c.parallel

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    preload_forkserver()
    AgentPhases(ctx.run_dir).install()  # when the agent saw a failure, stopped, re-rendezvoused
    endpoint = par.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    lc = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=par.nproc_per_node,
        run_id=f"goodput-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_timeout=par.rdzv_timeout_s,
        rdzv_configs={"join_timeout": par.rdzv_timeout_s, "read_timeout": min(60, par.rdzv_timeout_s)},
        max_restarts=par.max_restarts,
        monitor_interval=0.1,  # torchrun's default: a dead worker is noticed within 0.1 s
        start_method="forkserver",  # see preload_forkserver
        signals_to_handle="SIGHUP,SIGQUIT",  # TERM, INT, USR1, USR2: _LeaveStopToWorkers
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(ctx.run_dir, "elastic")),
    )
    try:
        with _LeaveStopToWorkers():
            results = elastic_launch(lc, worker)(c, ctx)
    except RendezvousError as e:
        raise RendezvousUnreachable(
            f"could not join the rendezvous at {endpoint} (parallel.rdzv_endpoint) within "
            f"parallel.rdzv_timeout_s={par.rdzv_timeout_s}s: {e} ({e.__cause__ or 'no detail'})"
        ) from e
    return results.get(0)
