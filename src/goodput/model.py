"""A small CNN for the demo; any torchvision classifier works through `model=` configs."""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


class SmallCNN(nn.Module):
    """Three conv blocks + linear head. GroupNorm, not BatchNorm: the maths of a step does not depend
    on how the global batch is split across ranks, so runs on different world sizes stay comparable."""

    def __init__(self, num_classes: int = 10, width: int = 32):
        super().__init__()

        def block(cin, cout, pool):
            layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU()]
            return nn.Sequential(*layers, *([nn.MaxPool2d(2)] if pool else []))

        self.blocks = nn.ModuleList(
            [block(3, width, True), block(width, 2 * width, True), block(2 * width, 4 * width, False)]
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=(2, 3)))


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP shards one by one (then the root): SmallCNN.blocks, or ResNet's layer1..4."""
    if hasattr(model, "blocks"):
        return list(model.blocks)
    return [m for n, m in model.named_children() if n.startswith("layer")]


def model_sha256(model: nn.Module) -> str | None:
    """sha256 over the full, unsharded state dict: keys sorted, each key's bytes then the tensor's
    contiguous CPU bytes. Collective under FSDP; the digest is returned on rank 0 (None elsewhere)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not sd:
        return None
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        # reshape(-1): a 0-dim tensor (BatchNorm's num_batches_tracked) cannot be viewed as bytes
        h.update(sd[k].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
