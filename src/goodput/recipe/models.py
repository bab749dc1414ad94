"""The models (the `model` group's `_target_`s), each with its shard plan.

A shard plan names the blocks FSDP (parallel=fsdp, hsdp) wraps one by one: the parameters of one
block are gathered while it computes, then freed, so memory holds one block unsharded at a time.
It is a tuple of patterns over `named_modules()` names, one `*` per name part ("blocks.*" is
blocks.0, blocks.1, ..., not their insides), given by the model class (`shard_units`), by
SHARD_PLANS for builders that are not yours (torchvision's), or by `parallel.shard_units`
(which wins). A model without a plan is refused under fsdp/hsdp: sharded as one unit, every
parameter would be gathered at once.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

# builder `_target_` prefix -> its shard plan (torchvision's classifiers)
SHARD_PLANS = {
    "torchvision.models.resnet": ("layer1", "layer2", "layer3", "layer4"),
    "torchvision.models.wide_resnet": ("layer1", "layer2", "layer3", "layer4"),
    "torchvision.models.resnext": ("layer1", "layer2", "layer3", "layer4"),
    "torchvision.models.vit_": ("encoder.layers.*",),
    "torchvision.models.convnext_": ("features.*",),
    "torchvision.models.efficientnet_": ("features.*",),
    "torchvision.models.mobilenet_": ("features.*",),
    "torchvision.models.swin_": ("features.*",),
    "torchvision.models.regnet_": ("trunk_output.*",),
}


class SmallCNN(nn.Module):
    """Three conv blocks and a linear head. GroupNorm, not BatchNorm: the maths of a step does not
    depend on how the global batch is split across ranks, so runs on different world sizes stay
    comparable."""

    shard_units = ("blocks.*",)

    def __init__(self, num_classes: int = 10, width: int = 32):
        super().__init__()
        if not (isinstance(width, int) and width >= 8 and width % 8 == 0):
            raise ValueError(f"width must be a multiple of 8 (GroupNorm's 8 groups), got {width!r}")

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


def shard_plan(model: nn.Module, target: str | None, configured: list[str] | None = None) -> tuple[str, ...]:
    """The patterns of `model`'s shard plan: `configured` (parallel.shard_units), else the class's
    `shard_units`, else SHARD_PLANS by the `_target_` that built it; () when none says."""
    if configured:
        return tuple(configured)
    own = getattr(model, "shard_units", None)
    if own:
        return tuple(own)
    for prefix, plan in SHARD_PLANS.items():
        if (target or "").startswith(prefix):
            return plan
    return ()


def missing_plan(model: nn.Module, target: str | None, configured: list[str] | None) -> str | None:
    """Why `model` cannot be sharded block by block (parallel=fsdp|hsdp), or None when it can."""
    plan = shard_plan(model, target, configured)
    if shard_units(model, plan):
        return None
    matching = f" matching parallel.shard_units={list(plan)}" if configured else ""
    return (
        f"model {target} has no shard plan{matching}: FSDP would gather all its parameters at once. Declare "
        "`shard_units` on its class or register its builder in SHARD_PLANS (goodput/recipe/models.py), or "
        "set parallel.shard_units (patterns of module names, e.g. '[layer*]')"
    )


def shard_units(model: nn.Module, plan: tuple[str, ...]) -> list[nn.Module]:
    """The submodules the plan's patterns match (those holding parameters), in module order."""
    out = []
    for name, m in model.named_modules():
        parts = name.split(".")
        hit = any(len(p.split(".")) == len(parts) and fnmatchcase(name, p) for p in plan)
        if name and hit and any(True for _ in m.parameters()):
            out.append(m)
    return out
