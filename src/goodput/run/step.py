"""One optimizer step, top to bottom: forward under autocast, the task's loss, backward with scaling
over the micro-batches of the rank's batch, clipping, the optimizer, the LR schedule, the EMA of the
weights. What the step promises the checkpoint is `StepGuard`'s, stated once.

The loop calls `Step.__call__` once per optimizer step and checkpoints only between calls, so a
checkpoint is always at an optimizer-step boundary: a run stopped between micro-steps resumes from
the last whole step and re-reads the same micro-batches (the loader's position is per step).

Nothing here asks which parallel backend runs: the strategy (goodput.parallel) supplies the
gradient-sync switch for accumulation and the gradient scaler, which are what differ between them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

# trainer.precision -> the autocast dtype (None: full fp32, no autocast)
PRECISIONS = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass
class StepOptions:
    """The `trainer` keys the step acts on (validated by goodput.run.config.TrainerConfig)."""

    precision: str = "32"
    micro_batch_size: int | None = None
    clip_grad_norm: float | None = None
    ema_decay: float | None = None
    ema_every_n_steps: int = 1
    ema_start_step: int = 0
    channels_last: bool = False


class StepGuard:
    """What the step promises the checkpoint, kept in one place (goodput.run.build makes it):

    - Staging. An async save copies the state while training goes on: the step waits for that copy
      before it changes what the copy reads, before a forward that updates buffers (BatchNorm's
      running statistics) and before the optimizer updates parameters (`wait_for_staging`).
    - No half-written step. From the moment the optimizer starts writing parameters until the loop
      marks the next step boundary, no rescue is written (`rescue.updating`): the state would be no
      step's. The mark is an optimizer step pre-hook, so it is where the update really starts,
      whatever calls `optimizer.step()` (a GradScaler that skips the step never starts it).

    `faults` (goodput.resilience.fault): the drills' sites after the forward, between micro-steps and
    inside the update. Every part is optional: a bare guard is a step with no checkpoint to keep."""

    def __init__(self, wait_for_staging=None, rescue=None, faults=None):
        self.wait_for_staging, self.rescue, self.faults = wait_for_staging, rescue, faults

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_pre_hook(self._update_begins)  # first: before any hook of yours

    def before_change(self) -> None:
        if self.wait_for_staging is not None:
            self.wait_for_staging()

    def after_forward(self, step: int) -> None:
        if self.faults is not None:
            self.faults.after_forward(step)

    def between_micro_steps(self, step: int) -> None:
        if self.faults is not None:
            self.faults.in_step(step)

    def _update_begins(self, optimizer, args, kwargs) -> None:
        self.update_begins()

    def update_begins(self) -> None:
        if self.rescue is not None:
            self.rescue.updating()
        if self.faults is not None:
            self.faults.in_update()  # the `update` drill stops inside the optimizer step


def make_ema(model: nn.Module, decay: float) -> AveragedModel:
    """An exponential moving average of `model`'s weights (and buffers), a deep copy of it: built
    from the unwrapped model, before the strategy wraps it (the copy is then sharded like it)."""
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
    ema.requires_grad_(False)
    return ema


def accumulation_steps(per_rank_batch: int, micro_batch_size: int | None) -> int:
    """How many micro-batches make the rank's share of one global batch."""
    if micro_batch_size is None:
        return 1
    if micro_batch_size > per_rank_batch or per_rank_batch % micro_batch_size:
        raise ValueError(
            f"trainer.micro_batch_size={micro_batch_size} must divide the per-rank batch "
            f"{per_rank_batch} (trainer.global_batch_size / world size)"
        )
    return per_rank_batch // micro_batch_size


