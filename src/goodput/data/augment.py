"""Image transforms from config: the `augment` group (`augment=none|light|standard`, or your own list).

A preset is a list of torchvision v2 transforms by `_target_`, applied to the decoded uint8 image
(C, H, W) of a training sample, ending at `data.train_crop_size`. Then come the two steps the eval
transform shares, `ToDtype(float32, scale=True)` and `Normalize(mean, std)`, and last the
`after_normalize` list (RandomErasing: erased pixels at the mean, as torchvision's reference
erases them). The eval transform is derived, not configured: resize the short side to
`data.val_resize_size`, center-crop to `data.val_crop_size`, normalize.

Randomness: v2 transforms draw from the global torch RNG. The dataset runs the train pipeline inside
`torch.random.fork_rng()` seeded from (seed, epoch, index), so whatever the list holds, the augmented
tensor of a sample is a pure function of those three numbers (any worker count, any resume point).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

if TYPE_CHECKING:
    from torchvision.transforms import v2

# torch and torchvision are imported where they are used: AugmentConfig, the schema below, is
# imported whenever Hydra composes the config (`--help`, the compose API), which must not pay for them.

V2 = "torchvision.transforms.v2."
SIZE = "${data.train_crop_size}"  # resolved from the data node (or from `image_size` outside Hydra)


def _standard() -> list[dict]:
    return [
        {"_target_": V2 + "RandomResizedCrop", "size": SIZE, "scale": [0.6, 1.0], "antialias": True},
        {"_target_": V2 + "RandomHorizontalFlip"},
        {"_target_": V2 + "ColorJitter", "brightness": 0.2, "contrast": 0.2, "saturation": 0.2},
    ]


@dataclass
class AugmentConfig:
    """Schema of the `augment` group. The defaults are the `standard` preset."""

    train: list[Any] = field(default_factory=_standard)
    """Training transforms, in order, each a node with `_target_` (any torchvision v2 transform, or
    your own callable taking and returning a tensor image). They must end at a
    `data.train_crop_size` square image: checked once at start-up, naming the mismatch.
    An empty list trains on the eval view (resize + center crop): no augmentation. Flips and colour
    jitter help natural photos and hurt where orientation or colour is the label (digits, text,
    medical, satellite): use `augment=light` or `none` there."""

    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    """Per-channel mean subtracted after scaling to [0, 1]; train and eval share it."""

    std: list[float] = field(default_factory=lambda: [0.25, 0.25, 0.25])
    """Per-channel std divided by after subtracting the mean; train and eval share it."""

    after_normalize: list[Any] = field(default_factory=list)
    """Training transforms applied to the normalized float tensor, after `train` and Normalize:
    `torchvision.transforms.v2.RandomErasing` there erases to the mean (0 after normalization), as
    torchvision's reference recipe does. Same node form as `train`; they must keep the size."""


def _as_dict(cfg) -> dict:
    """A plain dict with every key of the schema (missing ones from its defaults, unknown ones refused)."""
    if isinstance(cfg, AugmentConfig):
        return OmegaConf.to_container(OmegaConf.structured(cfg))
    try:
        return OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(AugmentConfig), cfg))
    except Exception as e:
        raise ValueError(f"augment: {e}") from e


def _normalize(mean, std) -> list:
    import torch
    from torchvision.transforms import v2

    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]


def _eval_view(crop: int, resize: int | None = None) -> list:
    from torchvision.transforms import v2

    return [v2.Resize(resize or crop, antialias=True), v2.CenterCrop(crop)]


def build(
    cfg: AugmentConfig | dict | None, image_size: int, resize: int | None = None, crop: int | None = None
) -> tuple[v2.Compose, v2.Compose]:
    """(train transform, eval transform): training ends at `image_size` (data.train_crop_size), the
    eval view resizes to `resize` and center-crops to `crop` (data.val_*; None: image_size). `cfg`
    None = the defaults."""
    from torchvision.transforms import v2

    c = _as_dict(cfg if cfg is not None else AugmentConfig())
    # `${data.train_crop_size}` in a node: resolve it here, so a config built outside Hydra works too.
    sizes = {"image_size": image_size, "train_crop_size": image_size}
    c = OmegaConf.to_container(OmegaConf.create({"data": sizes, "augment": c}), resolve=True)["augment"]
    steps, after = (
        _nodes(c["train"], "augment.train"),
        _nodes(c["after_normalize"], "augment.after_normalize"),
    )
    train = v2.Compose((steps or _eval_view(image_size)) + _normalize(c["mean"], c["std"]) + after)
    _check_size(train, image_size)
    return train, eval_transform(crop or image_size, c["mean"], c["std"], resize)


def _nodes(nodes: list | None, key: str) -> list:
    from hydra.utils import instantiate

    out = []
    for i, node in enumerate(nodes or []):
        if not isinstance(node, dict) or "_target_" not in node:
            raise ValueError(f"{key}[{i}] must be a node with a _target_, got {node!r}")
        out.append(instantiate(node, _convert_="all"))
    return out


def eval_transform(image_size: int, mean, std, resize: int | None = None) -> v2.Compose:
    """The eval view: resize the short side to `resize` (None: image_size), center-crop to
    `image_size`, normalize. Evaluation during training, scripts/evaluate.py and scripts/predict.py
    (from a model record: goodput.checkpoint.spec) share it."""
    from torchvision.transforms import v2

    return v2.Compose(_eval_view(image_size, resize) + _normalize(mean, std))


def _check_size(transform: v2.Compose, size: int) -> None:
    """Fail at start-up, not in a DataLoader worker, when the pipeline does not end at size x size."""
    import torch

    probe = torch.zeros(3, 2 * size + 3, size + 5, dtype=torch.uint8)  # odd, non-square on purpose
    with torch.random.fork_rng(devices=[]):
        out = transform(probe)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (3, size, size):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"augment.train must produce a 3 x {size} x {size} image (data.train_crop_size={size}), got "
            f"{got}: end the list with a crop or resize to data.train_crop_size"
        )
