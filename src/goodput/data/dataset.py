"""ImageFolder on any fsspec root, decoded with torchvision, augmented with per-sample seeds."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import random

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from PIL import Image, UnidentifiedImageError
from torchvision.io import ImageReadMode, decode_image

from goodput.data import augment
from goodput.data.sampler import copy_seed
from goodput.errors import UserError
from goodput.resilience.accounting import restart_round
from goodput.storage.local import atomic_file
from goodput.storage.remote import Storage
from goodput.untrusted import why_unsafe

log = logging.getLogger(__name__)

# The files a class folder's listing takes as images (case-insensitive): the formats Pillow reads
# (goodput.data.dataset.decode). A fixed list, not Pillow's registry: adding an extension changes
# which files a dataset lists (its sample order, the checkpoints' data position), so it is a choice
# made here, not by a Pillow upgrade.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm",
                    ".pbm", ".pnm", ".tga", ".jp2", ".avif")  # fmt: skip
_FAST = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n")  # JPEG, PNG: torchvision's decoders


class BadSampleError(UserError, RuntimeError):
    """A file that cannot be read or decoded as an image; the message names it."""


class DataRootError(UserError, FileNotFoundError):
    """The dataset root, a split or a class folder is missing or empty."""


def check_same_classes(train: list[str], val: list[str], root: str) -> None:
    """train/ and val/ hold the same classes (label i names the same class in both), or a
    DataRootError naming the classes only one side has."""
    if train == val:
        return
    only_train, only_val = sorted(set(train) - set(val)), sorted(set(val) - set(train))
    raise DataRootError(
        f"{root}: train/ and val/ must hold the same classes; only in train/: {only_train or 'none'}, "
        f"only in val/: {only_val or 'none'}" + ("" if only_train or only_val else " (ordered differently)")
    )


class ImageFolder:
    """The samples of one split, `<root>/<split>/<class>/<image>`: the default `data.dataset`.

    A dataset class (the `data.dataset` node's `_target_`) is called with the data root's storage,
    the split (`train` or `val`), the node cache dir and the node's other keys, and lists the split:
    `files` (paths under the root, in a fixed order), `labels` (ints, one per file), `sizes` (bytes,
    one per file), `classes` (names; label i is classes[i]); `_index()` sets them and the
    `fingerprint`. Sample i is files[i]: the order, augmentation seeds and checkpoints refer to it.
    See CsvManifest for a second layout."""

    def __init__(self, storage: Storage, split: str, cache_dir: str | None = None):
        listing = _ListingCache(storage, split, cache_dir)
        cached = listing.load()
        if cached is not None:
            found, dirs = cached
        else:
            try:
                found = storage.find(split)
            except FileNotFoundError:
                found = {}
            dirs = None
        if not found:
            raise DataRootError(
                f"no files under {storage.url(split)}: the dataset root must hold "
                f"'{split}/<class>/<image>' (ImageFolder layout)"
            )
        # A listed key is data too (an object store holds `train/../../x` as a key like any other).
        bad = next((r for r in sorted(found) if why_unsafe(f"{split}/{r}")), None)
        if bad is not None:
            raise DataRootError(
                f"{storage.url(split)} lists {bad!r}: that path {why_unsafe(f'{split}/{bad}')}; refused "
                f"(sample paths must stay under data.root)"
            )
        by_class: dict[str, list[str]] = {}
        for rel in sorted(found):
            parts = rel.split("/")
            if len(parts) != 2:
                continue  # files at the split level or nested deeper are not ImageFolder samples
            by_class.setdefault(parts[0], []).append(rel)
        # A class folder holding no images is a broken dataset, not a class with zero samples.
        # (find() lists files only, so empty folders come from ls(); object stores have none, so
        # there the one listing is all: a second one would be another round of requests.)
        classes_on_disk = {r.split("/")[0] for r in found if "/" in r}
        if dirs is None:
            dirs = sorted(n for n, size in storage.ls(split).items() if size == -1) if storage.local else []
            listing.save(found, dirs)
        classes_on_disk |= set(dirs)
        classes = sorted(classes_on_disk)
        if not classes:
            raise DataRootError(f"no class folders under {storage.url(split)}")
        files: list[str] = []
        labels: list[int] = []
        for label, cls in enumerate(classes):
            imgs = [r for r in by_class.get(cls, []) if r.lower().endswith(IMAGE_EXTENSIONS)]
            others = [r for r in by_class.get(cls, []) if not r.lower().endswith(IMAGE_EXTENSIONS)]
            if others:
                log.warning(
                    "ignoring %d file(s) in %s that are not images, e.g. %s (images: %s)",
                    len(others), storage.url(f"{split}/{cls}"), others[0], " ".join(IMAGE_EXTENSIONS),
                )  # fmt: skip
            if not imgs:
                raise DataRootError(f"class folder {storage.url(split + '/' + cls)} holds no images")
            files += [f"{split}/{r}" for r in imgs]
            labels += [label] * len(imgs)
        self._index(files, labels, [found[r.split("/", 1)[1]] for r in files], classes)

    @classmethod
    def check_root(cls, storage: Storage, **options) -> None:
        """Called once per job, before any worker starts, with the `data.dataset` node's options:
        fail fast when the root cannot hold this dataset. Cheap on purpose (no listing)."""
        try:
            present = storage.exists("train")
        except Exception as e:
            raise FileNotFoundError(f"data.root {storage.root} is unreachable: {e}") from e
        if not present:
            raise FileNotFoundError(
                f"data.root {storage.root} has no train/ folder. Point data.root at an ImageFolder dataset "
                f"(train/<class>/*.jpg, val/<class>/*.jpg), or create demo data there with "
                f"`python scripts/make_dataset.py --root {storage.root}`, or set data.dataset"
            )

    def target(self, index: int):
        """The label of sample `index` as the task takes it: the class index."""
        return self.labels[index]

    def blank_target(self):
        """The label of a sample that is not there (padding, a skipped file): no class."""
        return -1

    def _index(self, files: list[str], labels: list[int], sizes: list[int], classes: list[str]) -> None:
        self.files, self.labels, self.sizes, self.classes = files, labels, sizes, classes
        # Names the file list (a checkpoint's data position refers to it; MLflow's dataset digest).
        self.fingerprint = hashlib.sha256("\n".join(self.files).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.files)


def open_dataset(node: dict | None, storage: Storage, split: str, cache_dir: str | None = None):
    """The `data.dataset` node's class (default ImageFolder) listing `split`, built with instantiate.
    A listing error (DataRootError naming the file, a storage error) or another refusal of a dataset
    class of your own (a UserError: UnsafePath, RecordError) reaches the caller as itself, not
    wrapped in Hydra's InstantiationException."""
    node = node or {"_target_": f"{__name__}.ImageFolder"}
    try:
        return instantiate(node, storage=storage, split=split, cache_dir=cache_dir)
    except InstantiationException as e:
        if isinstance(e.__cause__, OSError | UserError):  # DataRootError is a FileNotFoundError
            raise e.__cause__ from None
        raise


class CsvManifest(ImageFolder):
    """Samples listed in `<root>/<split>.csv` (name set by `manifest`), one `path,label` row each:
    `path` relative to the root, `label` a class name; a header row `path,label` is skipped.
    Classes are the sorted label names, samples are in the manifest's order (sort it once; a changed
    order is a changed dataset). Sizes come from one listing of each top-level folder the manifest
    names. Select it with `data.dataset._target_=goodput.data.dataset.CsvManifest`.
    `separator`: a subclass whose rows hold several labels (goodput.recipe.datasets)."""

    separator: str | None = None  # between the labels of one row; None = one label a row

    def __init__(self, storage: Storage, split: str, cache_dir: str | None = None, manifest="{split}.csv"):
        name = manifest.format(split=split)
        try:
            text = storage.read_bytes(name).decode()
        except FileNotFoundError as e:
            raise DataRootError(f"no manifest {storage.url(name)} (data.dataset.manifest={manifest})") from e
        header = (["path", "label"], ["path", "labels"])
        lines = [(n, r) for n, r in enumerate(csv.reader(text.splitlines()), 1) if r and r not in header]
        for n, r in lines:
            if len(r) != 2 or not r[0] or not r[1]:
                raise DataRootError(f"{storage.url(name)} line {n}: expected `path,label`, got {r}")
            # A row's path becomes a read on the root and a file in the node cache: it must stay under both.
            if why_unsafe(r[0]):
                raise DataRootError(
                    f"{storage.url(name)} line {n}: path {r[0]!r} {why_unsafe(r[0])}; refused "
                    f"(paths in a manifest are relative to data.root and stay under it)"
                )
        rows = [
            (path, label.split(self.separator) if self.separator else [label]) for _, (path, label) in lines
        ]
        if not rows:
            raise DataRootError(f"{storage.url(name)} lists no samples")
        classes = sorted({c for _, names in rows for c in names if c})
        found: dict[str, int] = {}
        for top in sorted({path.split("/", 1)[0] for path, _ in rows if "/" in path}):
            found.update({f"{top}/{rel}": n for rel, n in storage.find(top).items()})
        missing = [path for path, _ in rows if path not in found]
        if missing:
            raise DataRootError(
                f"{storage.url(name)} names {len(missing)} missing file(s), e.g. {missing[0]}"
            )
        files = [path for path, _ in rows]
        index = {c: i for i, c in enumerate(classes)}
        labels = [[index[c] for c in names if c] if self.separator else index[names[0]] for _, names in rows]
        self._index(files, labels, [found[f] for f in files], classes)

    @classmethod
    def check_root(cls, storage: Storage, manifest="{split}.csv") -> None:
        name = manifest.format(split="train")
        if not storage.exists(name):
            raise FileNotFoundError(
                f"data.root {storage.root} has no {name} (data.dataset.manifest={manifest})"
            )


class _ListingCache:
    """The remote listing of a split, kept beside the node cache for the restarts of one elastic job.

    The first attempt lists the remote and writes the listing; an elastic restart of the same job
    (same TORCHELASTIC_RUN_ID) reads it instead of listing the remote again. A new job, or a run
    outside the elastic agent, always lists the remote. The restored checkpoint still checks the
    listing (file count and fingerprint, see ResumableLoader.load_state_dict)."""

    def __init__(self, storage: Storage, split: str, cache_dir: str | None):
        self.job = os.environ.get("TORCHELASTIC_RUN_ID")
        self.path = None
        if cache_dir and self.job:
            ns = hashlib.sha1(storage.root.encode()).hexdigest()[:12]
            self.path = os.path.join(os.path.abspath(cache_dir), "listings", f"{ns}-{split}.json")
        self.root = storage.root

    def load(self) -> tuple[dict[str, int], list[str]] | None:
        if self.path is None or restart_round() == 0:
            return None
        try:
            with open(self.path) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            return None
        if rec.get("job") != self.job or rec.get("root") != self.root:
            return None
        return rec["found"], rec["dirs"]

    def save(self, found: dict[str, int], dirs: list[str]) -> None:
        if self.path is None or not found:
            return
        try:
            # Atomic: the other ranks of the node write the same listing. Not durable: a listing
            # lost to a power cut is listed again.
            with atomic_file(self.path, "w", durable=False) as f:
                json.dump({"job": self.job, "root": self.root, "found": found, "dirs": dirs}, f)
        except OSError as e:
            log.debug("could not cache the listing of %s: %s", self.root, e)


def decode(data: bytes) -> torch.Tensor:
    """An image file's bytes as RGB, uint8 [3, H, W]. JPEG and PNG go through torchvision's decoders
    (the fast path; a file they refuse falls back too), every other format (and IMAGE_EXTENSIONS
    lists them) through Pillow: the first frame of an animation or the first page of a TIFF, with
    Image.convert("RGB") (alpha dropped, as torchvision's RGB mode does). The same bytes give the
    same tensor; a lossless file gives the same tensor by either path."""
    if data.startswith(_FAST):
        try:
            return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        except RuntimeError:
            pass
    with Image.open(io.BytesIO(data)) as im:
        rgb = np.asarray(im.convert("RGB"))
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1).contiguous()


