"""One rank of the job: build -> restore -> loop -> summary.

goodput.run.launch runs `worker(c, ctx)` in every rank's process (in the job process itself when there
is one rank and no restarts): the typed config and the launch's context from goodput.run.job.prepare.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from dataclasses import asdict

import torch
import torch.distributed as dist

from goodput import logs, provenance, publish, tracking
from goodput.checkpoint.layout import step_dir
from goodput.checkpoint.resume import init_from, resume
from goodput.config import Config
from goodput.errors import UserError
from goodput.model import model_sha256
from goodput.parallel import init_distributed, shutdown_distributed
from goodput.resilience.accounting import plot, process_start, restart_round
from goodput.resilience.lock import LockLost
from goodput.resilience.preemption import StopSignal, notice_file
from goodput.resilience.recovery import Recovery
from goodput.resilience.signals import HELPER_ENV, PREEMPT_SIGNALS
from goodput.run import loop, refusal
from goodput.run.build import Trainer, storage
from goodput.run.context import RunContext
from goodput.storage.local import atomic_write

log = logging.getLogger("goodput")


def worker(c: Config, ctx: RunContext, spares=None) -> dict | None:
    """One rank of the job. Returns the summary on rank 0. `spares`: parallel.spares' side of this
    process (goodput.run.spares.Member): a rank that recovers onto a spare when a peer dies, or a
    spare (`spares.waiting`) that builds, waits, and becomes the rank whose place it takes."""
    _process_defaults(c)
    # Start-up counts from the job process's start (imports included); after an elastic restart,
    # from this worker's: the gap since the crash is lost time.
    first = restart_round() == 0
    t_start = ctx.job_start if first else process_start()
    recovery = Recovery()
    # The StopSignal marks this process's helpers while it is installed (HELPER_ENV); left behind, a
    # job launched later from this process (an in-process search's next trial) would pass it on to
    # its forkserver, which would then block the preemption signals of every rank it forks. Put
    # back below, on every way out but fail_fast's exit.
    helper_env = os.environ.get(HELPER_ENV)
    recovery.mark("imports_done")  # this module is imported before `worker` is called
    # a spare's group is its own (world 1) until it takes a rank's place
    d = init_distributed(c.parallel.init_timeout_s, trace_dir=os.path.join(ctx.run_dir, "flight_recorder"))
    recovery.mark("pg_ready")
    spare = spares is not None and spares.waiting
    logs.setup(spares.name if spare else d.rank, ctx.run_dir)
    notice = notice_file(ctx.run_dir)  # this node's: its agent notes a notice there
    ctx = ctx if spare else _rank0_view(ctx, d)
    t, status, error = None, "FAILED", None

    def end_run(status: str, error: BaseException) -> None:  # before the Trainer (its tracker) exists
        if d.rank == 0 and not spare:
            tracking.end_run(c.mlflow.tracking_uri, ctx.mlflow_run_id, error, status, c.mlflow.end_timeout_s)

    # From here a preemption notice is the run's: noted and acted on by the loop (before its first
    # step, when it came during the start-up), not a death that leaves the MLflow run RUNNING. (Not
    # earlier: a rank waiting for a dead peer's process group is ended by the agent's SIGTERM at once.)
    stop = StopSignal(c.trainer.signal_grace_seconds, notice=notice)
    try:
        if spare:  # built, then a rank once a dead one's place is taken (None: told to exit)
            t = spares.take_place(c, ctx, d, stop)
            if t is None:
                status = "FINISHED"
                return None
            result = spares.train(t, loop.train)
            summary = _finish(t, result, spares)
            status = "FINISHED" if result["finished"] else "KILLED"
            return summary
        t = Trainer(c, ctx, d, recovery)
        t.watchdog.start()  # a restore that hangs is caught too (bound: parallel.init_timeout_s)
        if first:  # what the run is, uploaded in the background (mlflow.artifact_timeout_s)
            t.tracker.log_dict(ctx.identity, "identity.json")  # the identity digest's keys
            t.tracker.log_dict(ctx.code, "code.json")  # the code's files (goodput.provenance)
            if (ctx.code.get("git") or {}).get("dirty"):  # the uncommitted edits it trains with
                t.tracker.log_text(provenance.git_diff() or "", "code.diff")
        recovery.mark("built")
        rec, touched = resume(t.ckpt, t.app, c.run.resume, ahead=t.loader.start_at)
        recovery.mark("checkpoint_read")
        if touched:  # a failed load may have written into the live state: rebuild it fresh
            t.close()
            t = Trainer(c, ctx, d, recovery)
            t.watchdog.start()
        init_from(
            t.ckpt, t.app, rec, c.run.init_from, t.spec.classes, lambda url: storage(c, url), t.spec.node
        )
        t.stop = stop.rescuing(t.rescue.request)  # a rank stuck past the grace rescues the last step first
        t.evaluate_first = bool(rec and rec.get("evaluate_first"))  # a rescue before its step's evaluation
        t.resumed_rescue = bool(rec and rec.get("kind") == "rescue")
        # the final regular commit (or early stopping's): the job let it through because the run's
        # end was never written (goodput.run.job), or an elastic restart came after it
        complete = bool(rec) and (rec["step"] >= c.trainer.max_steps or bool(rec.get("stop_reason")))
        t.ends_only = complete and not t.resumed_rescue
        t.goodput.spares = spares is not None
        begin_attempt(t, rec, t_start)
        recovery.mark("ready")
        if spares is not None:
            spares.attach(t)
        result = loop.train(t) if spares is None else spares.train(t, loop.train)
        summary = _finish(t, result, spares)
        status = "FINISHED" if result["finished"] else "KILLED"  # KILLED: stopped by a signal, resumable
        return summary
    except BaseException as e:
        status, error = "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED", e
        if t is not None and not isinstance(e, KeyboardInterrupt | SystemExit):
            t.watchdog.stop()  # the rescue bounds itself (checkpoint.rescue_timeout_s)
            if not isinstance(e, LockLost):  # the run is another job's now: nothing more is written
                t.rescue.write(f"{type(e).__name__}: {e}")  # a peer died, or this rank's step raised
        if os.environ.get("TORCHELASTIC_RUN_ID") and not isinstance(e, KeyboardInterrupt | SystemExit):
            rank = t.dist.rank if t is not None else d.rank
            fail_fast(e, t.tracker.close if t is not None else end_run, ctx.run_dir, rank)
        raise
    finally:
        if t is not None:
            t.close()
            t.tracker.close(status, error, hint=_after_missed(status))
        else:  # the build failed (a bad _target_, a data error)
            end_run(status, error)
        stop.restore()  # after the MLflow run's end: a notice never cuts the run's end short
        shutdown_distributed()
        if helper_env is None:
            os.environ.pop(HELPER_ENV, None)


def _finish(t: Trainer, result: dict, spares=None) -> dict | None:
    """The end of the run on every rank: the summary on rank 0 (returned), the spares still waiting
    told to exit (parallel.spares)."""
    t.watchdog.stop()  # training is over: the end of the run bounds its own waits (write_summary)
    t.tracker.end_starts()  # the model, the files, the last metrics, the state: mlflow.end_timeout_s
    result["model_sha256"] = model_sha256(t.model)  # collective under FSDP: every rank calls it
    if spares is not None:
        spares.finish(t)  # the last recovery's record written; rank 0: the waiting spares exit
    summary = write_summary(t, result) if t.dist.rank == 0 else None
    if t.stop.received and not result["preempted"]:
        log.warning("received %s after the last step: wrote the end of the run first", t.stop.received)
    return summary


def _after_missed(status: str) -> str:
    """What the warning of an MLflow run's end that was not logged in time adds: what follows."""
    if status == "FINISHED":
        return ("The run is complete (the checkpoint holds the model, summary.json is written); the "
                "next launch of the same command logs its end and ends the MLflow run FINISHED")  # fmt: skip
    return "The next launch of the same command closes the MLflow run and continues it"


