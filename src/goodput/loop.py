"""The training loop, top to bottom. It never asks which checkpoint, data or parallel backend it runs."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import MISSING
from tqdm import tqdm

from goodput.signals import HELPER_ENV, PREEMPT_SIGNALS, GraceTimer

log = logging.getLogger(__name__)


class StopSignal:
    """SIGTERM, SIGINT, SIGUSR1, SIGUSR2 (a preemption notice, however the scheduler sends it): finish
    the step, checkpoint, wait for the upload, exit 0.

    The flag is acted on at the next step boundary, which all ranks must reach. If they do not
    within `grace_s` (a peer died and this rank is stuck in a collective: the elastic agent sends
    SIGTERM to the survivors in exactly that case), exit at once so the restart is not delayed.
    A second signal exits at once too (a second Ctrl-C), except the same signal again within
    `dup_s`: that is the same notice by two routes (sent to the process group, and forwarded by the
    elastic agent's process, goodput.launch).
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
        """Put back the handlers found at start (SIG_DFL, or submitit's: see goodput.launch)."""
        for sig, h in self._previous.items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)
        self._previous = {}
        self._grace.close()
        if self._env is None:
            os.environ.pop(HELPER_ENV, None)


@dataclass
class TrainerConfig:
    """Schema of `trainer`: how long, how big, how often to evaluate and log."""

    max_steps: int = MISSING
    """Optimizer steps of the whole run (set by the experiment). A relaunch continues to it."""

    global_batch_size: int = 128
    """Samples per step over all ranks; fixed across world sizes (the sample order depends on it),
    so it must be divisible by the world size."""

    eval_every_n_steps: int = 0
    """Validation accuracy every N steps; 0 = only at the end. Each evaluation costs a pass over val/."""

    log_every_n_steps: int = 10
    """Metrics to MLflow every N steps (batched, off the loop's thread)."""

    num_threads: int = 1
    """Intra-op CPU threads per process. Fixed, because the float results (and the model hash)
    depend on it; raise it for speed on CPU-only machines and accept another hash."""

    deterministic: bool = True
    """torch.use_deterministic_algorithms: bit-identical reruns and resumes, at some speed cost on GPU."""

    progress: Any = "auto"
    """Progress bar: `auto` = only on a terminal; true | false."""

    signal_grace_seconds: int = 10
    """After a preemption signal (TERM, INT, USR1, USR2), exit hard if the step boundary is not
    reached by then (a stuck peer). Longer than one step, or a slow step is cut short."""

    hang_timeout_s: float = 300.0
    """A rank that makes no progress (no step done, no save begun) for this long is hung: the
    watchdog (goodput.watchdog) logs its rank, last step and every thread's Python stack, then
    ends it, and the restart path takes over. Until the first step the bound is
    parallel.init_timeout_s. Longer than the slowest step, evaluation and blocking save (waiting
    for the previous dcp_async upload included), or one is cut short; the time from a hang to the
    resumed run is about this plus a restart. 0 = off."""

    def __post_init__(self):
        e = []
        if self.hang_timeout_s < 0:
            e.append(f"trainer.hang_timeout_s must be >= 0 (0 = off), got {self.hang_timeout_s}")
        if not (isinstance(self.max_steps, int) and self.max_steps > 0):
            e.append(f"trainer.max_steps must be > 0, got {self.max_steps}")
        if not (isinstance(self.global_batch_size, int) and self.global_batch_size > 0):
            e.append(f"trainer.global_batch_size must be > 0, got {self.global_batch_size}")
        if self.eval_every_n_steps < 0:
            e.append(f"trainer.eval_every_n_steps must be >= 0, got {self.eval_every_n_steps}")
        if self.log_every_n_steps <= 0:
            e.append(f"trainer.log_every_n_steps must be > 0, got {self.log_every_n_steps}")
        if self.num_threads <= 0:
            e.append(f"trainer.num_threads must be > 0, got {self.num_threads}")
        if self.progress not in ("auto", True, False):
            e.append(f"trainer.progress must be auto|true|false, got {self.progress!r}")
        if e:
            raise ValueError("\n  - ".join(e))


@dataclass
class ScheduleConfig:
    """Schema of `optim/schedule=warmup_cosine` (the default). Any other `optim/schedule` option is a
    node with a `_target_` called as `fn(optimizer)` (with `_partial_: true`), returning an LR scheduler."""

    _target_: str = "goodput.loop.warmup_cosine"
    _partial_: bool = True
    warmup_steps: int = 20
    """Linear warm-up from lr/warmup_steps to lr: large batches and fresh Adam moments need it."""

    min_lr_ratio: float = 0.05
    """Cosine decay ends at lr x min_lr_ratio at total_steps."""

    total_steps: int = "${trainer.max_steps}"  # type: ignore[assignment]
    """Where the decay ends: the run's trainer.max_steps."""


