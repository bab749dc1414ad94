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
    """Side of the square training image, in pixels (the augment pipeline ends there, eval resizes
    and center-crops to it). Also the size of the generated demo images. Cost grows with its square."""

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
        if not (isinstance(self.source, dict) and "_target_" in self.source):
            e.append(f"data.source must be a node with a _target_ (a class), got {self.source!r}")
        if not (isinstance(self.dataset, dict) and "_target_" in self.dataset):
            e.append(f"data.dataset must be a node with a _target_ (a class), got {self.dataset!r}")
        if self.num_workers < 0:
            e.append(f"data.num_workers must be >= 0, got {self.num_workers}")
        if self.image_size < 8:
            e.append(f"data.image_size must be >= 8, got {self.image_size}")
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
