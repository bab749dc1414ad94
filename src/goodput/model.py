"""The model's digest (summary.json `model_sha256`). The models themselves are the recipe's
(goodput.recipe.models); SmallCNN is named here too because records written before it moved (commits,
exports, MLflow models) build it by this name."""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from goodput.recipe.models import SmallCNN  # noqa: F401  (older records' name for it)


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
