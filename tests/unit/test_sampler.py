"""The sample order: exactly once per epoch, the same for any world size and worker count."""

from __future__ import annotations

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
