"""The components of a worker, each built from its own config node.

Every function here takes the typed config (goodput.config.Config) and returns one component;
`Trainer` holds what a rank trains with. Nothing here decides *when* anything happens: that is the worker's
(goodput.run.worker), the loop's (goodput.run.loop) and the checkpoint manager's job.
"""

from __future__ import annotations

import functools
import logging
import random

import numpy as np
import torch
from hydra.utils import instantiate

from goodput.checkpoint import AppState, CheckpointManager, RNGState
from goodput.checkpoint.commits import Commits
from goodput.checkpoint.manager import view as commits_view
from goodput.checkpoint.spec import ModelSpec
from goodput.config import Config, ConfigError, idle_top_k, monitors_logged
from goodput.data.dataset import check_same_classes
from goodput.data.loader import ResumableLoader, data_record, eval_loader, eval_loader_of
from goodput.data.sampler import batch_seed
from goodput.monitor import EarlyStopping
from goodput.parallel import set_collective_timeout
from goodput.recipe.models import missing_plan, shard_plan
from goodput.recipe.params import param_groups
from goodput.resilience.accounting import Ledger
from goodput.resilience.bookkeeping import Goodput
from goodput.resilience.fault import Faults
from goodput.resilience.recovery import Recovery
from goodput.resilience.watchdog import Watchdog
from goodput.run.compiler import CompileCache, CompileClock
from goodput.run.context import RunContext
from goodput.run.observe import MFU, StepProfiler, StragglerWatch
from goodput.run.step import PRECISIONS, Step, StepGuard, StepOptions, make_ema
from goodput.storage.remote import Storage
from goodput.tracking import Tracker

log = logging.getLogger("goodput")

STEP_KEYS = ("precision", "micro_batch_size", "clip_grad_norm", "ema_decay", "ema_every_n_steps",
             "ema_start_step", "channels_last")  # fmt: skip  # the `trainer` keys goodput.run.step acts on


def storage(c: Config, root: str) -> Storage:
    """The data root and the checkpoint dir are both opened through the `storage` node."""
    return instantiate(c.storage)(root)


def storage_of(node: dict, root: str) -> Storage:
    """`storage` from the resolved `storage` node alone (before the config is validated)."""
    return instantiate(node)(root)


def checkpoint_manager(c: Config, ctx: RunContext | None = None, d=None) -> CheckpointManager:
    """The `checkpoint` node's manager and backend. Without `d` (the job process): rank 0 of 1, to
    list and check the run's checkpoints before any worker starts. Each commit records `ctx`'s
    config hash and MLflow run (None without one)."""
    ck = c.checkpoint
    rank, world, local_rank, pg = (d.rank, d.world, d.local_rank, d.ckpt_pg) if d else (0, 1, 0, None)
    return CheckpointManager(
        ck,
        storage(c, ck.dir),
        instantiate(ck.backend),
        rank,
        world,
        local_rank,
        pg=pg,
        commit_info={"config_hash": ctx and ctx.config_hash, "mlflow_run_id": ctx and ctx.mlflow_run_id,
                     "run": c.run.name, "identity": ctx and ctx.identity, "max_steps": c.trainer.max_steps,
                     "code": ctx and (ctx.code or None)},
        lock_token=ctx and ctx.lock_token,
    )  # fmt: skip


def lr_trace(optimizer: dict, schedule: dict, steps: list[int], limit: int = 100_000) -> list[float] | None:
    """The LR an `optim` pair of nodes (resolved) gives after each of `steps` optimizer steps, on one
    dummy parameter; None past `limit` steps or for a schedule that cannot be built this way."""
    if max(steps) > limit:
        return None
    try:
        opt = instantiate(optimizer)(params=[torch.nn.Parameter(torch.zeros(1))])
        sched, done, out = instantiate(schedule)(opt), 0, {}
        for s in sorted(set(steps)):
            for _ in range(s - done):
                opt.step()  # no gradient: nothing moves, but the schedule sees a step after it
                sched.step()
            done, out[s] = s, sched.get_last_lr()[0]
    except Exception as e:
        log.debug("lr_trace: %s", e)
        return None
    return [out[s] for s in steps]