def _process_defaults(c: Config) -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in PREEMPT_SIGNALS:  # a worker from the forkserver inherits SIG_IGN (forkserver_init):
            if signal.getsignal(sig) == signal.SIG_IGN:  # the StopSignal takes them next (main
                signal.signal(sig, signal.SIG_DFL)  # thread only: elsewhere a stop ends the process)
    logs.setup()  # goodput.logs: the job's one format (an elastic worker starts with no handler)
    torch.set_num_threads(c.trainer.num_threads)
    if c.trainer.deterministic:
        # cuBLAS is deterministic only with a fixed workspace, set before its first use; without
        # it every matmul on CUDA raises under use_deterministic_algorithms. (CPU: unused.)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def _rank0_view(ctx: RunContext, d) -> RunContext:
    if d.world > 1:  # external launchers: rank 0's MLflow run, run dir and run lock are the job's
        shared = [ctx.mlflow_run_id, ctx.run_dir, ctx.lock_token]
        dist.broadcast_object_list(shared, src=0)
        ctx = ctx.with_rank0(*shared)
    if d.rank != 0:  # rank hygiene: warnings and errors only
        logging.getLogger().setLevel(logging.WARNING)
    return ctx


def begin_attempt(t: Trainer, rec: dict | None, t_start: float) -> int:
    """The run's record of this start (goodput.resilience.bookkeeping), then the fault drills armed
    for it (each seeded by the attempt). Returns the number of restarts so far."""
    restarts = t.goodput.begin(rec, t_start)
    t.watchdog.attempt = restarts
    arm_faults(t, restarts + t.goodput.in_process)
    return restarts


