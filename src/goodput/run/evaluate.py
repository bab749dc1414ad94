"""Validation: one pass over val/ with the task's metrics (goodput.recipe.metrics), exact on any world size.

Each rank evaluates its disjoint slice of val/ (goodput.data.loader.eval_loader: rank r takes samples
r, r+W, r+2W, ...; the short ranks are padded, and the task weighs padding zero), then the metrics'
sums are all-reduced once: every figure is a ratio of sums, so no sample is counted twice or
dropped, on 1 or N ranks.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def evaluate(model, loader, device, world: int, metrics):
    """One pass over this rank's val slice into `metrics` (task.metrics(...)), then their all-reduce
    (collective). Returns `metrics`."""
    task, was_training = metrics.task, model.training
    model.eval()
    for batch in loader:
        logits = model(batch["image"].to(device, non_blocking=True))
        metrics.update(logits, task.targets(batch).to(device), task.weights(batch).to(device))
    metrics.reduce(world)
    if was_training:
        model.train()
    return metrics