def checkpoint_commits(c: Config) -> Commits:
    """The `checkpoint` node's read-only view of the run's commits (the job process's, before any
    worker): the storage of checkpoint.dir only; no backend is built, no staging dir created."""
    return commits_view(c.checkpoint, storage(c, c.checkpoint.dir))


class Trainer:
    """Everything a rank trains with. Built twice only if a failed restore touched the state."""

    def __init__(
        self, c: Config, ctx: RunContext, d, recovery: Recovery | None = None, unsharded: bool = False
    ):
        self.cfg, self.ctx, self.dist = c, ctx, d
        recovery = recovery or Recovery()
        seed = c.seed
        torch.manual_seed(seed)  # same initial weights on every rank
        np.random.seed(seed % 2**32)
        random.seed(seed)
        dc, tr = c.data, c.trainer
        data_store = storage(c, dc.root)
        # The loader builds the per-sample pipeline (decode, then the `augment` node's transforms).
        self.loader = ResumableLoader(
            dc, data_store, seed, tr.global_batch_size, tr.max_steps, d.rank, d.world, d.device,
            augment=c.augment,
        )  # fmt: skip
        local_bs = tr.global_batch_size // d.world
        self.val_loader = eval_loader(dc, data_store, local_bs, d.rank, d.world, d.device, c.augment)
        check_same_classes(self.loader.files.classes, self.val_loader.dataset.files.classes, dc.root)
        recovery.mark("data_listed")

        # The recipe (goodput.recipe): the task (targets, loss, metrics) and the batch transform.
        self.task, self.mix = instantiate(c.task), instantiate(c.batch_augment)
        wrong = monitors_logged(self.task, tr, c.checkpoint, self.loader.num_classes)
        if wrong:  # now, not at the first evaluation after training up to it
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(wrong))
        idle = idle_top_k(tr, self.loader.num_classes)  # (validate warned about the rest)
        if idle and d.rank == 0:
            log.warning("%s", idle)
        self.metric_modes = self.task.metric_modes(self.loader.num_classes)

        opts = StepOptions(**{k: getattr(tr, k) for k in STEP_KEYS})
        strategy = instantiate(c.parallel.strategy)
        # A spare (goodput.run.spares) does not know its rank yet: a strategy that shards needs the
        # job's mesh, so it builds unsharded on the meta device (nothing allocated: a model that needs
        # sharding may not fit one device) and `regroup` builds again on the mesh it joins.
        self.built_unsharded = unsharded and not strategy.regroups_in_place
        if self.built_unsharded:
            from goodput.parallel import Single

            strategy = Single()
        self.mfu = None
        built = self._build_model(strategy, d, opts, torch.device("meta") if self.built_unsharded else None)
        self.model, ema, self.optimizer, self.scheduler = built
        ledger = Ledger()  # kept by self.goodput
        self.app = AppState(self.model, self.optimizer, d.rank)
        self.app.register("data", self.loader)
        self.app.register("scheduler", self.scheduler)
        self.app.register("ledger", ledger)
        self.rng = RNGState(seed, d.rank)  # reseeded before every step (the loop): see at_step
        self.app.register("rng", self.rng, per_rank=True)

        self.ckpt = checkpoint_manager(c, ctx, d)
        self.ckpt.best.take_modes(self.metric_modes)  # checkpoint.keep_best_mode null: the task's
        self.ckpt_store = self.ckpt.storage
        # What the weights need to be used (scripts/evaluate.py, predict.py, the export, the MLflow
        # model): recorded in every commit, with the data that evaluates them and the weights it did.
        view = self.val_loader.dataset  # the eval view: the model record carries it
        self.spec = ModelSpec.of(c, self.loader.files.classes, view.image_size, view.resize_size)
        self.ckpt.commit_info.update(model=self.spec.record(), eval_on=tr.eval_on,
                                     data=data_record(data_store, c.data))  # fmt: skip
        self.early_stopping = EarlyStopping(
            tr.early_stopping_patience, tr.early_stopping_by, tr.early_stopping_min_delta,
            tr.early_stopping_mode or self.metric_modes.get(tr.early_stopping_by),
        )  # fmt: skip
        # The best so far and the early-stopping counter resume with the run. Saved only when on, so
        # a run that uses neither keeps the checkpoint layout (and resumes checkpoints) it had before;
        # turned on later in a run (or resuming a checkpoint from before they existed), they start fresh.
        if self.ckpt.best.by is not None:
            self.app.register(
                "best", self.ckpt.best, missing="checkpoint.keep_best_by's best so far starts over"
            )
        if self.early_stopping.patience is not None:
            self.app.register(
                "early_stopping", self.early_stopping, missing="the early-stopping counter starts from zero"
            )
        f = c.fault
        self.faults = Faults(
            self.ckpt_store, d.rank, f.kill_at_step, f.kill_during_save, f.rank, f.kill_in_step,
            slow_rank=f.slow_rank, slow_seconds=f.slow_seconds, raise_at_step=f.raise_at_step,
        )  # fmt: skip
        self.faults.arm_hang(f.hang_at_step, f.hang_site, f.hang_rank, f.hang_mtbf_seconds, f.max_hangs)
        self.ckpt.fault = self.faults
        if f.hang_at_step is not None or f.hang_mtbf_seconds is not None:
            site = f.hang_site  # hang drills inside storage calls: reads of the data, writes of saves
            (data_store if site in ("storage_read", "dataloader") else self.ckpt_store).fault = self.faults
        compiling = tr.compile_timeout_s if tr.compile else 0.0  # the first step compiles too
        self.watchdog = Watchdog(
            tr.hang_timeout_s, d.init_timeout_s + compiling, d.rank, self.ckpt_store,
            phase_timeout_s=tr.phase_timeout_s, compile_timeout_s=compiling,
        )  # fmt: skip
        self.ckpt.phase = self.watchdog.phase  # a blocking save: a phase with its own bound
        # On a failure, the last finished step written without a collective (checkpoint.rescue); the
        # loop marks the step boundaries, the step the update's start, the worker calls it.
        attempt = lambda: self.goodput.restarts  # noqa: E731  # numbered once the attempt begins
        self.rescue = self.ckpt.rescuer(strategy, self.app, self.rng, self.model, attempt)
        # a hung rank's state may be whole: rescue it first (the main thread is stuck: no hand-over)
        self.watchdog.last_words = functools.partial(self.rescue.request, handoff_s=0.0)
        self.evaluate_first = False  # set by the worker when a rescue says its step's evaluation is due
        self.resumed_rescue = False  # set by the worker when the restored commit is a rescue
        self.ends_only = False  # set by the worker when the restored commit is a complete run's end
        self.stop = None  # the loop's StopSignal: installed until the end of the run is written
        self._install_step(strategy, opts, ema)
        self.eval_on = tr.eval_on
        cache = None
        if tr.compile:  # before the first call compiles anything
            remote = self.ckpt_store if tr.compile_cache_upload else None
            cache = CompileCache(
                tr.compile_cache_dir, remote, d.rank, d.local_rank, tr.compile_cache_key_file
            )
            cache.activate()
        self.compile_clock = CompileClock(tr.compile, cache)
        self.tracker = Tracker(
            c.mlflow.tracking_uri, ctx.mlflow_run_id, enabled=d.rank == 0,
            system_metrics_interval_s=c.mlflow.system_metrics_interval_s,
            end_timeout_s=c.mlflow.end_timeout_s, artifact_timeout_s=c.mlflow.artifact_timeout_s,
        )  # fmt: skip
        self.goodput = Goodput(
            ledger, self.ckpt_store, d.rank, d.world, ctx.run_dir, self.tracker, self.faults, recovery,
            self.compile_clock.paid,
        )  # fmt: skip
        # docs/observability.md: stragglers, MFU and the profiler (goodput.run.observe)
        self.stragglers = StragglerWatch(tr.straggler_factor, tr.straggler_windows, d.rank)
        self.profiler = StepProfiler(
            tr.profile_start_step, tr.profile_steps, ctx.run_dir, d.rank, d.device, self.tracker
        )
        self.tracker.log_dataset(dc.root, self.loader.files.fingerprint)

    def _build_model(self, strategy, d, opts: StepOptions, device: torch.device | None = None):
        """The model half: the model, wrapped by `strategy` on `d`'s groups (compiled if asked),
        its EMA laid out like it, the optimizer and the schedule, on `device` (None: d's). Built at
        the start, and again after a spare took a dead rank's place when the strategy cannot move
        its wrapper (`regroup`)."""
        c, tr = self.cfg, self.cfg.trainer
        dtype = PRECISIONS[str(opts.precision)]
        model = instantiate(c.model, num_classes=self.loader.num_classes).to(device or d.device)
        if opts.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if self.mfu is None:
            size = self.loader.dataset.image_size
            shape = (3, size, size)  # RGB at the training resolution
            # FLOPs counted on the meta device (nothing allocated), before a strategy wraps (FSDP
            # shards the module in place)
            self.mfu = MFU(model, shape, d.device, opts.precision, tr.peak_tflops, d.world)
        if tr.sync_batchnorm and strategy.distributed:  # statistics over the global batch (same buffers)
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        plan = shard_plan(model, c.model.get("_target_"), c.parallel.shard_units)
        missing = missing_plan(model, c.model.get("_target_"), c.parallel.shard_units)
        if strategy.shards_parameters and missing:  # (validate refused it already, on the meta device)
            raise ConfigError(f"parallel.strategy {c.parallel.strategy['_target_']}: {missing}")
        ema = None
        sharding = {"plan": plan} if strategy.shards_parameters else {}  # (a strategy of yours needs none)
        if opts.ema_decay is not None:  # copied before wrapping, then laid out like the model
            ema = make_ema(model, opts.ema_decay)
            ema.module = strategy.replica(ema.module, d, dtype, **sharding)
        model = strategy.wrap(model, d, dtype, **sharding)
        if tr.compile:  # as the strategy compiles: the DDP wrapper whole, FSDP per unit
            strategy.compile(model, mode=tr.compile_mode, dynamic=tr.compile_dynamic, **sharding)
        groups = param_groups(model, c.optim.norm_weight_decay, c.optim.bias_weight_decay)
        optimizer = instantiate(c.optim.optimizer)(params=groups)
        scheduler = instantiate(c.optim.schedule)(optimizer)
        return model, ema, optimizer, scheduler

    def regroup(self, d) -> bool:
        """Move onto the process groups of `d`, the next generation's (in-process recovery onto a
        spare, goodput.run.spares); every member of it calls this, in the same order. A wrapper
        that can move does (`Strategy.regroup`: DDP's reducer). One that cannot (FSDP2's DTensors
        are bound to the old groups' device mesh), or a spare that built unsharded, is built again
        on the new mesh (model, EMA, optimizer, schedule, the step) with fresh weights: True, and
        the caller loads the boundary state into it (AppState.apply)."""
        self.rebind(d)
        if self.regroups_in_place:
            self.step.strategy.regroup(self.model)
            return False
        opts, tr = self.step.opts, self.cfg.trainer
        self._release_model()  # (the old shards go before the new model is built: device memory)
        strategy = instantiate(self.cfg.parallel.strategy)  # a mesh of its own, made on d's groups
        model, ema, optimizer, scheduler = self._build_model(strategy, d, opts)
        self.model, self.optimizer, self.scheduler, self.built_unsharded = model, optimizer, scheduler, False
        self.app.model, self.app.optimizer = model, optimizer
        self.app.register("scheduler", scheduler)
        self._install_step(strategy, opts, ema)
        self._new_rescuer()
        if tr.compile:  # the first step compiles the new modules on every member: its collectives wait
            bound = d.group_timeout.total_seconds() + tr.compile_timeout_s
            set_collective_timeout(bound, strategy.collective_groups())
        return True

    def _install_step(self, strategy, opts: StepOptions, ema) -> None:
        """The training step over the Trainer's model, optimizer and schedule, registered with the
        checkpoint state (and the EMA beside it)."""
        guard = StepGuard(self.ckpt.wait_for_staging, self.rescue, self.faults)  # the step's promises
        d, per_rank = self.dist, self.cfg.trainer.global_batch_size // self.dist.world
        self.step = Step(self.model, self.optimizer, self.scheduler, strategy, opts, d.device, per_rank,
                         ema=ema, task=self.task, guard=guard)  # fmt: skip
        self.app.register(
            "step", self.step,
            missing="no gradient-scaler state (the run had none): precision=16-mixed starts a fresh scale",
        )  # fmt: skip
        if ema is not None:
            self.app.register_module("ema", ema)

    def _release_model(self) -> None:
        """Drop this Trainer's references to its model half (regroup builds another): what only
        they held is freed now, not after the new one is built beside it."""
        import gc

        self.model = self.optimizer = self.scheduler = self.app.model = self.app.optimizer = None
        self.app.modules.pop("ema", None)
        self.rescue.model = self.step = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @property
    def regroups_in_place(self) -> bool:
        """Whether `regroup` keeps the model half and its state (else it builds it again, empty)."""
        return self.step.strategy.regroups_in_place and not self.built_unsharded

    def _new_rescuer(self) -> None:
        """The rescue of the current rank, strategy and model (after `rebind` or `regroup`), in
        every place that asks for one; the attempt's start and progress carry over (a failure of
        the first step after a recovery still has the recovery's boundary to gain)."""
        old = self.rescue
        self.rescue = self.ckpt.rescuer(self.step.strategy, self.app, self.rng, self.model, old.attempt)
        self.rescue.since, self.rescue.reached = old.since, old.reached
        self.step.guard.rescue = self.rescue
        self.watchdog.last_words = functools.partial(self.rescue.request, handoff_s=0.0)
        if self.stop is not None:  # the preemption grace timer's last words
            self.stop.rescuing(self.rescue.request)

    def rebind(self, d) -> None:
        """Move to the process groups of `d` (in-process recovery onto a spare, goodput.run.spares):
        every member of the new generation points its checkpoint group at them; a spare built for
        another rank (it learns its rank only when it takes a dead rank's place) also gets the
        parts built for a rank made again for `d.rank`, by the same expressions as above."""
        old, self.dist = self.dist.rank, d
        ck = self.ckpt
        ck.rank, ck.world, ck.local_rank, ck.pg = d.rank, d.world, d.local_rank, d.ckpt_pg
        if d.rank == old:
            return
        c, r, tr, f = self.cfg, d.rank, self.cfg.trainer, self.cfg.fault
        self.loader.rank = self.app.rank = self.rng.rank = self.watchdog.rank = r
        self.goodput.rank = self.faults.rank = r
        self.faults.slow_s = f.slow_seconds if f.slow_rank == r else 0.0
        local_bs = tr.global_batch_size // d.world
        self.val_loader = eval_loader_of(self.val_loader.dataset, c.data, local_bs, r, d.world, d.device)
        self._new_rescuer()
        if r == 0:  # the MLflow writer is rank 0's
            self.tracker = Tracker(
                c.mlflow.tracking_uri, self.ctx.mlflow_run_id, enabled=True,
                system_metrics_interval_s=c.mlflow.system_metrics_interval_s,
                end_timeout_s=c.mlflow.end_timeout_s, artifact_timeout_s=c.mlflow.artifact_timeout_s,
            )  # fmt: skip
            self.goodput.tracker = self.tracker
        self.stragglers = StragglerWatch(tr.straggler_factor, tr.straggler_windows, r)
        self.profiler = StepProfiler(
            tr.profile_start_step, tr.profile_steps, self.ctx.run_dir, r, d.device, self.tracker
        )

    def batch(self, batch: dict, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs of the step after `step` from a delivered batch, on the device: images, the
        task's targets and weights; then the batch transform (batch_augment), with torch's CPU
        generator seeded from (seed, step) around it and restored after: what it draws is the same
        on every rank and on resume, and draws nothing from the streams the step uses."""
        dev = self.dist.device
        x = batch["image"].to(dev, non_blocking=True)
        y = self.task.targets(batch).to(dev, non_blocking=True)
        w = self.task.weights(batch).to(dev, non_blocking=True)
        if getattr(self.mix, "active", True):
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(batch_seed(self.cfg.seed, step))
                x, y = self.mix(x, self.task.soft(y, self.loader.num_classes))
        return x, y, w

    def eval_module(self) -> torch.nn.Module:
        """The module evaluation and export use (`trainer.eval_on`): the model or its EMA."""
        return self.step.eval_module(self.eval_on)

    def step_done(self, step: int) -> None:
        """The loop calls this after every step: the watchdog's beat and the run's record."""
        self.watchdog.beat(step)
        if self.goodput.step_done(step):  # the first since this (re)start
            groups = self.step.strategy.collective_groups()  # warm-up is over
            set_collective_timeout(self.cfg.parallel.collective_timeout_s, groups)

    def close(self) -> None:
        self.watchdog.stop()
        self.ckpt.close()
        self.loader.close()
        self.val_loader.stop_workers()
