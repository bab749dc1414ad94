"""`data=shards`: the ImageFolder packed into WebDataset-style tar shards, cached whole on the node.

Layout of a packed dataset (a local path or any fsspec URL):

    index.json                       written last: a packed dataset is complete iff it exists
    train/shard-000000.tar ...       members <key>.jpg (the original bytes) and <key>.cls (label)
    val/shard-000000.tar ...

The shards are plain tar files in WebDataset's naming convention, so `tar`, `webdataset` and
`litdata` read them too; `index.json` adds what random access needs (each sample's shard, byte
offset and size) and the original file names, so sample i here is sample i of the ImageFolder
(same sorted listing, same fingerprint): the order, the hash chain and the augmentation seeds are
those of the per-file sources.

Order: `ShardOrder` shuffles shards, groups them into blocks of `shuffle_block` shards, and
shuffles samples within each block (like MosaicML Streaming's `py1br`). A pure function of
(seed, epoch); a window of steps touches at most two blocks of shards. `shuffle_block: 0` (or a
block covering every shard) is the full shuffle of the per-file sources, sample for sample.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import logging
import os
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import torch

from goodput.data.dataset import ImageFolder, open_dataset
from goodput.data.sampler import GlobalOrder, _mix
from goodput.data.sources import CachedSource
from goodput.storage.remote import Storage
from goodput.untrusted import RecordError, field, parse_record, safe_rel

log = logging.getLogger(__name__)

INDEX = "index.json"
FORMAT = "goodput-shards/1 (WebDataset tar)"
DEFAULT_SHARD_BYTES = 16 << 20


# -- packing -----------------------------------------------------------------------------------
def _tar(members: list[tuple[str, bytes]]) -> tuple[bytes, list[tuple[int, int]]]:
    """A tar of (name, bytes) members; returns it and each member's (data offset, size)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644  # reproducible bytes
            tf.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:  # the offsets, as a tar reader sees them
        where = {m.name: (m.offset_data, m.size) for m in tf.getmembers()}
    return raw, [where[name] for name, _ in members]


def _pack_split(
    src: Storage, dst: Storage, split: str, shard_bytes: int, pool, dataset: dict | None
) -> tuple[ImageFolder, list, list]:
    files = open_dataset(dataset, src, split)
    shards: list[dict] = []
    samples: list[list[int]] = []
    group: list[tuple[int, str, bytes]] = []

    def flush(group):
        name = f"{split}/shard-{len(shards):06d}.tar"
        raw, offsets = _tar([(f"{i:08d}{os.path.splitext(r)[1].lower()}", d) for i, r, d in group])
        dst.write_bytes(name, raw)
        shards.append({"name": name, "bytes": len(raw), "first": group[0][0], "count": len(group)})
        samples.extend([len(shards) - 1, off, n] for off, n in offsets)

    size = 0
    # Reads overlap through the pool; map() keeps the listing's order.
    for i, (rel, data) in enumerate(zip(files.files, pool.map(src.read_bytes, files.files))):
        group.append((i, rel, data))
        size += len(data) + 512  # + its tar header
        if size >= shard_bytes:
            flush(group)
            group, size = [], 0
    if group:
        flush(group)
    return files, shards, samples


def pack(
    src: Storage,
    dst: Storage,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    threads: int = 16,
    dataset: dict | None = None,
) -> dict:
    """Pack the dataset at `src` (listed by the `data.dataset` node; default ImageFolder) into shards
    at `dst`; index.json last, so a crash mid-way leaves no dataset that looks complete. Returns the index."""
    index: dict = {"format": FORMAT, "shard_bytes": shard_bytes, "dataset": dataset, "splits": {}}
    with ThreadPoolExecutor(threads) as pool:
        for split in ("train", "val"):
            files, shards, samples = _pack_split(src, dst, split, shard_bytes, pool, dataset)
            index.setdefault("classes", files.classes)
            if files.classes != index["classes"]:
                raise ValueError(f"{split}/ classes {files.classes} differ from train/ {index['classes']}")
            s = {"files": files.files, "labels": files.labels, "shards": shards, "samples": samples}
            index["splits"][split] = s
    dst.write_bytes(INDEX, json.dumps(index).encode())
    return index


