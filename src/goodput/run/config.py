"""The run's own schemas: `trainer` (how long, how big, the training step's switches, hangs,
observability) and `optim/schedule=warmup_cosine`. Registered with the other groups by goodput.config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from goodput.run.progress import MODES as PROGRESS

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's


@dataclass
class TrainerConfig:
    """Schema of `trainer`: how long, how big, how often to evaluate and log."""

    max_steps: int | None = MISSING
    """Optimizer steps of the whole run (set by the experiment). A relaunch continues to it. null
    with max_epochs set: the job derives it from the training split's size."""

    max_epochs: int | None = None
    """The run's length in epochs instead (with trainer.max_steps=null: exactly one is set); the job
    turns it into max_steps = max_epochs x steps per epoch (training samples x data.repeated_augment
    // global batch), so everything after (the LR schedule, "already done?") counts steps."""

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
    """What rank 0 shows while training (goodput.run.progress): `auto` = tqdm's bar on a terminal,
    log lines otherwise (a file, a SLURM log); `bar` (or true), `lines`, or false = neither.
    Evaluations print one line each (val loss, accuracy) unless false."""

    progress_every_s: float = 30.0
    """Progress lines: at most one per this many seconds (step/max_steps, loss, lr, images/s, ETA),
    printed at a step that logs metrics (trainer.log_every_n_steps), so the loss it shows costs no
    extra device sync; the first logged step and the last step always print. 0 = every logged step."""

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

    sync_batchnorm: bool = False
    """parallel=ddp: BatchNorm statistics over the whole global batch (nn.SyncBatchNorm; one
    all-reduce per BatchNorm layer in each forward) instead of each rank's part. Its buffers are the
    same as BatchNorm's: checkpoints move between the two. CUDA only (torch's SyncBatchNorm runs on
    GPUs; refused on CPU), and not under fsdp/hsdp (refused)."""

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
    read by a relaunch on a node whose local cache is empty. The cache is generated code that runs
    when loaded: a copy from there is loaded only with a valid HMAC of this run's job (keyed by
    compile_cache_key_file), else ignored with a warning (a cold compile). Off by default."""

    compile_cache_key_file: str = "${paths.root}/keys/compile_cache.key"
    """The secret that signs the uploaded compile cache (compile_cache_upload), never written to the
    store. Created (random, mode 0600) on first use when missing; must be a regular file of this user
    that nobody else may read, outside checkpoint.dir. Every node of a job must see the same file (a
    shared paths.root, or a secret your scheduler provisions on each node), and nobody who may write
    checkpoint.dir should be able to read it (docs/security.md)."""

    hang_timeout_s: float = 300.0
    """A rank that makes no progress between steps (no step done) for this long is hung: the
    watchdog (goodput.resilience.watchdog) logs its rank, last step and every thread's Python stack,
    then ends it, and the restart path takes over. Longer than the slowest step (its fetch and
    logging included); the phases known to be long have their own bounds: until the first step
    parallel.init_timeout_s, an evaluation pass or a blocking save phase_timeout_s, and with compile
    compile_timeout_s more (docs/hangs.md). The time from a hang to the resumed run is about this
    plus a restart. 0 = off (every phase's bound with it)."""

    phase_timeout_s: float = 900.0
    """The watchdog's bound on a known long phase after the first step: an evaluation pass (the
    final one included), a blocking checkpoint save (waiting for the previous dcp_async upload
    included) and the wait for the last upload after the loop. Longer than the slowest of them, or
    it is ended as a hang; a hang inside one is caught after this long. Never below hang_timeout_s."""

    compile_timeout_s: float = 1800.0
    """With trainer.compile: added to the watchdog's bound of each phase that compiles, the first
    step (parallel.init_timeout_s + this) and the first evaluation (phase_timeout_s + this) of each
    process. A cold compile of a large model takes minutes (on CPU, inductor builds C++)."""

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
        for key in ("phase_timeout_s", "compile_timeout_s"):
            if not getattr(self, key) > 0:
                e.append(f"trainer.{key} must be > 0, got {getattr(self, key)}")
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
            e.append(
                f"trainer.max_steps must be > 0 (or null with trainer.max_epochs set), got {self.max_steps}"
            )
        if self.max_epochs is not None and not (isinstance(self.max_epochs, int) and self.max_epochs > 0):
            e.append(f"trainer.max_epochs must be > 0 or null, got {self.max_epochs!r}")
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
        if self.early_stopping_min_delta < 0:
            e.append(f"trainer.early_stopping_min_delta must be >= 0, got {self.early_stopping_min_delta}")
        if self.early_stopping_mode not in (None, "max", "min"):
            e.append(f"trainer.early_stopping_mode must be max|min|null, got {self.early_stopping_mode!r}")
        if self.progress not in PROGRESS:
            e.append(f"trainer.progress must be auto|bar|lines|true|false, got {self.progress!r}")
        if not self.progress_every_s >= 0:
            e.append(f"trainer.progress_every_s must be >= 0, got {self.progress_every_s}")
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

    _target_: str = "goodput.run.schedule.warmup_cosine"
    _partial_: bool = True
    warmup_steps: int = 20
    """Linear warm-up from lr/warmup_steps to lr: large batches and fresh Adam moments need it."""

    min_lr_ratio: float = 0.05
    """Cosine decay ends at lr x min_lr_ratio at total_steps."""

    total_steps: int | None = "${trainer.max_steps}"  # type: ignore[assignment]
    """Where the decay ends: the run's trainer.max_steps."""

    warmup_epochs: float | None = None
    """The warm-up in epochs instead of steps (null = warmup_steps counts); the job turns it into
    warmup_steps = round(warmup_epochs x steps per epoch). A warm-up as long as the run is refused."""
