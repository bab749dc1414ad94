"""Schemas of the `data` group (where samples come from, how they are loaded) and of `demo_data`
(the generated demo data). Defaults live here, once; `conf/data/*.yaml` only say what differs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from goodput.storage.remote import check_url


def _raise(errors: list[str]) -> None:
    if errors:
        raise ValueError("\n  - ".join(errors))


@dataclass
class DataConfig:
    source: Any = MISSING
    """Where sample bytes come from: a `_target_` node (the source class, built with
    hydra.utils.instantiate), one option file each: `cached` (goodput.data.sources.CachedSource:
    node-local cache of files + sampler-aware prefetch; options `prefetch_threads`, `cache_limit`),
    `remote` (RemoteSource: every read goes to the remote; no options), `shards`
    (goodput.data.shards.ShardSource: the dataset packed into tar shards, cached whole, packed on
    first use; options `prefetch_threads`, `cache_limit`, `shuffle_block`). Each option's default and
    trade-off is documented in its class's `__init__`; the class takes no other keys."""

    root: str = "${paths.data_dir}"
    """The dataset: a path or fsspec URL (s3://bucket/prefix, gs://..., memory://...) holding
    `train/<class>/<image>` and `val/<class>/<image>`. The default is the generated demo data
    (created on first use)."""

    dataset: Any = field(default_factory=lambda: {"_target_": "goodput.data.dataset.ImageFolder"})
    """The class that lists a split's samples (files under `root`, labels, class names), built with
    hydra.utils.instantiate: `goodput.data.dataset.ImageFolder` (`<split>/<class>/<image>`),
    `goodput.data.dataset.CsvManifest` (`<split>.csv` rows of `path,label`; option `manifest`), or
    a class of your own with the same attributes (see ImageFolder). Samples are decoded as images."""

    cache_dir: str = "${paths.cache_dir}"
    """Node-local cache (of files, shards and listings; handed to the source): put it on the fastest
    local disk. Shared by every rank and worker on the node and kept across restarts."""

    image_size: int = 32
    """Side of the square image, in pixels: the default of the three views below, and the size of
    the generated demo images. Cost grows with its square."""

    train_crop_size: int = "${data.image_size}"  # type: ignore[assignment]
    """The training view: the side the augment pipeline ends at (its presets crop to it). Lower than
    val_crop_size trains faster and, with a larger val_resize_size, often evaluates better
    (torchvision's ResNet-50 recipe: 176 train, resize 232, crop 224: "FixRes")."""

    val_resize_size: int = "${data.image_size}"  # type: ignore[assignment]
    """The evaluation view: the short side is resized to this, then center-cropped to val_crop_size.
    The model record carries both, so evaluate.py and predict.py see what evaluation saw."""

    val_crop_size: int = "${data.image_size}"  # type: ignore[assignment]
    """The evaluation view's center crop (at most val_resize_size)."""

    repeated_augment: int = 1
    """Each sample N times per epoch, each copy with its own augmentation, placed so that on N ranks
    the copies land on different ranks (repeated augmentation, torchvision's RASampler); an epoch is
    then N times as many steps. trainer.global_batch_size must be a multiple of N. 1 = off."""

    num_workers: int = 2
    """DataLoader processes per rank that decode and augment. 0 = in the training process (simplest
    to debug, no overlap with compute). Each worker is a process with its own memory; more than the
    CPU cores per rank only adds contention."""

    prefetch_factor: int = 4
    """Batches each worker prepares ahead. Hides decode jitter; costs num_workers x prefetch_factor
    batches of host memory."""

    prefetch_steps: int = 8
    """Look-ahead, in steps, of the download threads (and the window never evicted from the cache).
    Longer hides latency spikes of the remote; with data.source.cache_limit set, the budget must
    hold (prefetch_steps + 1) global batches of files."""

    on_bad_sample: str = "error"
    """A file that cannot be read or decoded: `error` stops with its name; `skip` trains on without it
    (padding, ignored by the loss) and counts it in MLflow (data/bad_samples)."""

    def __post_init__(self):
        e = []
        for key in (
            "train_crop_size",
            "val_resize_size",
            "val_crop_size",
        ):  # built outside Hydra: the default
            if getattr(self, key) == "${data.image_size}":
                setattr(self, key, self.image_size)
        if not (isinstance(self.source, dict) and "_target_" in self.source):
            e.append(f"data.source must be a node with a _target_ (a class), got {self.source!r}")
        if not (isinstance(self.dataset, dict) and "_target_" in self.dataset):
            e.append(f"data.dataset must be a node with a _target_ (a class), got {self.dataset!r}")
        if self.num_workers < 0:
            e.append(f"data.num_workers must be >= 0, got {self.num_workers}")
        for key in ("image_size", "train_crop_size", "val_resize_size", "val_crop_size"):
            v = getattr(self, key)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 8):
                e.append(f"data.{key} must be an integer >= 8, got {v!r}")
        views = (self.val_crop_size, self.val_resize_size)
        if all(isinstance(v, int) for v in views) and self.val_crop_size > self.val_resize_size:
            e.append(
                f"data.val_crop_size={self.val_crop_size} is larger than data.val_resize_size="
                f"{self.val_resize_size}: the center crop must fit in the resized image"
            )
        if not (isinstance(self.repeated_augment, int) and self.repeated_augment >= 1):
            e.append(f"data.repeated_augment must be an integer >= 1, got {self.repeated_augment!r}")
        if self.prefetch_factor < 1:
            e.append(f"data.prefetch_factor must be >= 1, got {self.prefetch_factor}")
        if self.prefetch_steps < 1:
            e.append(f"data.prefetch_steps must be >= 1, got {self.prefetch_steps}")
        if self.on_bad_sample not in ("error", "skip"):
            e.append(f"data.on_bad_sample must be error|skip, got {self.on_bad_sample!r}")
        try:
            check_url(str(self.root), "data.root")
        except ValueError as err:
            e.append(str(err))
        _raise(e)


@dataclass
class DemoDataConfig:
    """The generated demo dataset (scripts/make_dataset.py); used only when data.root is
    paths.data_dir, whose name is derived from these fields (so a change generates new data)."""

    num_classes: int = 10
    """Shapes to tell apart (at most the number goodput.data.synthetic draws)."""

    train_per_class: int = 500
    """Training images per class (generation takes about a second per thousand)."""

    val_per_class: int = 100
    """Validation images per class."""

    image_size: int = "${data.image_size}"  # type: ignore[assignment]
    """Generated at the training resolution (one setting, data.image_size), so nothing is resized."""

    seed: int = 0
    """Seed of the generator (not of training: that is the top-level `seed`)."""

    kind: str = "shapes"
    """`shapes`: one shape per image, an ImageFolder; `multilabel`: one to three shapes per image, a
    manifest per split (task=multilabel sets it)."""

    def __post_init__(self):
        if self.kind not in ("shapes", "multilabel"):
            raise ValueError(f"demo_data.kind must be shapes|multilabel, got {self.kind!r}")
