"""The default LR schedule (optim/schedule=warmup_cosine; its schema is goodput.run.config.ScheduleConfig)."""

from __future__ import annotations

import math

import torch


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
