"""The sample order: exactly once per epoch, the same for any world size and worker count."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from goodput.data.sampler import GlobalOrder, OrderHash, StepBatchSampler, sample_seed


def test_every_index_once_per_epoch_across_ranks():
    order = GlobalOrder(num_samples=103, global_batch_size=12, seed=3)
    assert order.steps_per_epoch == 8  # the partial last batch (7 samples) is dropped
    for epoch in (0, 1):
        seen = []
        for step in range(epoch * 8, (epoch + 1) * 8):
            for rank in range(3):
                seen += order.rank_batch(step, rank, 3)
        assert len(seen) == len(set(seen)) == 96
    assert not torch.equal(order.permutation(0), order.permutation(1))  # reshuffled per epoch


def test_global_order_is_independent_of_world_size():
    order = GlobalOrder(64, 8, seed=1)
    for step in range(10):
        for world in (1, 2, 4, 8):
            merged = sum((order.rank_batch(step, r, world) for r in range(world)), [])
            assert merged == order.global_batch(step).tolist()


def test_workers_get_disjoint_batches_and_order_is_kept():
    order = GlobalOrder(40, 4, seed=0)

    class Echo(torch.utils.data.Dataset):
        def __getitem__(self, key):
            return key[1]

        def __len__(self):
            return 40

    expected = [order.rank_batch(s, 1, 2) for s in range(3, 15)]
    for workers in (0, 1, 2):
        dl = DataLoader(Echo(), batch_sampler=StepBatchSampler(order, 1, 2, 3, 15), num_workers=workers)
        assert [b.tolist() for b in dl] == expected


def test_order_hash_chain_and_seeds_are_pure():
    a, b = OrderHash(), OrderHash()
    for t in (torch.tensor([1, 2]), torch.tensor([3])):
        a.update(t)
        b.update(t)
    assert a.hexdigest == b.hexdigest
    c = OrderHash()
    c.update(torch.tensor([2, 1]))
    c.update(torch.tensor([3]))
    assert c.hexdigest != a.hexdigest
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3) != sample_seed(1, 2, 4)


def test_repeated_augmentation_puts_each_copy_on_another_rank():
    """data.repeated_augment=N: a step's global batch is G/N samples N times over; on N ranks each
    rank holds one copy of every sample of the step (and the copies differ in number), every sample
    comes N times an epoch, and the global order is the same on any world size."""
    from goodput.data.sampler import GlobalOrder

    order = GlobalOrder(40, 8, seed=3).repeated(2)
    assert order.steps_per_epoch == 10
    seen = []
    for step in range(10):
        r0, r1 = order.rank_batch(step, 0, 2), order.rank_batch(step, 1, 2)
        assert r0 == r1 and len(set(r0)) == 4  # the same 4 samples on both ranks
        assert order.rank_copies(0, 2) == [0] * 4 and order.rank_copies(1, 2) == [1] * 4
        assert order.global_batch(step).tolist() == order.rank_batch(step, 0, 1)
        seen += r0 + r1
    assert sorted(seen) == sorted(list(range(40)) * 2)  # each sample twice an epoch
    with pytest.raises(ValueError, match=r"data.repeated_augment=3 must divide trainer.global_batch_size=8"):
        GlobalOrder(40, 8, seed=3).repeated(3)