def open_packed(storage: Storage, split: str) -> tuple[Storage, ShardFileList]:
    """The packed dataset for `data.root` = `storage`: the root itself, or `<root>-shards`. One GET
    of index.json where it is, no existence check first."""
    try:
        return storage, ShardFileList(storage, split)
    except FileNotFoundError:
        packed = _reopen(storage, f"{storage.root}-shards")
        return packed, ShardFileList(packed, split)


def _reopen(storage: Storage, url: str) -> Storage:
    """Another root opened like `storage` (the `storage` node's class and settings)."""
    return type(storage)(url, storage.cfg)


def packed_root(storage: Storage) -> str:
    """`storage`'s root when it holds a packed dataset, else where `data=shards` packs it: `<root>-shards`."""
    return storage.root if storage.exists(INDEX) else f"{storage.root}-shards"


DEFAULT_DATASET = {"_target_": "goodput.data.dataset.ImageFolder"}


def ensure_packed(src: Storage, dataset: dict | None = None, open_storage=None) -> None:
    """Pack the dataset at `src` (`data.root`), listed by the `dataset` node, on first use
    (ShardSource.prepare: once per job, before the ranks start). `open_storage(url)` opens the
    destination (goodput.run.build.storage: the `storage` node; default: `src`'s class). A packing made
    from another `data.dataset` is an error, not silently the data this run trains on."""
    dst_url = packed_root(src)
    if dst_url == src.root:
        return  # data.root is a packed dataset itself
    dst = open_storage(dst_url) if open_storage else _reopen(src, dst_url)
    dataset = dataset or DEFAULT_DATASET
    if dst.exists(INDEX):
        packed_from = parse_record(dst.read_bytes(INDEX), dst.url(INDEX)).get("dataset") or DEFAULT_DATASET
        if packed_from != dataset:
            raise ValueError(
                f"{dst.url(INDEX)} was packed from data.dataset={packed_from}, this run lists "
                f"data.dataset={dataset}: remove {dst_url} to pack it again, or point data.root elsewhere"
            )
        return
    log.info("packing %s into shards at %s (once) ...", src.root, dst_url)
    t0 = time.time()
    idx = pack(src, dst, dataset=dataset)
    n = {s: len(v["shards"]) for s, v in idx["splits"].items()}
    log.info("packed %s shards in %.1fs", n, time.time() - t0)


# -- reading -----------------------------------------------------------------------------------
def parse_index(data: bytes, what: str, split: str) -> tuple[list, list, list, list, list]:
    """(classes, files, labels, shards, samples) of `split` in an index.json, every entry checked as
    untrusted input (a shard name becomes a path in the node cache): RecordError naming the entry."""
    index = parse_record(data, what)
    if index.get("format") != FORMAT:
        raise RecordError(f"{what}: unknown format {index.get('format')!r}, want {FORMAT!r}")
    classes = field(index, "classes", list, what)
    s = field(field(index, "splits", dict, what), split, dict, f"{what} splits")
    where = f"{what} splits.{split}"
    files, labels = field(s, "files", list, where), field(s, "labels", list, where)
    shards, samples = field(s, "shards", list, where), field(s, "samples", list, where)
    if not shards or not (len(files) == len(labels) == len(samples)):
        raise RecordError(f"{where}: no shards, or files/labels/samples of different lengths")
    for i, sh in enumerate(shards):
        at = f"{where}.shards[{i}]"
        if not isinstance(sh, dict):
            raise RecordError(f"{at}: not an object")
        safe_rel(field(sh, "name", str, at), at)
        for key in ("bytes", "first", "count"):
            field(sh, key, int, at, minimum=0)
    for i, (rel, label, sample) in enumerate(zip(files, labels, samples)):
        at = f"{where} sample {i}"
        safe_rel(rel, f"{at} (files)")
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(classes):
            raise RecordError(f"{at}: label {label!r} is not a class index")
        ok = isinstance(sample, list) and len(sample) == 3
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sample)
        if not ok or sample[0] >= len(shards) or sample[1] + sample[2] > shards[sample[0]]["bytes"]:
            raise RecordError(f"{at}: bad location {sample!r} (want [shard, offset, size] inside a shard)")
    return classes, files, labels, shards, samples