def arm_faults(t: Trainer, failures: int) -> None:
    """The random fault drills of this process's life, seeded by the failures recovered so far (the
    restarts, and the in-process recoveries onto a spare: a spare that takes the killed rank's place
    draws the next kill)."""
    f = t.cfg.fault
    t.faults.arm_random(f.mtbf_seconds, f.max_kills, t.cfg.seed, failures)
    t.faults.arm_chaos(f.chaos_p, f.chaos_seed, f.max_kills, failures)


def write_summary(t: Trainer, result: dict) -> dict:
    """Rank 0: summary.json, the goodput ledger and plot, and the run's artifacts in MLflow."""
    c, run_dir = t.cfg, t.ctx.run_dir
    ev = result.pop("evaluation", None)
    books = t.goodput.summary(result["steps"])  # training is over: what follows is not counted
    goodput = books["goodput"]
    model_uri = None
    if result["finished"]:  # a stopped run's weights are not its result: logged when it finishes
        # The logged model's input example (its signature): two samples of the val view
        example = next(iter(t.val_loader))["image"][:2].repeat(2, 1, 1, 1)[:2]
        bound = t.tracker.upload_timeout()  # within mlflow.end_timeout_s (the worker's end_starts)
        model_uri = publish.log_model(
            c, t.ctx.mlflow_run_id, t.ckpt, example, t.spec, bound, t.tracker.missed
        )
    summary = {
        **result,
        "val": ev.compute() if ev is not None else None,
        "best_step": t.ckpt.best.step,  # checkpoint.keep_best_by (null when off)
        "best_value": t.ckpt.best.value,
        "best_checkpoint": t.ckpt_store.url(step_dir(t.ckpt.best.step)) if t.ckpt.best.step else None,
        "stop_detail": t.early_stopping.detail() if result["stop_reason"] else None,
        "sample_order_sha256": t.loader.chain.hexdigest,
        **books,  # restarts, resumed_from_steps, goodput, recovery, compile
        "mlflow_run_id": t.ctx.mlflow_run_id,
        "mlflow_model_uri": model_uri,
        "checkpoint_dir": t.ckpt_store.url(),
        "last_committed_step": t.ckpt.last_committed_step,
        "world_size": t.dist.world,
        "config": {k: asdict(getattr(c, k)) for k in ("checkpoint", "data", "parallel")},
    }
    atomic_write(os.path.join(run_dir, "summary.json"), json.dumps(summary, indent=2, default=str).encode())
    t.tracker.log({f"goodput/{k}": v for k, v in goodput.items()}, result["steps"])
    t.tracker.log({"summary/val_accuracy": result["val_accuracy"] or 0.0}, result["steps"])
    plot(goodput, os.path.join(run_dir, "goodput.png"))
    files = [(os.path.join(run_dir, "summary.json"), None), (os.path.join(run_dir, "goodput.png"), None)]
    if ev is not None:  # the last evaluation's report (classification: per-class table, confusion matrix)
        files += [(p, "evaluation") for p in ev.report(os.path.join(run_dir, "evaluation"))]
    for path, folder in files:  # queued: the tracker's close waits for them (mlflow.end_timeout_s)
        t.tracker.artifact(path, folder)
    if os.path.isdir(hydra_dir := os.path.join(run_dir, ".hydra")):
        t.tracker.artifacts(hydra_dir, "hydra")
    return summary


def fail_fast(e: BaseException, end_run, run_dir: str, rank: int) -> None:
    """A rank that failed under the elastic agent (usually: a peer died in a collective) has one job
    left: exit, because the agent restarts nobody until every rank of the group is gone. Python's
    own teardown (DataLoader workers joined, prefetch threads drained) takes seconds, and waiting
    for a checkpoint in flight can hang: its commit needs the dead peer (until the SIGTERM grace
    runs out; docs/benchmarks.md, "Recovery"). A save that did not commit is cleaned up by the next
    attempt. So: end the MLflow run FAILED (`end_run(status, error)`; its queue flushed; at most 2 s),
    leave the error file the agent reports (as torch's @record would), and exit at once. A refusal
    (UserError) is no reason to restart: it is left for the agent's process to print as one line
    (goodput.run.refusal), exit REFUSED."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    status = 1
    try:
        if isinstance(e, UserError):
            refusal.report(e, run_dir, rank)
            status = refusal.REFUSED
        else:
            log.error("rank failed, exiting for a restart: %r", e, exc_info=e)
        flush = threading.Thread(target=end_run, args=("FAILED", e), daemon=True)
        flush.start()
        flush.join(timeout=2)
        ErrorHandler().record_exception(e)
    except BaseException as cleanup:
        log.error("while failing: %r", cleanup)
    finally:
        for h in logging.getLogger().handlers:
            h.flush()
        os._exit(status)
