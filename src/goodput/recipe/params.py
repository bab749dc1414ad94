"""The optimizer's parameter groups, from the model's named parameters (`optim.*_weight_decay`).

`param_groups` is what the optimizer is built with (goodput.run.build): edit it for name-aware
groups (a lower learning rate for a backbone, no decay for embeddings). Every group is plain
torch: its keys override the optimizer's for its parameters, and the optimizer's state (and the
checkpoint) keeps them, so a resumed or resharded run has the same groups.
"""

from __future__ import annotations

from torch import nn

# Normalization layers whose weight and bias `optim.norm_weight_decay` applies to (any subclass too).
NORMS = (
    nn.modules.batchnorm._BatchNorm,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)


def param_groups(model: nn.Module, norm_weight_decay: float | None = None,
                 bias_weight_decay: float | None = None) -> list[dict]:  # fmt: skip
    """Groups of `model`'s parameters: the norm layers' (norm_weight_decay), the biases
    (bias_weight_decay; a norm layer's bias too, as torchvision's reference does), the rest. A
    setting left null keeps the optimizer's weight decay, and its parameters stay with the rest;
    with both null, one group of every parameter, in the model's order (what plain
    `model.parameters()` gives)."""
    groups, seen = {"other": [], "norm": [], "bias": []}, set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # a parameter shared by two modules is one parameter
                continue
            seen.add(id(p))
            if bias_weight_decay is not None and name == "bias":
                groups["bias"].append(p)
            elif norm_weight_decay is not None and isinstance(module, NORMS):
                groups["norm"].append(p)
            else:
                groups["other"].append(p)
    decay = {"norm": norm_weight_decay, "bias": bias_weight_decay}
    out = [{"params": groups["other"]}] if groups["other"] else []
    for kind in ("norm", "bias"):
        if groups[kind]:
            out.append({"params": groups[kind], "weight_decay": decay[kind]})
    return out
