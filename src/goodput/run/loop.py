"""The training loop, top to bottom. It never asks which checkpoint, data or parallel backend it runs."""

from __future__ import annotations

import logging
import time

from goodput.resilience.accounting import sync_point
from goodput.run.evaluate import evaluate
from goodput.run.observe import gather_ranks, rank_stats
from goodput.run.progress import Progress

log = logging.getLogger(__name__)


def reduce_perf(step_s: float, fetch_s: float, images: int, world: int) -> dict:
    """Whole-job numbers from one all_gather per log window: images/s over the slowest rank; fetch
    seconds max and mean across ranks; step seconds max, median and the slowest rank (stragglers)."""
    g = gather_ranks([step_s, fetch_s, float(images)], world)  # row r: rank r
    step_s = g[:, 0].max().item()
    return {
        "perf/step_seconds": step_s,
        "perf/fetch_seconds": g[:, 1].max().item(),
        "perf/fetch_seconds_mean": g[:, 1].mean().item(),
        "perf/images_per_second": g[:, 2].sum().item() / step_s if step_s > 0 else 0.0,
        **rank_stats(g[:, 0]),
    }


def train(t) -> dict:
    """Run steps until trainer.max_steps (or a stop signal). `t` is a goodput.run.build.Trainer."""
    tr, d = t.cfg.trainer, t.dist
    max_steps = tr.max_steps
    log_every = max(1, tr.log_every_n_steps)
    eval_every = tr.eval_every_n_steps
    stop = t.stop  # the worker's StopSignal: installed since the start-up, put back after the run's end
    progress = Progress(tr.progress, tr.progress_every_s, t.loader.step, max_steps, d.rank)

    step = t.loader.step
    sync = sync_point(d.device)
    loss_val, val_acc, last_eval, early = float("nan"), None, None, False
    window = {"fetch": 0.0, "step": 0.0, "images": 0, "n": 0}

    def evaluation(step: int, counted: bool) -> None:
        """The evaluation after `step`. `counted`: it was counted already (best, early stopping) by
        the attempt that wrote the restored checkpoint: it runs again for the summary only."""
        nonlocal last_eval, val_acc, early
        te = time.perf_counter()
        # a phase with its own bound; the process's first evaluation compiles (inference graphs)
        with t.watchdog.phase(f"evaluation after step {step}", compiles=last_eval is None):
            metrics = t.task.metrics(t.loader.files.classes)  # the task's: goodput.recipe.metrics
            last_eval = evaluate(t.eval_module(), t.val_loader, d.device, d.world, metrics)
            compiling = t.compile_clock.take()  # a compiled model compiles again for inference
        t.goodput.add("compile", compiling)
        t.goodput.add("eval", time.perf_counter() - te - compiling)
        metrics = last_eval.compute()
        val_acc = metrics.get("val/accuracy")
        t.tracker.log(metrics, step)
        progress.evaluated(step, metrics)
        if not counted:
            t.ckpt.observe(metrics, step)  # checkpoint.keep_best_by
            early = t.early_stopping.update(metrics, step)  # the same on every rank: metrics are reduced

    def after(step: int, evaluating: bool, counted: bool = False) -> bool:
        """What follows a step: its evaluation, the stop agreement, the save. True: stop here."""
        if evaluating:
            evaluation(step, counted)
            t.rescue.boundary(step, evaluated=True, stop_reason="early_stopping" if early else None)

        stopping = stop.agreed(d.world)
        info = {"stop_reason": "early_stopping"} if early else None  # a relaunch then says: complete
        blocking = t.ckpt.maybe_save(step, t.app, last=step >= max_steps or stopping or early, info=info)
        if blocking is not None:
            t.goodput.add("checkpoint", blocking)
            t.tracker.log({"ckpt/blocking_seconds": blocking}, step)
        for m in t.ckpt.drain_metrics():
            t.tracker.log({k: v for k, v in m.items() if k != "ckpt/step"}, m["ckpt/step"])
        if stopping:
            log.warning("received %s: checkpointed step %d, stopping", stop.received, step)
        if early:
            log.warning("early stopping at step %d: %s", step, t.early_stopping.detail())
        return stopping or early

    t.model.train()
    t.rescue.boundary(step, evaluated=not t.evaluate_first)  # the restored (or initial) state
    # A rescue written before its step's evaluation was done: that evaluation first, as it would have
    # run. A rescue is never the end of a run: one of its last step (or of the step early stopping
    # stopped at) evaluates again for the summary, counted once, and makes the final regular commit.
    final = t.resumed_rescue and (step >= max_steps or t.early_stopping.stopped_at == step)
    early = final and t.early_stopping.stopped_at == step
    done = (t.evaluate_first or final) and after(step, evaluating=True, counted=not t.evaluate_first)
    t.evaluate_first = False  # done: the loop run again (after an in-process recovery) starts evaluated
    if t.ends_only:  # the final commit restored: the run's end again, with its evaluation; no save
        log.info("step %d is the run's final commit: writing the end of the run", step)
        evaluation(step, counted=True)
        done = True
    if not done and stop.agreed(d.world):  # a notice during the start-up: no step, nothing new to save
        log.warning("received %s during the start-up: stopping before step %d", stop.received, step + 1)
        done = True
    while step < max_steps and not done:
        t.rng.at_step(step)  # every random stream a function of (seed, rank, step): see RNGState
        t.profiler.at(step)  # trainer.profile_*: starts/stops the trace at a step boundary
        t0 = time.perf_counter()
        batch = next(t.loader)  # the accelerator idles for exactly this long
        t1 = time.perf_counter()
        x, y, w = t.batch(batch, step)  # the task's targets and weights; the batch transform
        loss = t.step(x, y, step, w)  # forward, backward, optimizer, EMA: goodput.run.step
        t.faults.slow_step()  # fault.slow_rank: inside the timed step, after the gradient sync
        step += 1
        sync()  # on CUDA: the step's kernels are done, so the clock reads what they took
        compiling = t.compile_clock.take()  # seconds of this step that were torch.compile
        t2 = time.perf_counter()
        evaluating = bool(eval_every and step % eval_every == 0) or step == max_steps
        t.rescue.boundary(step, evaluated=not evaluating)  # the update is done: a rescue may write it
        t.goodput.add("checkpoint", time.perf_counter() - t2)  # what noting the boundary costs

        t.goodput.add("fetch", t1 - t0)
        t.goodput.add("compile", compiling)
        t.goodput.add("productive", t2 - t1 - compiling)
        window["fetch"] += t1 - t0
        window["step"] += t2 - t0 - compiling  # perf/images_per_second: the step, not its compile
        window["images"] += len(y)
        window["n"] += 1
        t.faults.at_step(step)
        t.faults.site("step")

        if step % log_every == 0 or step == max_steps:
            loss_val = loss.item()
            n = window["n"]
            perf = reduce_perf(window["step"] / n, window["fetch"] / n, window["images"] // n, d.world)
            t.stragglers.check(perf, step)
            perf.update(t.mfu(perf))
            lr = t.scheduler.get_last_lr()[0]
            metrics = {"train/loss": loss_val, "train/lr": lr, **t.step.metrics()}
            t.tracker.log({**metrics, **perf}, step)
            t.tracker.log(t.loader.stats(), step)
            progress.logged(step, loss_val, lr, perf["perf/images_per_second"], perf["perf/fetch_seconds"])
            window = {"fetch": 0.0, "step": 0.0, "images": 0, "n": 0}
        t.step_done(step)  # how far this attempt got (lost work after a crash); async, never blocks
        progress.advance()
        done = after(step, evaluating)

    progress.close()
    t.profiler.stop()  # a run that ended inside the profiled steps still writes its trace
    # The end of the run (the last upload, the summary, the logged model) is not cut short by a
    # notice: it is this process's way out, and a kill half way leaves a complete run without them.
    # A second signal still exits at once; the worker puts the handlers back when it has written it.
    stop.finishing()
    tw = time.perf_counter()
    t.ckpt.wait()  # the last save must be committed before the process may exit
    t.goodput.add("checkpoint", time.perf_counter() - tw)
    for m in t.ckpt.drain_metrics():
        t.tracker.log({k: v for k, v in m.items() if k != "ckpt/step"}, m["ckpt/step"])
    reason = "early_stopping" if t.early_stopping.stopped_at == step < max_steps else None
    return {"steps": step, "final_loss": loss_val, "val_accuracy": val_acc, "preempted": stop.received,
            "stop_reason": reason, "evaluation": last_eval,
            "finished": step >= max_steps or reason is not None}  # fmt: skip  # else: stopped by a signal
