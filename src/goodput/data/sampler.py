"""The global sample order as a pure function, and a batch sampler that walks it from any step.

Order contract (DESIGN.md): epoch e's order is a permutation from (seed, e); global step k consumes
positions [k*G, (k+1)*G) of it (G = global batch size, the last partial batch of an epoch is dropped);
rank r of W takes the contiguous slice [r*G/W, (r+1)*G/W) of that global batch. Nothing here depends
on worker count, and the *global* order does not depend on W: that is what makes resume exact and
elastic. The only state is (seed, step); epoch and position are derived from it.

Repeated augmentation (data.repeated_augment=N): global batch k holds G/N samples of the epoch's
permutation, N times over (copy c at positions [c*G/N, (c+1)*G/N)), so on N ranks each rank holds
one copy of every sample of the step and no rank holds two; the dataset key carries the copy, whose
augmentation has its own seed. An epoch is N x num_samples // G steps.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import torch

from goodput.errors import UserError


class DatasetTooSmall(UserError, ValueError):
    """Fewer training samples than one global batch: not one step could be taken."""


class GlobalOrder:
    def __init__(self, num_samples: int, global_batch_size: int, seed: int, repeats: int = 1):
        if global_batch_size % repeats:
            raise ValueError(
                f"data.repeated_augment={repeats} must divide trainer.global_batch_size={global_batch_size}"
            )
        if num_samples * repeats < global_batch_size:
            raise DatasetTooSmall(
                f"the training split has {num_samples} samples, fewer than one global batch "
                f"(trainer.global_batch_size={global_batch_size}): set trainer.global_batch_size to at "
                f"most {num_samples} (divisible by the world size), or add samples"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.repeats = repeats
        self.steps_per_epoch = num_samples * repeats // global_batch_size

    def repeated(self, repeats: int) -> GlobalOrder:
        """This order with every sample `repeats` times per epoch (data.repeated_augment; a source's
        order class, ShardOrder too, gets it through here)."""
        if repeats != self.repeats:
            GlobalOrder.__init__(self, self.num_samples, self.global_batch_size, self.seed, repeats)
        return self

    @lru_cache(maxsize=2)  # noqa: B019 - a handful of orders per run, each lives as long as the run
    def permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_mix(self.seed, epoch))
        return torch.randperm(self.num_samples, generator=g)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def global_batch(self, step: int) -> torch.Tensor:
        epoch, k = divmod(step, self.steps_per_epoch)
        g = self.global_batch_size // self.repeats  # distinct samples per step
        batch = self.permutation(epoch)[k * g : (k + 1) * g]
        return batch.repeat(self.repeats) if self.repeats > 1 else batch

    def rank_batch(self, step: int, rank: int, world: int) -> list[int]:
        b = self.global_batch_size // world
        return self.global_batch(step)[rank * b : (rank + 1) * b].tolist()

    def rank_copies(self, rank: int, world: int) -> list[int]:
        """The copy number (repeated augmentation) of each position of a rank's batch."""
        b, distinct = self.global_batch_size // world, self.global_batch_size // self.repeats
        return [p // distinct for p in range(rank * b, (rank + 1) * b)]


def dropped_per_epoch(num_samples: int, global_batch_size: int, world: int) -> str | None:
    """A warning when the last partial global batch, dropped each epoch, is more than a tenth of
    the epoch (None otherwise): the numbers, and a batch size that drops less."""
    n, g = num_samples, global_batch_size
    drop = n % g
    if drop * 10 <= n:
        return None
    better = next((b for b in range(g, 0, -1) if b % world == 0 and n % b * 10 <= n), None)
    fix = f"trainer.global_batch_size={better} drops {n % better}, or add samples" if better else ""
    return (
        f"{n} training samples, global batch {g}: each epoch uses {n - drop} and drops {drop} "
        f"({round(100 * drop / n)}%, a different {drop} each epoch: the order is reshuffled). To use "
        f"more of each epoch: {fix or 'add samples'}"
    )


def _mix(*ints: int) -> int:
    """A stable 63-bit seed from integers (Python's hash() is salted per process)."""
    h = hashlib.blake2b(":".join(map(str, ints)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """Augmentation seed of one sample: a pure function of (seed, epoch, index)."""
    return _mix(seed, epoch, index)


def copy_seed(seed: int, epoch: int, index: int, copy: int) -> int:
    """Augmentation seed of copy `copy` of a sample (data.repeated_augment); copy 0 is sample_seed's."""
    return sample_seed(seed, epoch, index) if copy == 0 else _mix(seed, epoch, index, copy)


def batch_seed(seed: int, step: int) -> int:
    """Seed of the batch transform of the step after `step` (goodput.recipe.batch): a pure function of
    (seed, step), the same on every rank."""
    return _mix(seed, "batch", step)


class StepBatchSampler:
    """Yields this rank's batches for steps [start, stop) as lists of (epoch, index) keys.

    The dataset receives the epoch with the index (and the copy, with repeated augmentation), so
    augmentation can be seeded per sample without any worker-local RNG. DataLoader workers each
    take whole batches, so every worker gets a disjoint slice, whatever `num_workers` is.
    """

    def __init__(self, order: GlobalOrder, rank: int, world: int, start: int, stop: int):
        self.order, self.rank, self.world, self.start, self.stop = order, rank, world, start, stop

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __iter__(self):
        copies = self.order.rank_copies(self.rank, self.world) if self.order.repeats > 1 else None
        for step in range(self.start, self.stop):
            epoch, batch = self.order.epoch_of(step), self.order.rank_batch(step, self.rank, self.world)
            if copies is None:
                yield [(epoch, i) for i in batch]
            else:  # the copy's own augmentation (copy_seed)
                yield [(epoch, i, c) for i, c in zip(batch, copies)]


class OrderHash:
    """sha256 hash chain over the global sample indices consumed, step by step.

    Every rank computes the same chain from the global batch (not its own slice), so the
    value is comparable across world sizes and is what `summary.json` reports.
    """

    def __init__(self, hexdigest: str = ""):
        self.hexdigest = hexdigest or hashlib.sha256(b"goodput-sample-order").hexdigest()

    def update(self, indices: torch.Tensor) -> None:
        h = hashlib.sha256(bytes.fromhex(self.hexdigest))
        h.update(indices.to(torch.int64).numpy().tobytes())
        self.hexdigest = h.hexdigest()