def seeded(transform, img: torch.Tensor, seed: int) -> torch.Tensor:
    """transform(img) with the global CPU generators of torch, NumPy and Python's `random` seeded
    from `seed` for the call, then restored.

    torchvision v2 transforms draw from the global torch RNG and take no generator; a transform of
    your own may draw from `random` or `np.random`. Seeding all three per sample makes the augmented
    tensor a pure function of (seed, epoch, index): the same whichever worker loads the sample, how
    many there are, or where a run resumed. Restored after, so the process's own streams (the main
    process's, with data.num_workers=0) do not move. Only torch's CPU generator: `torch.manual_seed`
    would also seed every accelerator generator (outside fork_rng's restore, so a workers=0 run on a
    GPU had its CUDA RNG reset every sample) and, before CUDA is initialised, record a stack trace
    for each: ~80 us a sample, an eighth of a 64 px image's CPU. The CPU state it sets is the same."""
    py, np_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return transform(img)
    finally:
        random.setstate(py)
        np.random.set_state(np_state)


class ImageDataset(torch.utils.data.Dataset):
    """Map-style dataset keyed by (epoch, index) for training, index for eval.

    Returns a dict with the image, the label, the sample's index (the sample-order hash chain is fed
    from what was delivered, goodput.data.loader) and per-sample I/O counters (cache hit, bytes
    fetched, ok) so the training process can count what was *delivered*, across workers.
    Index -1 is padding (equal batch counts per rank): a zero image with the dataset's blank label; a
    file skipped by data.on_bad_sample=skip is a zero image with ok 0. The task weighs both zero.
    """

    def __init__(
        self,
        source,
        files: ImageFolder,
        image_size: int,
        seed: int,
        train: bool,
        on_bad_sample: str,
        transform=None,
    ):
        self.source, self.files, self.seed, self.train = source, files, seed, train
        self.image_size, self.on_bad_sample = image_size, on_bad_sample
        # `transform`: from the augment group (goodput.data.augment.build); None = its defaults.
        self.transform = transform or augment.build(None, image_size)[0 if train else 1]

    def __len__(self) -> int:
        return len(self.files)

    def _blank(self, index: int, hit=0, nbytes=0, ok=0) -> dict:
        img = torch.zeros(3, self.image_size, self.image_size)
        blank = getattr(self.files, "blank_target", lambda: -1)()
        return {"image": img, "label": blank, "index": index, "hit": hit, "bytes": nbytes, "ok": ok}

    def __getitem__(self, key) -> dict:
        epoch, index, copy = (*key, 0)[:3] if isinstance(key, tuple) else (0, key, 0)
        if index < 0:
            return self._blank(index, ok=1)
        rel = self.files.files[index]
        try:
            data, hit, nbytes = self.source.read(rel)
        except FileNotFoundError as e:
            raise BadSampleError(f"cannot read {self.source.storage.url(rel)}: {e}") from e
        try:
            img = decode(data)
        except Exception as e:
            if self.on_bad_sample == "skip":
                return self._blank(index, hit=int(hit), nbytes=nbytes, ok=0)
            why = "not an image format Pillow reads" if isinstance(e, UnidentifiedImageError) else repr(e)
            raise BadSampleError(
                f"cannot decode {self.source.storage.url(rel)} as an image ({why}); fix or remove the "
                f"file, or set data.on_bad_sample=skip"
            ) from e
        if self.train:
            x = seeded(self.transform, img, copy_seed(self.seed, epoch, index, copy))
        else:
            x = self.transform(img)
        target = getattr(self.files, "target", None)  # a dataset class of your own may not have one
        label = target(index) if target is not None else self.files.labels[index]
        return {"image": x, "label": label, "index": index, "hit": int(hit), "bytes": nbytes, "ok": 1}
