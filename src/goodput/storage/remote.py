"""One door to "remote" storage: fsspec underneath, retries, and listings that never go stale.

Everything that lives on the remote side (the dataset, committed checkpoints, run markers) goes
through a `Storage`. Node-local things (the cache, checkpoint staging) use plain `os` calls
(goodput.storage.local). What a network volume costs is emulated on top (goodput.storage.emulation),
in the two calls `self.emulation.op()` and `self.emulation.transfer(n)`, so it lands only where a
real cluster would pay it; on a cluster those settings stay 0.

`root` may be a local path, a `file://` URL, or any fsspec URL (`s3://bucket/prefix`, `gs://...`,
`memory://...`). Paths passed to methods are relative to `root`, always with `/`.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import fsspec
from fsspec.core import url_to_fs
from fsspec.dircache import DirCache

from goodput.storage.checksum import Transfer, _copy_hashing
from goodput.storage.emulation import Emulation
from goodput.storage.local import atomic_file, atomic_write, exclusive_write
from goodput.storage.s3 import _OBSTORE_PID, _is_s3fs, _obstore_for
from goodput.untrusted import confined, real_root, regular, safe_rel

_INHERITED: list = []  # in a forked process: the clients its Storage objects came with


ROUND_TRIPS = 16  # requests `each` keeps in flight


def each(fn: Callable, items: Iterable) -> list:
    """`[fn(x) for x in items]`, up to ROUND_TRIPS at a time: for the store's small reads that a
    start waits on (a commit record per step dir, a record per earlier attempt). Their cost is the
    round trip (milliseconds on a network volume, tens of them on an object store), and one after
    another they would lengthen every restart by one more per failure so far. Order kept; the
    first error in that order is raised, as the loop would, once all have returned."""
    items = list(items)
    if len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(ROUND_TRIPS, len(items)), thread_name_prefix="store-reads") as pool:
        return list(pool.map(fn, items))


class StorageError(OSError):
    """A remote operation failed for good (after retries)."""


@dataclass
class StorageConfig:
    """Schema of `storage`: retries and timeouts of the remote side (data root and checkpoint dir),
    and emulation of what a network volume costs (latency_ms, bandwidth_mb_s, error_rate, applied
    by goodput.storage.emulation), so a laptop shows it. On a real cluster leave those at 0.
    goodput.run.build opens the data root and the checkpoint dir through this node:
    `instantiate(node)(root)`, so a `_target_` of your own (a Storage subclass) serves both."""

    latency_ms: float = 0.0
    """Added to every remote operation (list, open, read, write). The demo uses 5 ms."""

    bandwidth_mb_s: float = 0.0
    """Per-stream cap on remote transfers, MB/s; 0 = unlimited."""

    error_rate: float = 0.0
    """Probability that a remote operation fails transiently (stands in for a 503); it is retried."""

    retries: int = 5
    """Attempts per operation before giving up. More rides out longer outages; a dead remote is then
    reported later (backoff doubles each time)."""

    backoff_s: float = 0.05
    """First wait between attempts; doubles each retry, with full jitter."""

    request_timeout_s: float = 30.0
    """Each request to an object store (s3://) gives up after this long, connecting included, and
    is then retried as above: a request that never returns costs at most about `retries` x this
    plus the backoff, never a hung job. The clients' own retry loops are off, so `retries` is the
    only one. Longer than the slowest single upload at your bandwidth (a 1 GB shard at 100 MB/s:
    10 s). Not bounded by it: local paths, other protocols, and a multipart upload stalling
    mid-part (`Storage.put` streams through s3fs's file object); the hang watchdog
    (trainer.hang_timeout_s) catches what is left."""

    # Last, so StorageConfig(latency_ms, bandwidth_mb_s) stays positional-compatible.
    _target_: str = "goodput.storage.Storage"
    _partial_: bool = True

    def __post_init__(self):
        for name in ("latency_ms", "bandwidth_mb_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"storage.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.error_rate < 1.0:
            raise ValueError(f"storage.error_rate must be in [0, 1), got {self.error_rate}")
        if self.retries < 1:
            raise ValueError(f"storage.retries must be >= 1, got {self.retries}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"storage.request_timeout_s must be > 0, got {self.request_timeout_s}")


KNOWN_PROTOCOLS = set(fsspec.available_protocols())


def check_url(url: str, what: str) -> None:
    """Fail early (before any work) on an fsspec protocol this install cannot serve."""
    if "://" in url:
        proto = url.split("://", 1)[0]
        if proto not in KNOWN_PROTOCOLS:
            raise ValueError(f"{what}: unknown storage protocol '{proto}://' in {url!r}")
        try:
            fsspec.get_filesystem_class(proto)
        except (ImportError, ValueError) as e:
            raise ValueError(f"{what}: protocol '{proto}://' needs an extra package: {e}") from e


DIR, FOREIGN = -1, -2
"""`Storage.ls` sizes of a directory and of a foreign entry (a symbolic link or non-regular file)."""


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _uncached(fs):
    """Turn off fsspec's per-client listing cache: every ls/find/exists/info asks the store.

    s3fs (and obstore's adapter) remember each listing per client and answer later listings,
    `exists` and `info` from it. Another process's write (a rank's manifest, an attempt record)
    then never shows up: a commit polling for it waited out its whole timeout. A listing here
    is a poll for someone else's write more often than not, so the cache is never worth it."""
    if getattr(fs, "dircache", None) is not None and fs.dircache.use_listings_cache:
        fs.dircache = DirCache(use_listings_cache=False)
    return fs


class Storage:
    """fsspec filesystem rooted at `root`, with retries; latency/bandwidth/errors emulated by
    `self.emulation` (goodput.storage.emulation)."""

    CHUNK = 1 << 20

    def __init__(self, root: str, cfg: StorageConfig | None = None, **options):
        """`options`: the `storage` node's fields (see StorageConfig), as instantiate passes them."""
        check_url(root, "storage root")
        self.root = root.rstrip("/")
        self.cfg = cfg or StorageConfig(**options)
        self._fs, self._base = self._open()
        self._pid = os.getpid()
        self.local = is_local(self.root)
        self._real = real_root(self._base) if self.local else None
        self._rng = random.Random()  # backoff jitter
        self.emulation = Emulation(self.cfg.latency_ms, self.cfg.bandwidth_mb_s, self.cfg.error_rate)
        self._read_fs = self._get = None
        self.fault = (
            None  # hang drills (goodput.resilience.fault.Faults.storage_op): called before each operation
        )

    def _open(self, **kw):
        """The fsspec client: no listing cache; on s3, every request bounded in time, retried here only."""
        if self.root.startswith(("s3://", "s3a://")):
            t = self.cfg.request_timeout_s
            kw["config_kwargs"] = {
                "connect_timeout": t,
                "read_timeout": t,
                "retries": {"total_max_attempts": 1},  # botocore's retries: ours are in _retry
            }
        fs, base = url_to_fs(self.root, **kw)
        if _is_s3fs(fs):
            fs.retries = 1  # s3fs's own retry loop (5 by default) would multiply the bound
        return _uncached(fs), base

    @property
    def fs(self):
        # DataLoader workers are forked: clients such as s3fs's are not fork-safe, and fsspec's
        # instance cache would hand the parent's back. Make a fresh one in each new process.
        if os.getpid() != self._pid:
            # The parent's clients stay referenced, never finalized here: their destructors would
            # act on the parent's event loop and runtime threads, which a fork does not copy.
            _INHERITED.append((self._fs, self._read_fs, self._get))
            self._fs, self._base = self._open(skip_instance_cache=True)
            self._pid = os.getpid()
            self._rng = random.Random()
            self.emulation.reseed()
            self._read_fs = self._get = None
        return self._fs

    @property
    def read_fs(self):
        """The filesystem for listings and GETs: obstore's fsspec adapter for s3:// when it is
        installed (GETs then take obstore's own client: a fraction of s3fs's client CPU per small
        file, see `_ObstoreGet`), else `fs`. Only in the process that first used obstore: its
        runtime does not survive fork, so forked DataLoader workers use s3fs."""
        fs = self.fs
        if self._read_fs is None:
            store, self._get = _obstore_for(fs, self.cfg.request_timeout_s) or (fs, None)
            self._read_fs = _uncached(store)
        if self._read_fs is not fs and _OBSTORE_PID[0] != os.getpid():
            return fs
        return self._read_fs

    # fsspec filesystems are picklable; the RNGs are re-created so forked workers don't share a stream.
    def __getstate__(self):
        return {"root": self.root, "cfg": self.cfg, "fault": self.fault}

    def __setstate__(self, state):
        self.__init__(state["root"], state["cfg"])
        self.fault = state.get("fault")

    def __repr__(self):
        return f"Storage({self.root!r}, {self.emulation!r})"

    def url(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _path(self, rel: str) -> str:
        """The backend path of `rel`: a plain relative path (goodput.untrusted.safe_rel), and on a
        local root one with no symbolic link below the root (a link in a store is foreign: never
        written through, never read)."""
        if not rel:
            return self._base
        if self.local:
            return confined(self._real, rel, f"storage {self.root}", resolved=True)
        return f"{self._base}/{safe_rel(rel, f'storage {self.root}')}"

    def _file(self, rel: str) -> str:
        """`_path` of a file about to be read: on a local root it must be a regular file."""
        path = self._path(rel)
        return regular(path, f"storage {self.root}") if self.local else path

    # -- retries -----------------------------------------------------------------------------
    def _retry(self, what: str, fn, *args):
        """Run fn with exponential backoff + full jitter on transient errors (OSError family)."""
        delay = self.cfg.backoff_s
        for attempt in range(self.cfg.retries):
            try:
                if self.fault is not None:
                    self.fault.storage_op(what.split(" ", 1)[0])
                self.emulation.op()  # latency; an injected error is retried like a real one
                return fn(*args)
            except (FileNotFoundError, FileExistsError):
                raise
            except OSError as e:
                if attempt == self.cfg.retries - 1:
                    raise StorageError(f"{what}: failed after {self.cfg.retries} attempts: {e}") from e
                time.sleep(self._rng.uniform(0, delay))
                delay *= 2

    # -- metadata ----------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return self._retry(f"exists {self.url(rel)}", self.fs.exists, self._path(rel))

    def ls(self, rel: str = "") -> dict[str, int]:
        """Names (relative to `rel`) -> size in bytes, for the direct children of `rel`; DIR (-1) for
        a directory, FOREIGN (-2) for what a store must not hold: a symbolic link, a FIFO, a device
        (local roots; object stores have none). Callers treat FOREIGN as neither file nor dir."""

        def _ls():
            if not self.fs.exists(self._path(rel)):
                return {}
            out = {}
            for info in self.fs.ls(self._path(rel), detail=True):
                name = info["name"].rstrip("/").rsplit("/", 1)[-1]
                if self.local and (info.get("islink") or info["type"] not in ("file", "directory")):
                    out[name] = FOREIGN
                else:
                    out[name] = DIR if info["type"] == "directory" else int(info.get("size") or 0)
            return out

        return self._retry(f"ls {self.url(rel)}", _ls)

    def find(self, rel: str = "") -> dict[str, int]:
        """All files under `rel`, recursively: relative path -> size. One listing operation."""

        def _find():
            base = self._path(rel).rstrip("/")
            # No exists() first: a missing prefix lists as empty, and on an object store each
            # extra call is a request. One listing, through the fastest client.
            try:
                found = self.read_fs.find(base, detail=True)
            except FileNotFoundError:
                return {}
            return {k[len(base) + 1 :]: int(v.get("size") or 0) for k, v in found.items()}

        return self._retry(f"find {self.url(rel)}", _find)

    def rm(self, rel: str, recursive: bool = False) -> None:
        def _rm():
            if self.fs.exists(self._path(rel)):
                self.fs.rm(self._path(rel), recursive=recursive)

        self._retry(f"rm {self.url(rel)}", _rm)

    def mv(self, src: str, dst: str) -> None:
        self._retry(f"move {self.url(src)}", self.fs.mv, self._path(src), self._path(dst), True)

    # -- data --------------------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        def _read():
            fs = self.read_fs
            if fs is not self.fs and self._get is not None:
                data = self._get(self._path(rel))  # obstore's own client, no fsspec layer
            elif _is_s3fs(fs):
                # s3fs's default asks for the size first (a HEAD) to split large files into ranged
                # GETs; for a sample that is one request too many.
                data = fs.cat_file(self._path(rel), max_concurrency=1)
            else:
                data = fs.cat_file(self._file(rel))
            self.emulation.transfer(len(data))
            return data

        return self._retry(f"read {self.url(rel)}", _read)

    def read_each(self, rels: Iterable[str]) -> list[bytes | None]:
        """read_bytes of each of `rels`, several at a time (`each`), in order; None for one that
        is gone (removed since the listing)."""

        def one(rel: str) -> bytes | None:
            try:
                return self.read_bytes(rel)
            except FileNotFoundError:
                return None

        return each(one, rels)

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Atomic on both sides: local files go through temp + fsync + rename; objects are atomic."""

        def _write():
            self.emulation.transfer(len(data))
            if self.local:
                atomic_write(self._path(rel), data)
            elif _is_s3fs(self.fs):
                # A PUT to an endpoint that never answers ignores botocore's read timeout (it waits
                # for "100 Continue"): bound the whole call instead (FSTimeoutError, retried).
                self.fs.pipe_file(self._path(rel), data, timeout=self.cfg.request_timeout_s)
            else:
                self.fs.pipe_file(self._path(rel), data)

        self._retry(f"write {self.url(rel)}", _write)

    @property
    def exclusive(self) -> bool:
        """Whether `create_exclusive` has one winner for certain here: a local root (link(2)) or s3 (a
        conditional PUT). Elsewhere it checks, then writes: best effort."""
        return self.local or _is_s3fs(self.fs)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Write `data` at `rel` only if nothing is there (one winner among writers that never talk:
        a rescue's claims and commit). True: this call wrote it (or an earlier try of this call
        did: the same bytes are there). Local roots: link(2) (exclusive_write); s3: a conditional
        PUT (If-None-Match: *); other fsspec stores: check then write, best effort."""

        def _create():
            self.emulation.transfer(len(data))
            if self.local:
                if not exclusive_write(self._path(rel), data):
                    raise FileExistsError(self.url(rel))
            elif _is_s3fs(self.fs):
                self.fs.pipe_file(self._path(rel), data, mode="create", timeout=self.cfg.request_timeout_s)
            else:
                self.fs.pipe_file(self._path(rel), data, mode="create")

        try:
            self._retry(f"create {self.url(rel)}", _create)
            return True
        except FileExistsError:  # a retry after a reply that was lost finds its own bytes
            try:
                return self.read_bytes(rel) == data
            except FileNotFoundError:
                return False

    def put(self, local_path: str, rel: str) -> Transfer:
        """Upload a local file, hashing it as it streams out (one read, no second pass).
        Atomic as write_bytes: local files via temp + rename, objects appear whole on close."""
        size = os.path.getsize(local_path)

        def _put():
            self.emulation.transfer(size)
            if self.local:  # durable: a commit record will point at this file
                with open(local_path, "rb") as src, atomic_file(self._path(rel)) as out:
                    return _copy_hashing(src, out, self.CHUNK)
            with open(local_path, "rb") as src, self.fs.open(self._path(rel), "wb") as out:
                return _copy_hashing(src, out, self.CHUNK)

        return self._retry(f"upload {local_path} -> {self.url(rel)}", _put)

    def digest(self, rel: str, limit: int | None = None) -> Transfer:
        """Size and checksum of a remote file, streamed (nothing written locally). `limit`: as get's."""

        class _Sink:
            def write(self, buf):
                pass

        def _digest():
            with self.fs.open(self._file(rel), "rb") as src:
                t = _copy_hashing(src, _Sink(), self.CHUNK, limit)
            self.emulation.transfer(t.size)
            return t

        return self._retry(f"read {self.url(rel)}", _digest)

    def get(self, rel: str, local_path: str, limit: int | None = None) -> Transfer:
        """Download to local_path via a temp file + rename (a crash never leaves a partial file),
        hashing the bytes as they arrive, so they can be verified before anything reads them.
        `limit`: the size the record allows; a file longer than that stops the download (TooLarge)."""

        def _get():
            # Not durable: a download is a copy, checked against its checksum as it arrives and
            # fetched again by the next restore; a disk flush per file would only slow restores.
            with atomic_file(local_path, durable=False) as out, self.fs.open(self._file(rel), "rb") as src:
                t = _copy_hashing(src, out, self.CHUNK, limit)
                self.emulation.transfer(t.size)
            return t

        return self._retry(f"download {self.url(rel)}", _get)
