"""Start the job's processes: in this process, or elastic workers through torch.distributed.

- RANK/WORLD_SIZE already set (torchrun, a SLURM srun wrapper): this process is one rank; run it
  (under torchrun with `parallel.spares`: host it and spares, goodput.run.spares.under_agent).
- One process and no restarts wanted: run in this process.
- Otherwise: torch.distributed's elastic agent (what torchrun uses) starts `nproc_per_node` workers
  on this machine and restarts the whole group up to `max_restarts` times when one dies; each
  restart resumes from the newest committed checkpoint. With `parallel.spares`, each worker is a
  host of its rank's process and of spares (goodput.run.spares): a rank that dies is replaced by a
  spare without a restart, and what cannot be recovered that way restarts the group as before.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import uuid

from goodput.config import Config
from goodput.parallel import free_port
from goodput.resilience.preemption import LeaveStopToWorkers, clear_notice, hand_back, notice_file
from goodput.resilience.recovery import AgentPhases
from goodput.resilience.signals import PREEMPT_SIGNALS
from goodput.run import spares
from goodput.run.context import RunContext
from goodput.run.refusal import NoRestartOnRefusal
from goodput.run.worker import worker


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
            "torchvision.transforms.v2",  # the data pipeline's transforms (imported when first built)
            "goodput.run.worker",
            "mlflow.store.tracking.sqlalchemy_store",
            "goodput.resilience.forkserver_frozen",  # last: freezes what the imports above made
        ]
    )


def launch(c: Config, ctx: RunContext) -> dict | None:
    # Whatever handled the preemption signals before us (submitit: checkpoint + requeue + exit)
    # gets the signal back once the loop has committed its checkpoint: requeueing stays its job.
    previous = {sig: signal.getsignal(sig) for sig in PREEMPT_SIGNALS}
    clear_notice(notice_file(ctx.run_dir))  # an earlier launch's, in the same run dir
    par = c.parallel
    spare = spares.settings(c)  # parallel.spares (None: none, or none can help here)
    if external_world() and spare is not None:  # torchrun: this worker hosts its rank and spares
        summary = spares.under_agent(c, ctx, spare, preload_forkserver)
    elif external_world() or (par.nproc_per_node == 1 and par.max_restarts == 0):
        summary = worker(c, ctx)
    else:
        summary = _elastic(c, ctx, spare)
    hand_back(summary, previous, c.trainer.max_steps)
    return summary


def _elastic(c: Config, ctx: RunContext, spare: spares.Spares | None = None) -> dict | None:
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
        signals_to_handle="SIGHUP,SIGQUIT",  # TERM, INT, USR1, USR2: LeaveStopToWorkers
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(ctx.run_dir, "elastic")),
    )
    try:
        stop = LeaveStopToWorkers(notice=notice_file(ctx.run_dir))  # noted for workers not listening yet
        with stop, NoRestartOnRefusal(ctx.run_dir):  # a UserError: one line, exit 2
            if spare is None:
                results = elastic_launch(lc, worker)(c, ctx)
            else:  # each worker hosts its rank's process and spares: the agent sees no rank die
                results = elastic_launch(lc, spares.host)(c, ctx, spare)
    except RendezvousError as e:
        raise RendezvousUnreachable(
            f"could not join the rendezvous at {endpoint} (parallel.rdzv_endpoint) within "
            f"parallel.rdzv_timeout_s={par.rdzv_timeout_s}s: {e} ({e.__cause__ or 'no detail'})"
        ) from e
    if spare is not None:  # rank 0's process may have run on any host (a spare took its place)
        return next((s for s in results.values() if s is not None), None)
    return results.get(0)