class ShardFileList:
    """The ImageFolder of a packed split: same attributes (files, labels, sizes, classes, fingerprint),
    plus where each sample lives (`where[rel] = (shard, offset, size)`) and the shard table."""

    def __init__(self, storage: Storage, split: str):
        try:
            data = storage.read_bytes(INDEX)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"{storage.url(INDEX)} not found: data=shards needs a packed dataset "
                f"(scripts/pack_shards.py), or an ImageFolder it packs on first use"
            ) from e
        self.classes, self.files, self.labels, self.shards, samples = parse_index(
            data, storage.url(INDEX), split
        )
        names = [sh["name"] for sh in self.shards]
        self.where = {rel: (names[k], off, n) for rel, (k, off, n) in zip(self.files, samples)}
        self.sizes = [n for _, _, n in samples]
        self.shard_bytes = max(sh["bytes"] for sh in self.shards)
        # Same as ImageFolder's on the same data, so a checkpoint moves between sources.
        self.fingerprint = hashlib.sha256("\n".join(self.files).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.files)


class ShardOrder(GlobalOrder):
    """Block shuffle over shards: the epoch's shards in random order, cut into blocks of `block`
    shards, samples shuffled within each block. A sample moves within its block's span of the
    epoch (about block x samples-per-shard positions) instead of the whole epoch."""

    def __init__(self, files: ShardFileList, global_batch_size: int, seed: int, block: int):
        super().__init__(len(files), global_batch_size, seed)
        self.shards = [(sh["first"], sh["count"]) for sh in files.shards]
        self.block = block if 0 < block < len(self.shards) else 0

    @lru_cache(maxsize=2)  # noqa: B019 - a handful of orders per run, each lives as long as the run
    def permutation(self, epoch: int) -> torch.Tensor:
        if not self.block:
            return GlobalOrder.permutation.__wrapped__(self, epoch)  # the per-file sources' order
        g = torch.Generator().manual_seed(_mix(self.seed, epoch, len(self.shards), self.block))
        shard_order = torch.randperm(len(self.shards), generator=g).tolist()
        out = []
        for b in range(0, len(shard_order), self.block):
            ids = torch.cat(
                [torch.arange(f, f + n) for f, n in (self.shards[k] for k in shard_order[b : b + self.block])]
            )
            out.append(ids[torch.randperm(len(ids), generator=g)])
        return torch.cat(out)


