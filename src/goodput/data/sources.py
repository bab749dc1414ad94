"""Where sample bytes come from: the `data.source` node's class, built with hydra.utils.instantiate.

`RemoteSource` (`data=remote`: every read hits the remote), `CachedSource` (`data=cached`: node-local
cache + sampler-aware prefetch) and `goodput.data.shards.ShardSource` (`data=shards`). A source of
your own subclasses one of them. The loader and the job talk to every source through the same
methods, so they never ask which one they have:

- `prepare(root, dataset, open_storage, ensure_dataset)` (class method): once per job, before any
  rank starts (the shards source packs the dataset there);
- `open(split, dataset)`: list a split, return its file list (`goodput.data.dataset.ImageFolder`'s
  attributes); `order(files, global_batch_size, seed, window_steps)`: the global sample order over
  it, checked against what the source must keep at hand for `window_steps` steps;
- `read(rel)`, `prefetch(rels, protect)`, `stats()`, `close()`: while training.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from goodput.data.dataset import open_dataset
from goodput.data.sampler import GlobalOrder
from goodput.storage.local import atomic_write
from goodput.storage.remote import Storage
from goodput.untrusted import confined, real_root

log = logging.getLogger(__name__)


class RemoteSource:
    """The baseline: every access reads the file from the remote (latency and bandwidth paid each
    time). No options. Built per split by the loader with the data root's storage and the node cache
    dir (where the split's listing is kept; the files themselves are not)."""

    def __init__(self, storage: Storage | None = None, cache_dir: str | None = None):
        self.storage, self.cache_dir = storage, cache_dir

    @classmethod
    def prepare(cls, root: Storage, dataset: dict | None, open_storage, ensure_dataset) -> None:
        """Once per job, before any rank starts, with `data.root` opened and the `data.dataset` node:
        the dataset must exist (`ensure_dataset()` generates the demo data and checks the root).
        `open_storage(url)` opens another root through the `storage` node."""
        ensure_dataset()

    def open(self, split: str, dataset: dict | None = None):
        """The file list of `split`, listed by the `data.dataset` node's class."""
        return open_dataset(dataset, self.storage, split, self.cache_dir)

    def order(self, files, global_batch_size: int, seed: int, window_steps: int) -> GlobalOrder:
        """The global sample order (a full shuffle per epoch). `window_steps`: steps the loader
        prefetches ahead, for sources that must hold them (nothing here)."""
        return GlobalOrder(len(files), global_batch_size, seed)

    def read(self, rel: str) -> tuple[bytes, bool, int]:
        """Returns (bytes, cache_hit, bytes_fetched_from_remote)."""
        data = self.storage.read_bytes(rel)
        return data, False, len(data)

    def prefetch(self, rels: list[str], protect: set[str]) -> None:
        pass  # nothing to prepare: the baseline waits for every file

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class CachedSource(RemoteSource):
    """Node-local cache in front of the remote, with sampler-aware prefetch and an LRU byte budget.

    - A fill is temp file + rename, so a crash never leaves a partial file that is later served.
    - One cache per node: its path depends only on `cache_dir` and the remote root, so every rank
      and worker on the node shares it, and it survives restarts.
    - `prefetch()` is called from the training process with the files of the next steps; a bounded
      thread pool downloads them while the accelerator computes.
    - With `cache_limit` (bytes), the least recently used files are evicted, never one in `protect`
      (the look-ahead window of every rank). Races with other processes cost a re-download, never
      wrong bytes: a reader that finds no file fetches it again.
    """

    def __init__(
        self,
        storage: Storage | None = None,
        cache_dir: str | None = None,
        prefetch_threads: int = 16,
        cache_limit: int | None = None,
    ):
        """`prefetch_threads` (`data.source.prefetch_threads`): downloads in flight. To keep up, at
        least files per step per node x per-file latency / step time (for example 128 files x 5 ms /
        0.1 s = 7); more only adds idle threads and request rate at the remote.

        `cache_limit` (`data.source.cache_limit`): byte budget of the node cache; null = unlimited.
        Least recently used files are evicted first, never one inside any rank's look-ahead window.
        A budget below the dataset re-downloads evicted files every epoch; it must hold
        (data.prefetch_steps + 1) global batches of files (checked at start)."""
        if prefetch_threads < 1:
            raise ValueError(f"data.source.prefetch_threads must be >= 1, got {prefetch_threads}")
        if cache_limit is not None and cache_limit <= 0:
            raise ValueError(f"data.source.cache_limit must be > 0 bytes or null, got {cache_limit}")
        super().__init__(storage, cache_dir)
        self.prefetch_threads = prefetch_threads
        self.cache_limit = cache_limit
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: set[str] = set()
        self._lock = threading.Lock()
        self._prefetched_bytes = 0
        self._prefetched_files = 0
        self._evicted = 0
        self._last_scan = 0.0
        self._approx_bytes = None
        self._fill_fd, self._fill_pid, self._stripes = None, None, []
        self._sizes: dict[str, int] = {}  # rel -> size in the remote listing: a cached copy must match
        self._stale: set[str] = set()

    def open(self, split: str, dataset: dict | None = None):
        files = super().open(split, dataset)
        self._sizes = dict(zip(files.files, files.sizes))
        return files

    def _fresh(self, rel: str, size: int) -> bool:
        """A cached copy of `size` bytes may be served: the remote listing has that size for `rel`.
        (A copy fetched before the remote file was fixed or replaced is refetched; a change that
        keeps the size is not seen: the cache checks sizes, not checksums.)"""
        want = self._sizes.get(rel)
        if want is None or want == size:
            return True
        if rel not in self._stale:  # once per file: the prefetch and the read both look
            self._stale.add(rel)
            log.warning(
                "cached %s is %d bytes, the remote lists %d: fetching it again",
                self.local_path(rel),
                size,
                want,
            )
        return False

    def _is_cached(self, rel: str) -> bool:
        try:
            return self._fresh(rel, os.stat(self.local_path(rel)).st_size)
        except FileNotFoundError:
            return False

    @functools.cached_property
    def dir(self) -> str:
        """This remote root's cache on the node (computed on first use: the storage may be rebound
        by `open`, as the shards source does)."""
        ns = hashlib.sha1(self.storage.root.encode()).hexdigest()[:12]
        return os.path.join(os.path.abspath(self.cache_dir), ns)

    def order(self, files, global_batch_size: int, seed: int, window_steps: int) -> GlobalOrder:
        if self.cache_limit is not None:
            # The protected window is every rank's files for window_steps + 1 steps: a budget below
            # that would have to evict files that are about to be read.
            largest = sorted(files.sizes, reverse=True)[: (window_steps + 1) * global_batch_size]
            if self.cache_limit < sum(largest):
                raise ValueError(
                    f"data.source.cache_limit={self.cache_limit} bytes is smaller than one look-ahead "
                    f"window (data.prefetch_steps={window_steps} + 1 steps of {global_batch_size} files, "
                    f"up to {sum(largest)} bytes here): raise data.source.cache_limit or lower "
                    f"data.prefetch_steps"
                )
        return super().order(files, global_batch_size, seed, window_steps)

    @functools.cached_property
    def _real_dir(self) -> str:
        return real_root(self.dir)

    _LOCAL = ("_pool", "_lock", "_inflight", "_fill_fd", "_fill_pid", "_stripes")

    def __getstate__(self):  # workers get config only; the pool lives in the training process
        return {k: v for k, v in self.__dict__.items() if k not in self._LOCAL}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._pool, self._lock, self._inflight = None, threading.Lock(), set()
        self._fill_fd, self._fill_pid, self._stripes = None, None, []

    def local_path(self, rel: str) -> str:
        """The cached copy of `rel`: checked to stay under the cache dir (`rel` comes from data; the
        dataset classes refuse such paths when listing, this is the last line before a write)."""
        return confined(self._real_dir, rel, f"node cache {self.dir}", resolved=True)

    def _fill(self, rel: str) -> tuple[bytes, int]:
        """Download rel into the cache atomically; returns (bytes, size)."""
        data = self.storage.read_bytes(rel)
        try:
            self._store(rel, data)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            if self.cache_limit:  # make room within the budget, then try once more
                self._last_scan = 0
                self._maybe_evict(set(), force=True)
                try:
                    self._store(rel, data)
                    return data, len(data)
                except OSError:
                    pass
            raise OSError(
                errno.ENOSPC,
                f"cache disk full at {self.dir} while caching {rel}: free space there, or set "
                f"data.source.cache_limit below the free space so older files are evicted",
            ) from e
        return data, len(data)

    def _store(self, rel: str, data: bytes) -> None:
        # Readers (other ranks, workers) see nothing or the whole file, even when the filler is
        # killed (its written pages stay in the kernel). Not durable, as before: a disk flush per
        # sample costs ~10x the write (docs/benchmarks.md); the price is that
        # a power loss or kernel crash can leave a just-renamed fill empty: clear the node cache
        # after a node crash.
        atomic_write(self.local_path(rel), data, durable=False)

    def read(self, rel: str) -> tuple[bytes, bool, int]:
        path = self.local_path(rel)
        try:
            with open(path, "rb") as f:
                data = f.read()
            if self._fresh(rel, len(data)):
                os.utime(path)  # LRU clock for eviction
                return data, True, 0
        except FileNotFoundError:
            pass
        with self._filling(rel):  # a prefetch thread fetching it holds this: wait for its fill
            try:
                with open(path, "rb") as f:
                    data = f.read()
                if self._fresh(rel, len(data)):
                    return data, False, 0
            except FileNotFoundError:
                pass
            data, size = self._fill(rel)
            return data, False, size

    @contextlib.contextmanager
    def _filling(self, rel: str):
        """Held while `rel` is fetched into the cache, by every process of the node: a DataLoader
        worker that reaches a file the prefetch threads are still fetching waits for that fill
        instead of a second GET. A POSIX record lock on one byte (picked by a hash of rel) of one
        lock file, so no lock file per sample; not inherited by fork, released if the holder dies.
        Record locks do not exclude threads of one process: a striped thread lock does that."""
        h = int.from_bytes(hashlib.blake2b(rel.encode(), digest_size=4).digest(), "big")
        if self._fill_pid != os.getpid():  # forked: the parent's fd and held thread locks stay there
            self._fill_fd, self._fill_pid = None, os.getpid()
            self._stripes = [threading.Lock() for _ in range(256)]
        if self._fill_fd is None:
            os.makedirs(self.dir, exist_ok=True)
            self._fill_fd = os.open(os.path.join(self.dir, ".lock-fills"), os.O_RDWR | os.O_CREAT)
        with self._stripes[h % 256]:
            try:
                fcntl.lockf(self._fill_fd, fcntl.LOCK_EX, 1, h)
            except OSError as e:
                # The kernel tracks record locks per process, so threads of two ranks holding and
                # waiting can look like a cycle to it: fetch unlocked, a second GET at worst.
                if e.errno != errno.EDEADLK:
                    raise
                yield
                return
            try:
                yield
            finally:
                fcntl.lockf(self._fill_fd, fcntl.LOCK_UN, 1, h)

    def prefetch(self, rels: list[str], protect: set[str]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.prefetch_threads, thread_name_prefix="prefetch")
        with self._lock:
            todo = [rel for rel in rels if rel not in self._inflight]
            self._inflight.update(todo)
        if todo:  # one task, which hands out the files not cached yet: a restart's first call (hundreds
            self._pool.submit(self._hand_out, todo)  # of cached files) starts one thread, not 16
        if self.cache_limit:
            self._maybe_evict(protect)

    def _hand_out(self, rels: list[str]) -> None:
        for i, rel in enumerate(rels):
            try:
                cached = self._is_cached(rel)
            except Exception:  # _prefetch_one tries again and says why (debug)
                cached = False
            if cached:
                with self._lock:
                    self._inflight.discard(rel)
                continue
            try:
                self._pool.submit(self._prefetch_one, rel)
            except RuntimeError:  # the source was closed meanwhile: nothing more to hand out
                with self._lock:
                    self._inflight.difference_update(rels[i:])
                return

    def _prefetch_one(self, rel: str) -> None:
        try:
            if self._is_cached(rel):
                return
            with self._filling(rel):
                if self._is_cached(rel):  # a worker (or another rank) filled it
                    return
                _, size = self._fill(rel)
            with self._lock:
                self._prefetched_bytes += size
                self._prefetched_files += 1
                if self._approx_bytes is not None:
                    self._approx_bytes += size
        except Exception as e:  # the reader will fetch it again and raise with the file's name
            log.debug("prefetch of %s failed: %s", rel, e)
        finally:
            with self._lock:
                self._inflight.discard(rel)

    def _maybe_evict(self, protect: set[str], force: bool = False) -> None:
        # A full scan costs one stat per cached file: do it when our estimate says we are over
        # budget, or every few seconds (other ranks and workers fill the cache too). `force`: the
        # disk is full, make room now.
        now = time.monotonic()
        within = self._approx_bytes is not None and self._approx_bytes <= self.cache_limit
        if not force and within and now - self._last_scan < 5:
            return
        self._last_scan = now
        entries = []
        for root, _, names in os.walk(self.dir):
            for n in names:
                if n.startswith((".fill-", ".part-", ".lock-")):
                    continue
                p = os.path.join(root, n)
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, st.st_size, p))
        total = sum(e[1] for e in entries)
        if total > self.cache_limit or force:
            target = (0.5 if force else 0.9) * self.cache_limit
            for _, size, p in sorted(entries):
                if total <= target:
                    break
                if os.path.relpath(p, self.dir) in protect:
                    continue
                try:
                    os.unlink(p)
                    total -= size
                    self._evicted += 1
                except FileNotFoundError:
                    pass
        self._approx_bytes = total

    def stats(self) -> dict[str, float]:
        return {
            "data/prefetched_files": self._prefetched_files,
            "data/prefetched_bytes": self._prefetched_bytes,
            "data/evicted_files": self._evicted,
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._fill_fd is not None and self._fill_pid == os.getpid():
            os.close(self._fill_fd)
            self._fill_fd = None
