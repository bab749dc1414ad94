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

from goodput.resilience.accounting import sync_point
from goodput.resilience.signals import HELPER_ENV, PREEMPT_SIGNALS, GraceTimer
from goodput.run.compiler import MODES
from goodput.run.evaluate import default_top_k, evaluate
from goodput.run.monitor import check_metric
from goodput.run.observe import gather_ranks, rank_stats

log = logging.getLogger(__name__)


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

    # -- the training step (goodput.run.step); all off by default; docs/training-step.md -------------
    precision: str = "32"
    """`32` (fp32), `bf16-mixed` (autocast to bfloat16: about fp32's range, no scaler needed; on
    CUDA from Ampere on) or `16-mixed` (autocast to float16 with a GradScaler, whose scale and
    growth tracker are checkpointed; a step with an inf gradient is skipped, deterministically).
    Under parallel=fsdp the parameters are all-gathered in that dtype, gradients reduced in fp32.
    Mixed precision trades bits of every activation for speed and memory on accelerators; on CPU
    it is usually slower (few CPU kernels are fast in 16 bits)."""

    micro_batch_size: int | None = None
    """Samples per forward/backward on one rank; null = the whole per-rank batch. The rank's share
    of trainer.global_batch_size (global / world) is split into micro-batches whose gradients are
    accumulated (synchronised across ranks only on the last one), so the global batch, the sample
    order and the maths stay those of the un-split step at less activation memory. Must divide
    global_batch_size / world size."""

    clip_grad_norm: float | None = None
    """Clip the gradients to this total L2 norm (over all parameters, all shards) before the
    optimizer step; null = off. The norm before clipping is logged as train/grad_norm."""

    ema_decay: float | None = None
    """Keep an exponential moving average of the weights with this decay (e.g. 0.999); null = off.
    A second copy of the model (sharded like it under fsdp), checkpointed and resharded with it."""

    ema_every_n_steps: int = 1
    """Update the EMA every N optimizer steps (cheaper for large models; the effective decay per
    step is then decay^(1/N))."""

    ema_start_step: int = 0
    """Start the EMA after this many steps (the first update copies the weights): early weights
    from the warm-up are then not averaged in."""

    eval_on: str = "model"
    """Which weights evaluation (and export) uses: `model` (the trained weights) or `ema`."""

    channels_last: bool = False
    """NHWC memory layout for the model and its inputs: faster convolutions on GPUs with tensor
    cores (and with bf16/fp16); no effect on the maths' result type, little on CPU."""

    eval_top_k: int | None = None
    """Also log val/top<k> (the true class among the k highest logits); null = 5 when there are at
    least 5 classes, else none."""

    early_stopping_patience: int | None = None
    """Stop after this many evaluations in a row without an improvement of early_stopping_by (null =
    off; needs eval_every_n_steps > 0). The stop commits a checkpoint, exits 0, and summary.json's
    stop_reason says early_stopping; a relaunch of the run then says it is complete. The counter is
    in the checkpoint: a resumed run stops at the same step as an uninterrupted one."""

    early_stopping_by: str = "val/loss"
    """The metric early stopping watches: val/loss, val/accuracy or val/top<k>."""

    early_stopping_min_delta: float = 0.0
    """An evaluation improves only when it beats the best so far by more than this."""

    early_stopping_mode: str | None = None
    """`max` or `min` for early_stopping_by; null = from the name (min for a loss, else max)."""

    compile: bool = False
    """torch.compile the model (goodput.run.compiler): faster steps after a compile that costs seconds
    (demo model, CPU) to minutes (large models), paid on the first step, the first evaluation and
    each recompile; the ledger counts it as `compile`. Checkpoints are the same compiled or not."""

    compile_mode: str = "default"
    """torch.compile's mode: `default`, `reduce-overhead` (CUDA graphs: less launch overhead, more
    memory), `max-autotune` (benchmarks kernels: much longer compile), `max-autotune-no-cudagraphs`."""

    compile_dynamic: bool | None = False
    """false: shapes are static (the batch is fixed; a new shape, e.g. a short last eval batch,
    compiles once more); true: compile for dynamic shapes; null: torch decides after a change."""

    compile_cache_dir: str = "${paths.staging_dir}/compile_cache"
    """Node-local disk for the compile cache (inductor's cache dir and torch's portable cache
    artifacts): a restart or relaunch on this node reuses it instead of compiling again."""

    compile_cache_upload: bool = False
    """Also keep the portable cache artifacts beside the checkpoints (`<checkpoint.dir>/compile_cache/`),
    read by a relaunch on a node whose local cache is empty. Off by default: the cache is generated
    code that runs when loaded, so this trusts whoever can write the checkpoint dir."""

    hang_timeout_s: float = 300.0
    """A rank that makes no progress (no step done, no save begun) for this long is hung: the
    watchdog (goodput.resilience.watchdog) logs its rank, last step and every thread's Python stack,
    then ends it, and the restart path takes over. Until the first step the bound is
    parallel.init_timeout_s. Longer than the slowest step, evaluation and blocking save (waiting
    for the previous dcp_async upload included), or one is cut short; the time from a hang to the
    resumed run is about this plus a restart. 0 = off."""

    straggler_factor: float = 1.5
    """Warn when the slowest rank's step time is over this factor x the median rank's (the lower
    median: with 2 ranks, the other rank) for straggler_windows log windows in a row. Step time
    is the rank's own: waits inside the gradient all-reduce count on every rank (docs/observability.md)."""

    straggler_windows: int = 3
    """Consecutive log windows over straggler_factor before the warning (one slow window is noise)."""

    profile_start_step: int | None = None
    """torch.profiler trace of steps profile_start_step.. (numbered as the metrics' steps; null =
    off): a Chrome trace per rank (CUDA: also a memory snapshot) in <run_dir>/profiler/, rank 0's
    logged to MLflow under profiler/. Profiling slows the profiled steps."""

    profile_steps: int = 1
    """How many steps the profiler records from profile_start_step."""

    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device for perf/mfu; null = from goodput.run.observe's table of
    known GPUs (H100, H200, A100; by trainer.precision), and no perf/mfu where unknown (CPU)."""

    def __post_init__(self):
        e = []
        if self.hang_timeout_s < 0:
            e.append(f"trainer.hang_timeout_s must be >= 0 (0 = off), got {self.hang_timeout_s}")
        if not self.straggler_factor > 1:
            e.append(f"trainer.straggler_factor must be > 1, got {self.straggler_factor}")
        if not (isinstance(self.straggler_windows, int) and self.straggler_windows >= 1):
            e.append(f"trainer.straggler_windows must be >= 1, got {self.straggler_windows}")
        s = self.profile_start_step
        if s is not None and not (isinstance(s, int) and s >= 1):
            e.append(f"trainer.profile_start_step must be >= 1 or null, got {s!r}")
        if not (isinstance(self.profile_steps, int) and self.profile_steps >= 1):
            e.append(f"trainer.profile_steps must be >= 1, got {self.profile_steps!r}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            e.append(f"trainer.peak_tflops must be > 0 or null, got {self.peak_tflops}")
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
        if self.eval_top_k is not None and not (isinstance(self.eval_top_k, int) and self.eval_top_k >= 1):
            e.append(f"trainer.eval_top_k must be >= 1 or null, got {self.eval_top_k!r}")
        p = self.early_stopping_patience
        if p is not None and not (isinstance(p, int) and p >= 1):
            e.append(f"trainer.early_stopping_patience must be >= 1 or null, got {p!r}")
        if p is not None and not self.eval_every_n_steps:
            e.append("trainer.early_stopping_patience counts evaluations: set trainer.eval_every_n_steps > 0")
        e += check_metric(self.early_stopping_by, "trainer.early_stopping_by")
        if self.early_stopping_min_delta < 0:
            e.append(f"trainer.early_stopping_min_delta must be >= 0, got {self.early_stopping_min_delta}")
        if self.early_stopping_mode not in (None, "max", "min"):
            e.append(f"trainer.early_stopping_mode must be max|min|null, got {self.early_stopping_mode!r}")
        if self.progress not in ("auto", True, False):
            e.append(f"trainer.progress must be auto|true|false, got {self.progress!r}")
        if str(self.precision) not in ("32", "bf16-mixed", "16-mixed"):
            e.append(f"trainer.precision must be 32|bf16-mixed|16-mixed, got {self.precision!r}")
        if self.micro_batch_size is not None and not (
            isinstance(self.micro_batch_size, int) and self.micro_batch_size > 0
        ):
            e.append(f"trainer.micro_batch_size must be > 0 or null, got {self.micro_batch_size}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            e.append(f"trainer.clip_grad_norm must be > 0 or null, got {self.clip_grad_norm}")
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            e.append(f"trainer.ema_decay must be in (0, 1) or null, got {self.ema_decay}")
        if self.ema_every_n_steps < 1:
            e.append(f"trainer.ema_every_n_steps must be >= 1, got {self.ema_every_n_steps}")
        if self.ema_start_step < 0:
            e.append(f"trainer.ema_start_step must be >= 0, got {self.ema_start_step}")
        if self.eval_on not in ("model", "ema"):
            e.append(f"trainer.eval_on must be model|ema, got {self.eval_on!r}")
        elif self.eval_on == "ema" and self.ema_decay is None:
            e.append("trainer.eval_on=ema needs trainer.ema_decay (no EMA is kept without it)")
        elif self.eval_on == "ema" and self.ema_every_n_steps >= 1 and isinstance(self.max_steps, int):
            # goodput.run.step updates after step `done` when done > ema_start_step and done % every == 0
            first = (max(0, self.ema_start_step) // self.ema_every_n_steps + 1) * self.ema_every_n_steps
            if first > self.max_steps:
                e.append(
                    f"trainer.eval_on=ema: the EMA's first update would be at step {first} "
                    f"(ema_start_step={self.ema_start_step}, ema_every_n_steps={self.ema_every_n_steps}), "
                    f"after trainer.max_steps={self.max_steps}: evaluation and the logged model would be "
                    f"the untrained initial weights"
                )
        if self.compile_mode not in MODES:
            e.append(f"trainer.compile_mode must be one of {list(MODES)}, got {self.compile_mode!r}")
        if self.compile_dynamic not in (None, True, False):
            e.append(f"trainer.compile_dynamic must be true|false|null, got {self.compile_dynamic!r}")
        if e:
            raise ValueError("\n  - ".join(e))


@dataclass
class ScheduleConfig:
    """Schema of `optim/schedule=warmup_cosine` (the default). Any other `optim/schedule` option is a
    node with a `_target_` called as `fn(optimizer)` (with `_partial_: true`), returning an LR scheduler."""

    _target_: str = "goodput.run.loop.warmup_cosine"
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
    cfg, d = t.cfg, t.dist
    max_steps = cfg["trainer"]["max_steps"]
    log_every = max(1, cfg["trainer"]["log_every_n_steps"])
    eval_every = cfg["trainer"]["eval_every_n_steps"]
    stop = StopSignal(cfg["trainer"]["signal_grace_seconds"])
    show = cfg["trainer"]["progress"]
    show = sys.stderr.isatty() if show == "auto" else bool(show)
    bar = tqdm(total=max_steps, initial=t.loader.step, disable=not (show and d.rank == 0), dynamic_ncols=True)

    step = t.loader.step
    sync = sync_point(d.device)
    loss_val, val_acc, last_eval = float("nan"), None, None
    top_k = default_top_k(cfg["trainer"]["eval_top_k"], t.loader.num_classes)
    window = {"fetch": 0.0, "step": 0.0, "images": 0, "n": 0}
    t.model.train()
    while step < max_steps:
        early = False
        t.profiler.at(step)  # trainer.profile_*: starts/stops the trace at a step boundary
        t0 = time.perf_counter()
        batch = next(t.loader)  # the accelerator idles for exactly this long
        t1 = time.perf_counter()
        x = batch["image"].to(d.device, non_blocking=True)
        y = batch["label"].to(d.device, non_blocking=True)
        loss = t.step(x, y, step)  # forward, backward, optimizer, EMA: goodput.run.step
        t.faults.slow_step()  # fault.slow_rank: inside the timed step, after the gradient sync
        step += 1
        sync()  # on CUDA: the step's kernels are done, so the clock reads what they took
        compiling = t.compile_clock.take()  # seconds of this step that were torch.compile
        t2 = time.perf_counter()

        t.ledger.add("fetch", t1 - t0)
        t.ledger.add("compile", compiling)
        t.ledger.add("productive", t2 - t1 - compiling)
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
            metrics = {"train/loss": loss_val, "train/lr": t.scheduler.get_last_lr()[0], **t.step.metrics()}
            t.tracker.log({**metrics, **perf}, step)
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
            last_eval = evaluate(
                t.eval_module(), t.val_loader, d.device, d.world, t.loader.num_classes, top_k
            )
            compiling = t.compile_clock.take()  # a compiled model compiles again for inference
            t.ledger.add("compile", compiling)
            t.ledger.add("eval", time.perf_counter() - te - compiling)
            val_acc, metrics = last_eval.accuracy, last_eval.metrics(t.loader.files.classes)
            t.tracker.log(metrics, step)
            t.ckpt.observe(metrics, step)  # checkpoint.keep_best_by
            early = t.early_stopping.update(metrics, step)  # the same on every rank: metrics are reduced

        stopping = stop.agreed(d.world)
        info = {"stop_reason": "early_stopping"} if early else None  # a relaunch then says: complete
        blocking = t.ckpt.maybe_save(step, t.app, last=step == max_steps or stopping or early, info=info)
        if blocking is not None:
            t.ledger.add("checkpoint", blocking)
            t.tracker.log({"ckpt/blocking_seconds": blocking}, step)
        for m in t.ckpt.drain_metrics():
            t.tracker.log({k: v for k, v in m.items() if k != "ckpt/step"}, m["ckpt/step"])
        if stopping:
            log.warning("received %s: checkpointed step %d, stopping", stop.received, step)
            break
        if early:
            log.warning("early stopping at step %d: %s", step, t.early_stopping.detail())
            break

    bar.close()
    t.profiler.stop()  # a run that ended inside the profiled steps still writes its trace
    stop.restore()
    tw = time.perf_counter()
    t.ckpt.wait()  # the last save must be committed before the process may exit
    t.ledger.add("checkpoint", time.perf_counter() - tw)
    for m in t.ckpt.drain_metrics():
        t.tracker.log({k: v for k, v in m.items() if k != "ckpt/step"}, m["ckpt/step"])
    reason = "early_stopping" if t.early_stopping.stopped_at == step < max_steps else None
    return {"steps": step, "final_loss": loss_val, "val_accuracy": val_acc, "preempted": stop.received,
            "stop_reason": reason, "evaluation": last_eval}  # fmt: skip
