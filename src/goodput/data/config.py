"""Schemas of the `data` group (where samples come from, how they are loaded) and of `dataset` (the
generated demo data). Defaults live here, once; `conf/data/*.yaml` only say what differs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from goodput.storage import check_url


def _raise(errors: list[str]) -> None:
    if errors:
        raise ValueError("\n  - ".join(errors))


# The options of data.backend; goodput.data.loader.SOURCES maps each to its class (a test checks
# they agree; the classes import this module for their defaults, so it cannot import them).
BACKENDS = ("cached", "remote", "shards")


@dataclass
class DataConfig:
    backend: str = MISSING
    """Where sample bytes come from (one class per option: goodput.data.loader.SOURCES):
    `cached` = node-local cache of files + sampler-aware prefetch, `remote` = every read goes to the
    remote, `shards` = the dataset packed into tar shards, cached whole (packed on first use)."""

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
    """Node-local cache (cached backend): put it on the fastest local disk. Shared by every rank
    and worker on the node and kept across restarts."""

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
    Longer hides latency spikes of the remote; with cache_limit set, the budget must hold
    (prefetch_steps + 1) global batches of files."""

    prefetch_threads: int = 16
    """Downloads in flight (cached backend). To keep up, at least
    files per step per node x per-file latency / step time (for example 128 files x 5 ms / 0.1 s = 7);
    more only adds idle threads and request rate at the remote."""

    cache_limit: int | None = None
    """Byte budget of the node cache; null = unlimited. Least recently used files are evicted first,
    never one inside any rank's look-ahead window. A budget below the dataset re-downloads evicted
    files every epoch."""

    on_bad_sample: str = "error"
    """A file that cannot be read or decoded: `error` stops with its name; `skip` trains on without it
    (padding, ignored by the loss) and counts it in MLflow (data/bad_samples)."""

    shuffle_block: int = 0
    """data=shards: shards per shuffle block; 0 = a full shuffle (the per-file backends' order). A
    block of k shards keeps a window of steps on about k shards (few downloads, a small cache) at the
    cost of shuffle quality: a sample moves at most k shards' worth of positions per epoch instead
    of anywhere."""

    def __post_init__(self):
        e = []
        if self.backend not in BACKENDS:
            e.append(f"data.backend must be one of {sorted(BACKENDS)}, got {self.backend!r}")
        if not (isinstance(self.dataset, dict) and "_target_" in self.dataset):
            e.append(f"data.dataset must be a node with a _target_ (a class), got {self.dataset!r}")
        if self.shuffle_block < 0:
            e.append(f"data.shuffle_block must be >= 0, got {self.shuffle_block}")
        if self.num_workers < 0:
            e.append(f"data.num_workers must be >= 0, got {self.num_workers}")
        if self.image_size < 8:
            e.append(f"data.image_size must be >= 8, got {self.image_size}")
        if self.prefetch_factor < 1:
            e.append(f"data.prefetch_factor must be >= 1, got {self.prefetch_factor}")
        if self.prefetch_steps < 1:
            e.append(f"data.prefetch_steps must be >= 1, got {self.prefetch_steps}")
        if self.prefetch_threads < 1:
            e.append(f"data.prefetch_threads must be >= 1, got {self.prefetch_threads}")
        if self.on_bad_sample not in ("error", "skip"):
            e.append(f"data.on_bad_sample must be error|skip, got {self.on_bad_sample!r}")
        if self.cache_limit is not None and self.cache_limit <= 0:
            e.append(f"data.cache_limit must be > 0 bytes or null, got {self.cache_limit}")
        try:
            check_url(str(self.root), "data.root")
        except ValueError as err:
            e.append(str(err))
        _raise(e)


@dataclass
class DatasetConfig:
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
