"""Transforms of a whole delivered batch (the `batch_augment` group): MixUp and CutMix.

The engine calls `transform(x, targets)` on each rank's part of the global batch, on the device,
right after the loader delivers it and before the step; `targets` are the task's probabilities
(task.soft). Around the call torch's generator is seeded from (seed, step), so whatever the
transform draws is the same on every rank, on resume and at any worker count
(goodput.run.build.Trainer.batch). A transform of your own: a class with `__call__(x, targets)`
returning both, and `pairs` (True when it mixes samples with each other: the per-rank batch must be
even), selected with `batch_augment._target_=...`.
"""

from __future__ import annotations

import torch
from torchvision import tv_tensors
from torchvision.transforms import v2


class MixUpCutMix:
    """torchvision's MixUp (`mixup_alpha`), CutMix (`cutmix_alpha`) or, with both, one of them per
    step (`switch_prob`: the chance of CutMix); neither = off. One mixing coefficient (and CutMix box)
    per step, as torchvision's reference draws one per batch.

    Samples are mixed in pairs of neighbours of the global batch, (0, 1), (2, 3), ...: the batch is
    handed to torchvision as its two interleaved halves (a "video" of two frames sequences), which
    MixUp and CutMix swap. torchvision pairs each sample with the previous one in the batch it is
    given, and a rank holds only its slice of the global batch; with pairs inside every even slice,
    each rank's result is its part of what one process computes on the whole batch, at any world size."""

    pairs = True

    def __init__(self, mixup_alpha: float | None = None, cutmix_alpha: float | None = None,
                 switch_prob: float = 0.5):  # fmt: skip
        for key, alpha in (("mixup_alpha", mixup_alpha), ("cutmix_alpha", cutmix_alpha)):
            if alpha is not None and not alpha > 0:
                raise ValueError(f"batch_augment.{key} must be > 0 or null, got {alpha}")
        if not 0.0 <= switch_prob <= 1.0:
            raise ValueError(f"batch_augment.switch_prob must be in [0, 1], got {switch_prob}")
        mixup = v2.MixUp(alpha=mixup_alpha) if mixup_alpha else None
        cutmix = v2.CutMix(alpha=cutmix_alpha) if cutmix_alpha else None
        if mixup and cutmix:
            self.transform = v2.RandomChoice([mixup, cutmix], p=[1 - switch_prob, switch_prob])
        else:
            self.transform = mixup or cutmix

    @property
    def active(self) -> bool:
        return self.transform is not None

    def __call__(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.transform is None:
            return x, targets
        b, shape, n = len(x), x.shape[1:], targets.shape[1]
        halves = tv_tensors.Video(x.reshape(b // 2, 2, *shape).transpose(0, 1))  # [evens, odds]
        mixed, soft = self.transform(halves, targets.reshape(b // 2, 2, n).transpose(0, 1).reshape(2, -1))
        x = mixed.as_subclass(torch.Tensor).transpose(0, 1).reshape(b, *shape)
        return x, soft.reshape(2, b // 2, n).transpose(0, 1).reshape(b, n)
