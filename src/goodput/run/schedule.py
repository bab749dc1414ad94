"""The default LR schedule (optim/schedule=warmup_cosine; its schema is goodput.run.config.ScheduleConfig)."""

from __future__ import annotations

import math

import torch


def warmup_cosine(
    optimizer, total_steps: int, warmup_steps: int = 20, min_lr_ratio: float = 0.05, warmup_epochs=None
):
    """Linear warm-up, then cosine decay to lr x min_lr_ratio at total_steps. A value that makes no
    schedule is a ValueError (goodput.config.optim_errors names the key before any work), a warm-up
    as long as the run or longer too (the LR would never leave it). The defaults are
    ScheduleConfig's: they let that check find which key was refused. `warmup_epochs` is turned
    into warmup_steps by the job (goodput.run.job.epochs_to_steps), which knows the epoch's length."""
    if warmup_epochs is not None:
        raise ValueError("warmup_epochs is turned into warmup_steps by goodput.run.job.prepare")
    for name, v in (("warmup_steps", warmup_steps), ("total_steps", total_steps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
    if warmup_steps and warmup_steps >= total_steps:
        raise ValueError(
            f"the warm-up (warmup_steps={warmup_steps}) is as long as the run or longer (total_steps="
            f"{total_steps}, trainer.max_steps): the LR would never leave it. Shorten the warm-up "
            "(optim.schedule.warmup_steps or warmup_epochs) or train longer"
        )
    if (
        isinstance(min_lr_ratio, bool)
        or not isinstance(min_lr_ratio, int | float)
        or not 0 <= min_lr_ratio <= 1
    ):
        raise ValueError(f"min_lr_ratio must be a number in [0, 1], got {min_lr_ratio!r}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(warmup_steps, total_steps, min_lr_ratio))


def lr_schedule(warmup_steps: int, max_steps: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f