class ShardSource(CachedSource):
    """The node cache of whole shards: a sample read is a pread from its cached shard.

    Fills, the budget, eviction and prefetch are CachedSource's, with shards as the unit: a fill
    is temp + os.replace (never a partial shard), one cache dir per node shared by every rank and
    worker, LRU eviction that spares the shards of the look-ahead window. A per-shard lock makes
    the processes of a node download each shard once.
    """

    OPEN_SHARDS = 16  # file descriptors kept per process: a sample read is one pread

    def __init__(
        self,
        storage: Storage | None = None,
        cache_dir: str | None = None,
        prefetch_threads: int = 4,
        cache_limit: int | None = None,
        shuffle_block: int = 16,
    ):
        """`prefetch_threads`, `cache_limit`: as CachedSource's, counted in shards: one request per
        shard, so a few threads saturate the link; the budget must hold two shuffle blocks.

        `shuffle_block` (`data.source.shuffle_block`): shards per shuffle block; 0 = a full shuffle
        (the per-file sources' order, sample for sample). A block of k shards keeps a window of
        steps on about k shards (few downloads, a small cache) at the cost of shuffle quality: a
        sample moves at most k shards' worth of positions per epoch instead of anywhere."""
        if shuffle_block < 0:
            raise ValueError(f"data.source.shuffle_block must be >= 0, got {shuffle_block}")
        super().__init__(storage, cache_dir, prefetch_threads, cache_limit)
        self.shuffle_block = shuffle_block
        self.where: dict[str, tuple[str, int, int]] = {}
        self._fds: dict[str, int] = {}
        self._touched: dict[str, float] = {}
        self._tlocks: dict[str, threading.Lock] = {}
        self._lock_pid = os.getpid()

    @classmethod
    def prepare(cls, root: Storage, dataset: dict | None, open_storage, ensure_dataset) -> None:
        """Pack `data.root` once, before the ranks start (a root that already holds packed shards
        needs no dataset to pack)."""
        if packed_root(root) != root.root:
            ensure_dataset()
        ensure_packed(root, dataset, open_storage)

    def open(self, split: str, dataset: dict | None = None) -> ShardFileList:
        """The packed split: reads go to the packed root (`data.root` itself, or `<root>-shards`)."""
        self.storage, files = open_packed(self.storage, split)
        self.__dict__.pop("dir", None)  # the cache dir is named by the (packed) root read from
        self.__dict__.pop("_real_dir", None)
        self.where = files.where
        self._sizes = {sh["name"]: sh["bytes"] for sh in files.shards}  # a cached shard must match
        return files

    def order(self, files: ShardFileList, global_batch_size: int, seed: int, window_steps: int) -> ShardOrder:
        order = ShardOrder(files, global_batch_size, seed, self.shuffle_block)
        if self.cache_limit is not None:
            # A window of steps touches at most two blocks of shards (one at an epoch's or block's edge).
            block = order.block or len(files.shards)
            need = 2 * block * files.shard_bytes
            if self.cache_limit < need:
                what = f"data.source.shuffle_block={self.shuffle_block}" if order.block else "every shard"
                raise ValueError(
                    f"data.source.cache_limit={self.cache_limit} bytes is below two shuffle blocks of "
                    f"shards ({need} bytes: 2 x {block} shards ({what}) x {files.shard_bytes} bytes): raise "
                    f"data.source.cache_limit, or set data.source.shuffle_block to fewer than {block} shards"
                )
        return order

    def __getstate__(self):
        skip = ("_fds", "_touched", "_tlocks", "_lock_pid")
        return {k: v for k, v in super().__getstate__().items() if k not in skip}

    def __setstate__(self, state):
        super().__setstate__(state)
        self._fds, self._touched, self._tlocks, self._lock_pid = {}, {}, {}, os.getpid()

    def _fill(self, rel: str) -> tuple[bytes, int]:
        # One download per shard per node: a POSIX record lock across processes (not inherited by
        # fork, unlike flock: a DataLoader worker forked while a prefetch thread holds a lock must
        # not keep holding it) and a thread lock per shard within this process.
        if self._lock_pid != os.getpid():  # forked: locks held by the parent's threads stay there
            self._tlocks, self._lock_pid = {}, os.getpid()
        os.makedirs(self.dir, exist_ok=True)
        with self._tlocks.setdefault(rel, threading.Lock()):
            fd = os.open(
                os.path.join(self.dir, ".lock-" + rel.replace("/", "_") + ".lck"), os.O_RDWR | os.O_CREAT
            )
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX)  # released by close, and by the kernel if we die
                try:
                    with open(self.local_path(rel), "rb") as g:  # another process filled it meanwhile
                        data = g.read()
                    if self._fresh(rel, len(data)):
                        return data, 0
                except FileNotFoundError:
                    pass
                return super()._fill(rel)
            finally:
                os.close(fd)

    def _fd(self, shard: str) -> int:
        fd = self._fds.pop(shard, None)
        if fd is None:
            fd = os.open(self.local_path(shard), os.O_RDONLY)  # FileNotFoundError: not cached
            if not self._fresh(shard, os.fstat(fd).st_size):  # not the shard the index records
                os.close(fd)
                raise FileNotFoundError(shard)
            if len(self._fds) >= self.OPEN_SHARDS:
                os.close(self._fds.pop(next(iter(self._fds))))
        self._fds[shard] = fd  # most recently used last
        return fd

    def read(self, rel: str) -> tuple[bytes, bool, int]:
        # An open descriptor keeps reading the same bytes even if eviction unlinks the file (shards
        # never change), and at most OPEN_SHARDS of them hold disk space after eviction.
        shard, off, n = self.where[rel]
        try:
            data = os.pread(self._fd(shard), n, off)
        except FileNotFoundError:
            raw, fetched = self._fill(shard)
            return raw[off : off + n], False, fetched
        now = time.monotonic()
        if now - self._touched.get(shard, 0.0) > 1.0:  # the LRU clock, once a second per shard
            self._touched[shard] = now
            try:
                os.utime(self.local_path(shard))
            except FileNotFoundError:
                pass
        return data, True, 0

    def close(self) -> None:
        super().close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def prefetch(self, rels: list[str], protect: set[str]) -> None:
        shards = list(dict.fromkeys(self.where[r][0] for r in rels))  # first-needed first
        super().prefetch(shards, {self.where[r][0] for r in protect})