class Step:
    """The training step. `model` is the wrapped module whose parameters the optimizer holds;
    `forward` is what the step calls for the forward pass (the same module, or a compiled wrapper
    of it: state dicts are always taken from `model`, never from a wrapper); `task` gives the loss
    of each sample (goodput.recipe.task; default: classification with cross-entropy).

    Stateful: its own counters (JSON) go into the checkpoint beside the scaler's state; the EMA's
    tensors are registered as a module group of their own (goodput.run.build)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        strategy,
        opts: StepOptions,
        device: torch.device,
        per_rank_batch: int,
        ema: AveragedModel | None = None,
        task=None,
        guard: StepGuard | None = None,
    ):
        if task is None:
            from goodput.recipe.task import Classification

            task = Classification(nn.CrossEntropyLoss())
        self.model, self.forward, self.task = model, model, task
        self.optimizer, self.scheduler, self.strategy = optimizer, scheduler, strategy
        self.opts, self.device, self.ema = opts, device, ema
        self.n_micro = accumulation_steps(per_rank_batch, opts.micro_batch_size)
        self.autocast_dtype = PRECISIONS[str(opts.precision)]
        # fp16's narrow range needs loss scaling; bf16 has fp32's exponent range and does not.
        self.scaler = strategy.grad_scaler(device, enabled=str(opts.precision) == "16-mixed")
        # forward mutates buffers (BatchNorm stats): an async save's copy must be done before it
        self.has_buffers = any(True for _ in model.buffers())
        self.guard = guard or StepGuard()
        self.guard.attach(optimizer)
        self.skipped_steps = 0  # fp16: optimizer steps the scaler skipped (an inf or nan gradient)
        self.last_grad_norm: torch.Tensor | None = None
        self._stepped = False  # whether the optimizer ran in this step (the scaler may skip it)
        optimizer.register_step_post_hook(self._optimizer_stepped)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, step: int, w: torch.Tensor | None = None):
        """One optimizer step on the rank's batch: inputs `x`, the task's targets `y`, each sample's
        weight `w` (0: padding or a skipped file; None: all 1); `step` is the number of steps done
        before it. Returns the batch's mean loss (a tensor: reading it is a device sync)."""
        if self.opts.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        if self.has_buffers:
            self.guard.before_change()
        self.optimizer.zero_grad(set_to_none=True)
        w = torch.ones(len(x), device=x.device) if w is None else w
        total = w.sum().clamp(min=1.0)  # the mean over the samples that count: no sync to compute it
        loss_sum = torch.zeros((), device=self.device)
        xs, ys, ws = x.chunk(self.n_micro), y.chunk(self.n_micro), w.chunk(self.n_micro)
        for i, (xm, ym, wm) in enumerate(zip(xs, ys, ws)):  # fewer micro-batches if the batch is short
            last = i == len(xs) - 1
            # DDP all-reduces / FSDP reduce-scatters gradients only on the last micro-step
            sync = contextlib.nullcontext() if last else self.strategy.no_sync(self.model)
            with sync:
                with self.autocast():
                    out = self.forward(xm)
                loss = self.task.mean_loss(out, ym, wm, total)  # this micro-batch's share, in fp32
                if i == 0:
                    self.guard.after_forward(step)
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
            if not last:
                self.guard.between_micro_steps(step)

        if self.opts.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            self.last_grad_norm = clip_grad_norm(self.model.parameters(), self.opts.clip_grad_norm)
        self.guard.before_change()  # an async save's copy must finish before parameters change
        self._stepped = False
        self.scaler.step(self.optimizer)  # fp16: skipped when a gradient is inf/nan
        self.scaler.update()
        if not self._stepped:  # counted where it happens, not from the scale (a NaN one never drops)
            self.skipped_steps += 1
            self.guard.update_begins()  # no parameter moved, but the EMA below may
        self.scheduler.step()
        done = step + 1
        o = self.opts
        if self.ema is not None and done > o.ema_start_step and done % o.ema_every_n_steps == 0:
            self.ema.update_parameters(self.model)
        return loss_sum

    def autocast(self):
        dtype = self.autocast_dtype
        return torch.autocast(self.device.type, dtype, enabled=dtype is not None)

    def metrics(self) -> dict:
        """What the loop logs every log_every_n_steps (reading them syncs with the device)."""
        m = {}
        if self.last_grad_norm is not None:
            m["train/grad_norm"] = self.last_grad_norm.item()
        if self.scaler.is_enabled():
            m["train/grad_scale"] = self.scaler.get_scale()
            m["train/skipped_steps"] = self.skipped_steps
        return m

    def eval_module(self, eval_on: str) -> nn.Module:
        """The weights evaluation and export use: the trained model, or its EMA."""
        if eval_on == "ema":
            if self.ema is None:
                raise ValueError("trainer.eval_on=ema needs trainer.ema_decay")
            return self.ema.module
        return self.model

    def _optimizer_stepped(self, optimizer, args, kwargs) -> None:
        self._stepped = True

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        """Checked before anything is applied: a bad value raises ValueError naming the field, and
        the restore falls back to the previous commit (as for any state that does not load)."""
        bad = scaler_state_errors(sd["scaler"]) if sd["scaler"] else []  # {}: the scaler is disabled
        if not _count(sd.get("skipped_steps")):
            bad.append(f"skipped_steps={sd.get('skipped_steps')!r} (an int >= 0)")
        if bad:
            raise ValueError("invalid training-step state: " + "; ".join(bad))
        if sd["scaler"]:
            self.scaler.load_state_dict(sd["scaler"])
        self.skipped_steps = sd["skipped_steps"]


def _real(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# GradScaler state field -> (valid?, what it must be). A NaN, infinite or non-positive scale makes
# every step skip (a NaN one forever: it never backs off into range).
SCALER_FIELDS = {
    "scale": (lambda v: _real(v) and v > 0, "finite and > 0"),
    "growth_factor": (lambda v: _real(v) and v > 1, "finite and > 1"),
    "backoff_factor": (lambda v: _real(v) and 0 < v < 1, "in (0, 1)"),
    "growth_interval": (lambda v: _count(v) and v >= 1, "an int >= 1"),
    "_growth_tracker": (_count, "an int >= 0"),
}


def scaler_state_errors(sd: dict) -> list[str]:
    """What is wrong with a GradScaler state dict read from a checkpoint, one entry per field."""
    return [
        f"scaler.{k}={sd.get(k)!r} (must be {why})"
        for k, (ok, why) in SCALER_FIELDS.items()
        if not ok(sd.get(k))
    ]


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip to a total norm of `max_norm`; returns the norm before clipping. Under FSDP2 each
    gradient is a DTensor shard: the norm is over all shards (a DTensor reduced across ranks), so
    every rank scales by the same factor, the one the unsharded gradients would get."""
    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
