"""ImageFolder on any fsspec root, decoded with torchvision, augmented with per-sample seeds."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

import torch
from torchvision.io import ImageReadMode, decode_image

from goodput.data import augment
from goodput.data.sampler import sample_seed
from goodput.storage import Storage

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


class BadSampleError(RuntimeError):
    """A file that cannot be read or decoded as an image; the message names it."""


class DataRootError(FileNotFoundError):
    """The dataset root, a split or a class folder is missing or empty."""


class FileList:
    """The sorted (path, label) listing of one split: `<root>/<split>/<class>/<file>`."""

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
        self.classes = sorted(classes_on_disk)
        if not self.classes:
            raise DataRootError(f"no class folders under {storage.url(split)}")
        self.files: list[str] = []
        self.labels: list[int] = []
        for label, cls in enumerate(self.classes):
            imgs = [r for r in by_class.get(cls, []) if r.lower().endswith(IMAGE_EXTENSIONS)]
            others = [r for r in by_class.get(cls, []) if not r.lower().endswith(IMAGE_EXTENSIONS)]
            if others:
                log.warning("ignoring %d non-image file(s) in %s, e.g. %s", len(others), cls, others[0])
            if not imgs:
                raise DataRootError(f"class folder {storage.url(split + '/' + cls)} holds no images")
            self.files += [f"{split}/{r}" for r in imgs]
            self.labels += [label] * len(imgs)
        self.sizes = [found[r.split("/", 1)[1]] for r in self.files]
        self.fingerprint = hashlib.sha256("\n".join(self.files).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.files)


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
        if self.path is None or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
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
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".listing-")
            with os.fdopen(fd, "w") as f:
                json.dump({"job": self.job, "root": self.root, "found": found, "dirs": dirs}, f)
            os.replace(tmp, self.path)  # atomic: the other ranks of the node write the same listing
        except OSError as e:
            log.debug("could not cache the listing of %s: %s", self.root, e)


def seeded(transform, img: torch.Tensor, seed: int) -> torch.Tensor:
    """transform(img) with the global CPU RNG seeded to `seed` for the call, then restored.

    torchvision v2 transforms draw from the global torch RNG and take no generator: fork it and
    seed it per sample, so the augmented tensor does not depend on which worker loads the sample,
    how many there are, or where a run resumed. Only the CPU generator: `torch.manual_seed` would
    also seed every accelerator generator (outside fork_rng's restore, so a workers=0 run on a GPU
    had its CUDA RNG reset every sample) and, before CUDA is initialised, record a stack trace for
    each: ~80 us a sample, an eighth of a 64 px image's CPU. The CPU state it sets is the same."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return transform(img)


class ImageDataset(torch.utils.data.Dataset):
    """Map-style dataset keyed by (epoch, index) for training, index for eval.

    Returns a dict with the image, the label and per-sample I/O counters (cache hit, bytes
    fetched, ok) so the training process can count what was *delivered*, across workers.
    Index -1 is padding (equal batch counts per rank): a zero image with label -1, ignored by the loss.
    """

    def __init__(
        self,
        source,
        files: FileList,
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

    def _blank(self, hit=0, nbytes=0, ok=0) -> dict:
        img = torch.zeros(3, self.image_size, self.image_size)
        return {"image": img, "label": -1, "hit": hit, "bytes": nbytes, "ok": ok}

    def __getitem__(self, key) -> dict:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        if index < 0:
            return self._blank(ok=1)
        rel = self.files.files[index]
        try:
            data, hit, nbytes = self.source.read(rel)
        except FileNotFoundError as e:
            raise BadSampleError(f"cannot read {self.source.storage.url(rel)}: {e}") from e
        try:
            img = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        except Exception as e:
            if self.on_bad_sample == "skip":
                return self._blank(hit=int(hit), nbytes=nbytes, ok=0)
            raise BadSampleError(
                f"cannot decode {self.source.storage.url(rel)} as an image ({e}); fix or remove the file, "
                f"or set data.on_bad_sample=skip"
            ) from e
        if self.train:
            x = seeded(self.transform, img, sample_seed(self.seed, epoch, index))
        else:
            x = self.transform(img)
        return {"image": x, "label": self.files.labels[index], "hit": int(hit), "bytes": nbytes, "ok": 1}