def warmup_cosine(optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """Linear warm-up, then cosine decay to lr x min_lr_ratio at total_steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(warmup_steps, total_steps, min_lr_ratio))


def lr_schedule(warmup_steps: int, max_steps: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


@torch.no_grad()
def evaluate(model, loader, device, world: int) -> float:
    model.eval()
    correct = torch.zeros(2, dtype=torch.float64)
    for batch in loader:
        x, y = batch["image"].to(device, non_blocking=True), batch["label"].to(device)
        pred = model(x).argmax(1)
        mask = y >= 0
        correct += torch.tensor(
            [(pred[mask] == y[mask]).sum().item(), mask.sum().item()], dtype=torch.float64
        )
    if world > 1:
        dist.all_reduce(correct)
    model.train()
    return (correct[0] / correct[1].clamp(min=1)).item()


def reduce_perf(step_s: float, fetch_s: float, images: int, world: int) -> dict:
    """Whole-job numbers: images/s over the slowest rank; fetch seconds max and mean across ranks."""
    t = torch.tensor([step_s, fetch_s, fetch_s, float(images)], dtype=torch.float64)
    if world > 1:
        mx = t.clone()
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        dist.all_reduce(t)
        step_s, fetch_max, fetch_mean, images = mx[0].item(), mx[1].item(), t[2].item() / world, t[3].item()
    else:
        fetch_max = fetch_mean = fetch_s
    return {
        "perf/step_seconds": step_s,
        "perf/fetch_seconds": fetch_max,
        "perf/fetch_seconds_mean": fetch_mean,
        "perf/images_per_second": images / step_s if step_s > 0 else 0.0,
    }


def train(t) -> dict:
    """Run steps until trainer.max_steps (or a stop signal). `t` is a goodput.build.Trainer."""
    cfg, d = t.cfg, t.dist
    max_steps = cfg["trainer"]["max_steps"]
    log_every = max(1, cfg["trainer"]["log_every_n_steps"])
    eval_every = cfg["trainer"]["eval_every_n_steps"]
    criterion = torch.nn.CrossEntropyLoss(ignore_index=-1)
    stop = StopSignal(cfg["trainer"]["signal_grace_seconds"])
    show = cfg["trainer"]["progress"]
    show = sys.stderr.isatty() if show == "auto" else bool(show)
    bar = tqdm(total=max_steps, initial=t.loader.step, disable=not (show and d.rank == 0), dynamic_ncols=True)

    step = t.loader.step
    has_buffers = any(True for _ in t.model.buffers())
    loss_val, val_acc = float("nan"), None
    window = {"fetch": 0.0, "step": 0.0, "images": 0, "n": 0}
    t.model.train()
    while step < max_steps:
        t0 = time.perf_counter()
        batch = next(t.loader)  # the accelerator idles for exactly this long
        t1 = time.perf_counter()
        x = batch["image"].to(d.device, non_blocking=True)
        y = batch["label"].to(d.device, non_blocking=True)
        if has_buffers:  # forward mutates buffers (BatchNorm stats): an async save's copy must be done
            t.ckpt.wait_for_staging()

        loss = criterion(t.model(x), y)
        t.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        t.ckpt.wait_for_staging()  # an async save's copy must finish before parameters change
        t.optimizer.step()
        t.scheduler.step()
        step += 1
        t2 = time.perf_counter()

        t.ledger.add("fetch", t1 - t0)
        t.ledger.add("productive", t2 - t1)
        window["fetch"] += t1 - t0
        window["step"] += t2 - t0
        window["images"] += len(y)
        window["n"] += 1
        t.faults.at_step(step)
        t.faults.site("step")

        if step % log_every == 0 or step == max_steps:
            loss_val = loss.item()
            n = window["n"]
            perf = reduce_perf(window["step"] / n, window["fetch"] / n, window["images"] // n, d.world)
            t.tracker.log({"train/loss": loss_val, "train/lr": t.scheduler.get_last_lr()[0], **perf}, step)
            t.tracker.log(t.loader.stats(), step)
            bar.set_postfix(
                loss=f"{loss_val:.3f}",
                fetch=f"{perf['perf/fetch_seconds']:.3f}s",
                img_s=f"{perf['perf/images_per_second']:.0f}",
                refresh=False,
            )
            window = {"fetch": 0.0, "step": 0.0, "images": 0, "n": 0}
        t.attempts_beat(step)  # how far this attempt got (lost work after a crash); async, never blocks
        bar.update(1)

        if (eval_every and step % eval_every == 0) or step == max_steps:
            te = time.perf_counter()
            val_acc = evaluate(t.model, t.val_loader, d.device, d.world)
            t.ledger.add("eval", time.perf_counter() - te)
            t.tracker.log({"val/accuracy": val_acc}, step)

        stopping = stop.agreed(d.world)
        blocking = t.ckpt.maybe_save(step, t.app, last=step == max_steps or stopping)
        if blocking is not None:
            t.ledger.add("checkpoint", blocking)
            t.tracker.log({"ckpt/blocking_seconds": blocking}, step)
        for m in t.ckpt.drain_metrics():
            t.tracker.log({k: v for k, v in m.items() if k != "ckpt/step"}, m["ckpt/step"])
        if stopping:
            log.warning("received %s: checkpointed step %d, stopping", stop.received, step)
            break

    bar.close()
    stop.restore()
    tw = time.perf_counter()
    t.ckpt.wait()  # the last save must be committed before the process may exit
    t.ledger.add("checkpoint", time.perf_counter() - tw)
    for m in t.ckpt.drain_metrics():
        t.tracker.log({k: v for k, v in m.items() if k != "ckpt/step"}, m["ckpt/step"])
    return {"steps": step, "final_loss": loss_val, "val_accuracy": val_acc, "preempted": stop.received}
