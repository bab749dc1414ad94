"""Data pipeline: exact resume with any worker count, cached == remote, atomic cache fills,
eviction, bad input, remote roots (memory://, s3:// through moto)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import end_gloo_rank, plain_write
from midwrite import kill_inside_the_write

from goodput.data.dataset import BadSampleError, DataRootError
from goodput.data.loader import (
    DataConfig,
    DatasetChangedError,
    QuietWorkersLoader,
    ResumableLoader,
    eval_loader,
    frozen_for_fork,
)
from goodput.data.sampler import StepBatchSampler
from goodput.data.sources import CachedSource
from goodput.data.synthetic import make_dataset
from goodput.storage.local import TEMP_PREFIX
from goodput.storage.remote import Storage

STEPS = 10


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_dataset(str(root), num_classes=4, train_per_class=10, val_per_class=2, image_size=16)
    return str(root)


SOURCE = {
    "cached": {"_target_": "goodput.data.sources.CachedSource", "prefetch_threads": 4},
    "remote": {"_target_": "goodput.data.sources.RemoteSource"},
}


def loader(root, cache_dir, backend="cached", workers=0, max_steps=STEPS, storage_cfg=None, **kw):
    source = dict(SOURCE[backend])
    if "cache_limit" in kw:
        source["cache_limit"] = kw.pop("cache_limit")
    cfg = DataConfig(
        source=source, root=root, cache_dir=str(cache_dir), image_size=16, num_workers=workers,
        prefetch_factor=2, prefetch_steps=3, on_bad_sample=kw.pop("on_bad_sample", "error"),
    )  # fmt: skip
    rank, world = kw.pop("rank", 0), kw.pop("world", 1)
    return ResumableLoader(cfg, Storage(root, storage_cfg), 5, 8, max_steps, rank, world, torch.device("cpu"))


def images(ld, n):
    out = [next(ld)["image"] for _ in range(n)]
    return out


@pytest.fixture(scope="module")
def reference(data_root, tmp_path_factory):
    ld = loader(data_root, tmp_path_factory.mktemp("cache"))
    out = images(ld, STEPS)  # 10 steps of 8 over 40 samples: two epochs
    ld.close()
    return out, ld.chain.hexdigest


@pytest.mark.parametrize("before, after", [(0, 0), (1, 1), (2, 2), (0, 2), (2, 1)])
def test_resume_mid_epoch_is_bitwise_identical(data_root, tmp_path, reference, before, after):
    ref, ref_chain = reference
    a = loader(data_root, tmp_path / "c", workers=before)
    first = images(a, 3)
    sd = a.state_dict()
    a.close()
    assert sd["step"] == 3 and a.epoch == 0  # delivered, not prefetched
    b = loader(data_root, tmp_path / "c", workers=after)
    b.load_state_dict(sd)
    rest = images(b, STEPS - 3)
    b.close()
    for x, y in zip(first + rest, ref):
        assert torch.equal(x, y)
    assert b.chain.hexdigest == ref_chain


class _Timed(torch.utils.data.Dataset):
    """The loader's dataset, each sample's worker, (epoch, index), start and end appended to a file
    (CLOCK_MONOTONIC: one clock for every process); the samples in `slow` take `delay` s longer,
    `bad` ones raise. Samples are named by (epoch, index): an index comes again in the next epoch."""

    def __init__(self, inner, path, slow=(), bad=(), delay=0.05):
        self.inner, self.path, self.slow, self.bad, self.delay = inner, path, set(slow), set(bad), delay

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, key):
        start, name = time.monotonic(), tuple(key)  # the sampler's (epoch, index)
        if name in self.bad:
            raise ValueError(f"sample {name} is bad")
        if name in self.slow:
            time.sleep(self.delay)
        out = self.inner[key]
        with open(self.path, "a") as f:
            f.write(
                f"{torch.utils.data.get_worker_info().id} {name[0]} {name[1]} {start} {time.monotonic()}\n"
            )
        return out


def _batch(ld, step: int) -> set:
    return {(ld.order.epoch_of(step), i) for i in ld.order.rank_batch(step, 0, 1)}


def _rows(path) -> list:
    return [(int(w), (int(e), int(i)), float(a), float(b)) for w, e, i, a, b in
            (line.split() for line in path.read_text().splitlines())]  # fmt: skip


def test_the_other_workers_start_once_the_first_batch_is_made(data_root, tmp_path, reference):
    """A (re)started rank waits for batch 0 alone: worker 0 makes it with the cores to itself, and
    worker 1 starts on batch 1 after it, not beside it. The batches are the same."""
    ld = loader(data_root, tmp_path / "c", workers=2)
    first = _batch(ld, 0)
    ld.dataset = _Timed(ld.dataset, tmp_path / "samples", slow=first)
    got = images(ld, 4)
    ld.close()
    assert all(torch.equal(x, y) for x, y in zip(got, reference[0]))
    rows = _rows(tmp_path / "samples")
    made = max(end for w, name, _, end in rows if w == 0 and name in first)
    worker1 = [start for w, _, start, _ in rows if w == 1]
    assert worker1 and min(worker1) >= made, (made, sorted(worker1)[:3])


def test_the_wait_for_the_first_batch_is_bounded(data_root, tmp_path, monkeypatch):
    """A first batch that takes longer than the bound (FIRST_BATCH_WAIT_S, here 0.3 s): worker 1
    starts on its batch before it is made."""
    from goodput.data import loader as module

    monkeypatch.setattr(module, "FIRST_BATCH_WAIT_S", 0.3)  # read in the forked workers
    ld = loader(data_root, tmp_path / "c", workers=2)
    first = _batch(ld, 0)
    ld.dataset = _Timed(ld.dataset, tmp_path / "samples", slow=sorted(first)[:1], delay=2.0)
    next(ld)
    ld.close()
    rows = _rows(tmp_path / "samples")
    made = max(end for w, name, _, end in rows if w == 0 and name in first)
    assert min(start for w, _, start, _ in rows if w == 1) < made


def test_a_failed_first_batch_releases_the_waiting_workers(data_root, tmp_path):
    """Worker 0's batches raise (0, 2, ...: it never makes one): the error lets the others go at
    once (worker 1 makes its batch well within the 30 s bound), and stopping the loader ends them
    (exit 0, not after the DataLoader's 5 s join and a SIGTERM)."""
    ld = loader(data_root, tmp_path / "c", workers=2)
    bad = {sorted(_batch(ld, s))[0] for s in range(0, STEPS, 2)}
    ld.dataset = _Timed(ld.dataset, tmp_path / "samples", bad=bad)
    with pytest.raises(ValueError, match="is bad"):
        next(ld)
    deadline = time.monotonic() + 10
    while (
        not any(w == 1 for w, *_ in _rows(tmp_path / "samples")) if (tmp_path / "samples").exists() else True
    ):
        assert time.monotonic() < deadline, "worker 1 still waits for a first batch that failed"
        time.sleep(0.05)
    workers = list(ld._dl._iterator._workers)  # torch's (private): to read their exit codes
    ld.close()
    assert [w.exitcode for w in workers] == [0, 0]


def test_a_killed_waiting_worker_stops_nobody(data_root, tmp_path):
    """A worker killed while it waits for the first batch (the OOM killer): worker 0 still hands
    over batch 0 and the loader still stops. (With a multiprocessing Event, set() waits for every
    sleeper to wake and blocked for good, in worker 0 and in the main process.)"""
    import signal
    import threading

    ld = loader(data_root, tmp_path / "c", workers=2)
    ld.dataset = _Timed(ld.dataset, tmp_path / "samples", slow=_batch(ld, 0), delay=0.25)
    ld.start_at(0)  # forks the workers: worker 1 waits while worker 0 makes batch 0 (2 s)
    workers = list(ld._dl._iterator._workers)
    time.sleep(0.7)  # worker 1 is in its wait by now
    with contextlib.suppress(RuntimeError):  # torch's SIGCHLD handler says so in this thread at once
        os.kill(workers[1].pid, signal.SIGKILL)
        workers[1].join(10)
        time.sleep(0.5)
    outcome = []

    def first_then_stop():
        try:
            outcome.append(next(ld)["image"].shape[0])
        except RuntimeError as e:  # torch reports the dead worker: also an answer
            outcome.append(str(e))
        ld.close()
        outcome.append("stopped")

    t = threading.Thread(target=first_then_stop, daemon=True)
    t.start()
    t.join(60)
    assert outcome[-1:] == ["stopped"], outcome


def test_cached_and_remote_give_identical_batches(data_root, tmp_path, reference):
    ld = loader(data_root, tmp_path, backend="remote", workers=2)
    got = images(ld, STEPS)
    ld.close()
    assert all(torch.equal(x, y) for x, y in zip(got, reference[0]))
    assert ld.stats()["data/cache_hits"] == 0


def test_augmentation_differs_per_epoch_and_sample(reference):
    ref = reference[0]
    assert not torch.equal(ref[0], ref[5])  # epoch 0 vs 1, different order and crops


def test_cache_hits_after_first_epoch(data_root, tmp_path):
    ld = loader(data_root, tmp_path, workers=0)
    images(ld, 5)  # first epoch: 40 files
    time.sleep(0.2)  # let prefetch threads finish
    s0 = dict(ld.stats())
    images(ld, 5)
    s1 = ld.stats()
    ld.close()
    assert s1["data/cache_hits"] - s0["data/cache_hits"] == 40  # second epoch served from the node cache
    assert s1["data/prefetched_files"] > 0


def test_sharded_ranks_cover_the_global_batch(data_root, tmp_path, reference):
    ranks = [loader(data_root, tmp_path, rank=r, world=2) for r in range(2)]
    for step in range(STEPS):
        merged = torch.cat([next(ld)["image"] for ld in ranks])
        assert torch.equal(merged, reference[0][step])  # same samples, same augmentation, any world size


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "mutant-in-place"])
def test_killed_cache_fill_never_serves_a_partial_file(data_root, tmp_path, monkeypatch, atomic):
    """SIGKILL inside the write of a fill (tests/midwrite.py): the cache holds the whole file or none.
    The in-place mutant shows the drill fails a fill that is not atomic. (No listing is opened here:
    its size check would also refetch a short file, and this is about the fill alone.)"""
    if not atomic:
        monkeypatch.setattr(
            CachedSource, "_store", lambda self, rel, data: plain_write(self.local_path(rel), data)
        )
    truth = Storage(data_root)
    rels = [f"train/{f}" for f in sorted(truth.find("train"))[:3]]
    src = CachedSource(truth, str(tmp_path))
    for rel in rels:
        kill_inside_the_write(lambda rel=rel: src._fill(rel), str(tmp_path))
    whole = {rel: truth.read_bytes(rel) for rel in rels}
    on_disk = {r: Path(src.local_path(r)).read_bytes() for r in rels if os.path.exists(src.local_path(r))}
    partial = [r for r, data in on_disk.items() if data != whole[r]]
    served = [r for r in rels if src.read(r)[0] != whole[r]]
    if atomic:
        assert partial == [] and served == []
        leftovers = [n for _, _, ns in os.walk(src.dir) for n in ns if n.startswith(TEMP_PREFIX)]
        assert len(leftovers) == len(rels)  # each kill left its half-written temp file, never served
    else:
        assert partial == rels and served == rels  # what the drill exists to catch


def test_eviction_respects_budget_and_lookahead(data_root, tmp_path):
    store = Storage(data_root)
    sizes = {f"train/{k}": v for k, v in store.find("train").items()}
    files = sorted(sizes)
    budget = sum(sizes[f] for f in files[:10])
    src = CachedSource(store, str(tmp_path), cache_limit=budget)
    for f in files[:25]:
        src.read(f)
        time.sleep(0.002)  # distinct mtimes: a clear LRU order
    protect = set(files[:5])  # oldest files, but inside the look-ahead window
    src._last_scan = 0
    src._maybe_evict(protect)
    walk = ((r, n) for r, _, ns in os.walk(src.dir) for n in ns if not n.startswith(".lock-"))
    left = {os.path.relpath(os.path.join(r, n), src.dir) for r, n in walk}  # the fill lock is no sample
    assert sum(sizes[f] for f in left) <= budget
    assert protect <= left
    assert not set(files[5:15]) & left  # the least recently used outside the window went first


def _corrupt_copy(data_root, tmp_path):
    import shutil

    root = tmp_path / "bad"
    shutil.copytree(data_root, root)
    victim = sorted((root / "train").rglob("*.jpg"))[3]
    victim.write_bytes(victim.read_bytes()[:40])  # truncated JPEG
    return str(root), victim


def test_corrupt_jpeg_names_the_file(data_root, tmp_path):
    root, victim = _corrupt_copy(data_root, tmp_path)
    ld = loader(root, tmp_path / "c", backend="remote")
    with pytest.raises(BadSampleError, match=victim.name):
        images(ld, STEPS)


def test_corrupt_jpeg_skipped_and_counted(data_root, tmp_path):
    root, _ = _corrupt_copy(data_root, tmp_path)
    ld = loader(root, tmp_path / "c", backend="remote", on_bad_sample="skip")
    batches = [next(ld) for _ in range(5)]  # one epoch
    assert ld.stats()["data/bad_samples"] == 1
    assert sum(int((b["label"] == -1).sum()) for b in batches) == 1


def test_empty_class_folder_empty_dataset_missing_root(data_root, tmp_path):
    import shutil

    root = tmp_path / "d"
    shutil.copytree(data_root, root)
    (root / "train" / "zzz-empty").mkdir()
    with pytest.raises(DataRootError, match="zzz-empty"):
        loader(str(root), tmp_path / "c")
    (tmp_path / "e" / "train").mkdir(parents=True)
    with pytest.raises(DataRootError, match="no files under"):
        loader(str(tmp_path / "e"), tmp_path / "c")
    with pytest.raises(DataRootError, match="nowhere"):
        loader(str(tmp_path / "nowhere"), tmp_path / "c")


def test_changed_dataset_is_detected_on_resume(data_root, tmp_path):
    import shutil

    a = loader(data_root, tmp_path / "c")
    images(a, 2)
    sd = a.state_dict()
    root = tmp_path / "d"
    shutil.copytree(data_root, root)
    next((root / "train").rglob("*.jpg")).unlink()
    b = loader(str(root), tmp_path / "c")
    with pytest.raises(DatasetChangedError, match="had 40 training files, now 39"):
        b.load_state_dict(sd)
    old = dict(sd)
    del old["sizes_sha256"]  # a checkpoint written before the sizes were recorded: names and count
    loader(data_root, tmp_path / "c").load_state_dict(old)


def _upload(data_root, url):
    src, dst = Storage(data_root), Storage(url)
    for rel in src.find(""):
        dst.write_bytes(rel, src.read_bytes(rel))


def test_memory_root_matches_local(data_root, tmp_path, reference):
    _upload(data_root, "memory://goodput-data-test")
    ld = loader("memory://goodput-data-test", tmp_path)
    assert all(torch.equal(x, y) for x, y in zip(images(ld, STEPS), reference[0]))


def test_s3_root_through_moto(data_root, tmp_path, reference, s3_bucket):
    url = f"s3://{s3_bucket}/shapes"
    _upload(data_root, url)
    ld = loader(url, tmp_path, workers=2)
    got = images(ld, STEPS)
    ld.close()
    assert all(torch.equal(x, y) for x, y in zip(got, reference[0]))


class _ReadsInAWorker(torch.utils.data.Dataset):
    """Reads one file through the Storage it was given, and says which client read it and where."""

    def __init__(self, store, rel):
        self.store, self.rel = store, rel

    def __len__(self):
        return 1

    def __getitem__(self, i):
        client = type(self.store.read_fs).__module__.split(".")[0]
        return client, len(self.store.read_bytes(self.rel)), os.getpid()


def test_s3_reads_use_obstore_in_the_owning_process_and_s3fs_after_fork(data_root, s3_bucket):
    """obstore's runtime does not survive fork: a DataLoader worker forked from the rank that read
    through obstore (holding that rank's Storage) falls back to s3fs, and reads the same bytes."""
    pytest.importorskip("obstore")
    url = f"s3://{s3_bucket}/shapes"
    _upload(data_root, url)
    store = Storage(url)
    rel = "train/" + sorted(store.find("train"))[0]
    assert type(store.read_fs).__module__.startswith("obstore")
    data = store.read_bytes(rel)
    assert data == Storage(data_root).read_bytes(rel)
    dl = QuietWorkersLoader(_ReadsInAWorker(store, rel), batch_size=None, num_workers=1,
                            multiprocessing_context="fork", timeout=60)  # fmt: skip
    client, size, pid = next(iter(dl))
    assert (client, size) == ("s3fs", len(data)) and pid != os.getpid()
    assert type(store.read_fs).__module__.startswith("obstore")  # the rank's own client is kept


class _Client:
    """Stands for a store client: its finalizer says which process ran it."""

    def __init__(self, path):
        self.path = path

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


class _OpensItsStore(torch.utils.data.Dataset):
    def __init__(self, store):
        self.store = store

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return self.store.fs is not None and self.store.read_fs is not None, os.getpid()


def test_a_forked_worker_replaces_its_ranks_store_clients_without_finalizing_them(data_root, tmp_path):
    """s3fs's session closes on its parent's event-loop thread, obstore's client on its runtime's:
    neither thread is in a forked worker. The worker makes its own clients and leaves the rank's
    alone: they are finalized in the rank, once, when it drops them."""
    marks = tmp_path / "finalized"
    store = Storage(data_root)
    store._read_fs, store._get = _Client(marks), _Client(marks)  # the rank's clients, as obstore's
    dl = QuietWorkersLoader(_OpensItsStore(store), batch_size=None, num_workers=1,
                            multiprocessing_context="fork", timeout=60)  # fmt: skip
    opened, pid = next(iter(dl))
    del dl
    assert opened and pid != os.getpid()
    assert not marks.exists(), f"the rank's client was finalized in pid {marks.read_text().split()}"
    del store
    assert marks.read_text().split() == [str(os.getpid())] * 2


class _Finalized:
    """Garbage in a reference cycle whose finalizer says which process ran it."""

    def __init__(self, path):
        self.path, self.me = path, self

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


class _CollectsGarbage(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        import gc

        gc.collect()
        return os.getpid()


def test_a_forked_worker_never_finalizes_what_its_parent_left_for_the_collector(tmp_path):
    """A failed run's trainer left in a traceback cycle holds a process group, loader workers and
    store clients: collected in a forked worker, their finalizers act on threads and sockets that
    are not there (a segfault or a hang). The worker leaves them to the parent."""
    import gc

    marks = tmp_path / "finalized"
    gc.disable()  # the cycle must still be uncollected when the worker forks
    try:
        _Finalized(marks)
        dl = QuietWorkersLoader(_CollectsGarbage(), batch_size=None, num_workers=1,
                                multiprocessing_context="fork", timeout=60)  # fmt: skip
        workers = set(iter(dl))
    finally:
        gc.enable()
    assert workers and os.getpid() not in workers
    assert not marks.exists(), f"finalized in a worker (pid {marks.read_text().split()})"
    gc.collect()
    assert marks.read_text().split() == [str(os.getpid())]  # the parent's collector still has it


def test_the_fork_freeze_is_undone_after_the_fork_unless_the_user_had_frozen(tmp_path):
    import gc

    assert gc.get_freeze_count() == 0
    with frozen_for_fork():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0  # the rank's own garbage is collected again
    marks = tmp_path / "finalized"
    gc.disable()  # no collection before the freeze
    _Finalized(marks)
    gc.freeze()  # a user's (for copy-on-write after fork): what it froze stays frozen
    gc.enable()
    try:
        with frozen_for_fork():
            pass
        gc.collect()
        assert not marks.exists() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    gc.collect()
    assert marks.exists()


class _HeldStorage(Storage):
    """Counts remote reads across processes; says when one has started, and holds each until the
    test releases it."""

    def __init__(self, root, reads, started, release):
        super().__init__(root)
        self.reads, self.started, self.release = reads, started, release

    def read_bytes(self, rel):
        with self.reads.get_lock():
            self.reads.value += 1
        self.started.set()
        assert self.release.wait(30)
        return super().read_bytes(rel)


class _SaysWhenItWaits(CachedSource):
    """Says when a process other than the test's has missed the cache and goes for the fill lock."""

    def _filling(self, rel):
        if os.getpid() != self.test_pid:
            self.waiting.set()
        return super()._filling(rel)


def _read_in_worker(src, rel, q):
    data, hit, fetched = src.read(rel)
    q.put((data, hit, fetched))


def test_worker_waits_for_the_prefetch_fill_instead_of_a_second_get(data_root, tmp_path):
    """A DataLoader worker that reaches a file the prefetch threads are fetching waits for that
    fill: one remote read in all, and the worker gets the whole file. The prefetch's read is held
    until the worker has missed the cache, so the order does not depend on the machine's speed."""
    ctx = mp.get_context("fork")
    reads, started, release = ctx.Value("i", 0), ctx.Event(), ctx.Event()
    store = _HeldStorage(data_root, reads, started, release)
    rel = "train/" + sorted(Storage(data_root).find("train"))[0]
    src = _SaysWhenItWaits(store, str(tmp_path))
    src.test_pid, src.waiting = os.getpid(), ctx.Event()
    src.prefetch([rel], set())
    assert started.wait(10)  # the prefetch thread is inside its fill now
    q = ctx.Queue()
    p = ctx.Process(target=_read_in_worker, args=(src, rel, q))
    with frozen_for_fork():  # forked as DataLoader workers are
        p.start()
    try:
        assert src.waiting.wait(30)  # the worker missed the cache while the fill was in flight
    finally:
        release.set()
    data, hit, fetched = q.get(timeout=30)
    p.join(10)
    src.close()
    assert data == Storage(data_root).read_bytes(rel)
    assert (hit, fetched) == (False, 0)  # not in the cache when asked, but not fetched again
    assert reads.value == 1


def test_seeded_transform_matches_torch_manual_seed_and_restores_the_rng():
    """The per-sample seeding seeds the CPU generator only: the same augmentation as
    torch.manual_seed gave (checkpoints and hash chains of earlier runs stay valid), and the
    global RNG stream is untouched afterwards."""
    from goodput.data import augment
    from goodput.data.dataset import seeded

    tf = augment.build(None, 16)[0]
    img = torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8)
    for seed in (0, 7, 2**40 + 3):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            want = tf(img)
        state = torch.get_rng_state()
        assert torch.equal(seeded(tf, img, seed), want)
        assert torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(seeded(tf, img, 1), seeded(tf, img, 2))


def test_s3_missing_object_is_file_not_found(data_root, s3_bucket):
    """A missing key reads as FileNotFoundError through either client (the shards backend falls
    back to `<root>-shards` on it, the dataset names the file)."""
    url = f"s3://{s3_bucket}/shapes"
    _upload(data_root, url)
    with pytest.raises(FileNotFoundError):
        Storage(url).read_bytes("train/no-such-file.jpg")


class _RestartsItsEpoch(StepBatchSampler):
    """The source article's bug, planted: on resume the sampler starts the epoch over."""

    def __init__(self, order, rank, world, start, stop):
        super().__init__(order, rank, world, order.epoch_of(start) * order.steps_per_epoch, stop)


class _SkipsABatch(StepBatchSampler):
    """A sampler that loses one batch after a resume: it serves the step after each step."""

    def __init__(self, order, rank, world, start, stop):
        super().__init__(order, rank, world, start, stop + 1)

    def __iter__(self):
        it = super().__iter__()
        next(it)
        yield from it


@pytest.mark.parametrize(
    "bug", [None, _RestartsItsEpoch, _SkipsABatch], ids=["clean", "restart-epoch", "skip"]
)
def test_the_order_hash_is_of_the_delivered_batches(data_root, tmp_path, reference, monkeypatch, bug):
    """sample_order_sha256 hashes the indices the batches carried: a loader that restarts its epoch
    on resume, or skips a batch, changes it (a hash of the intended order would not see either)."""
    import goodput.data.loader as loader_module

    ld = loader(data_root, tmp_path)
    images(ld, 3)
    sd = ld.state_dict()
    ld.close()
    if bug is not None:
        monkeypatch.setattr(loader_module, "StepBatchSampler", bug)
    ld = loader(data_root, tmp_path)
    ld.load_state_dict(sd)
    got = [next(ld) for _ in range(STEPS - 3)]
    ld.close()
    same_images = all(torch.equal(b["image"], r) for b, r in zip(got, reference[0][3:]))
    assert same_images == (bug is None)  # the planted bugs do deliver other samples
    assert (ld.chain.hexdigest == reference[1]) == (bug is None)


def _order_rank(rank: int, port: int, root: str, cache: str, skip_on: int, out: str) -> None:
    """One of two gloo ranks delivering its slices; `skip_on`: the rank whose sampler skips a batch."""
    import torch.distributed as dist

    import goodput.data.loader as loader_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == skip_on:
        loader_module.StepBatchSampler = _SkipsABatch
    ld = loader(root, f"{cache}/{rank}", rank=rank, world=2)
    images(ld, STEPS - 1)
    Path(out, f"chain{rank}").write_text(ld.chain.hexdigest)
    ld.close()
    end_gloo_rank()


@pytest.mark.slow
@pytest.mark.parametrize("skip_on", [-1, 1], ids=["clean", "rank1-skips"])
def test_two_ranks_hash_the_whole_delivered_batch(data_root, tmp_path, reference, skip_on):
    """On 2 ranks every rank's chain is the one-process chain (the job's batches, gathered from
    both ranks), and a batch lost on rank 1 alone changes rank 0's chain too."""
    import torch.multiprocessing as mp

    from goodput.data.sampler import OrderHash
    from goodput.parallel import free_port

    mp.spawn(_order_rank, args=(free_port(), data_root, str(tmp_path), skip_on, str(tmp_path)), nprocs=2)
    chains = {(tmp_path / f"chain{r}").read_text() for r in range(2)}
    ld = loader(data_root, tmp_path / "one")
    want = OrderHash()
    for step in range(STEPS - 1):
        want.update(ld.order.global_batch(step))
    ld.close()
    assert chains == {want.hexdigest} if skip_on < 0 else want.hexdigest not in chains


def test_close_stops_the_persistent_workers_now(data_root, tmp_path):
    """Left to interpreter exit, persistent workers are terminated by multiprocessing and torch's
    SIGCHLD handler fails a finished run ("DataLoader worker is killed by signal"): the training
    loader's close and the eval loader's stop_workers (Trainer.close calls both) end them first."""
    ld = loader(data_root, tmp_path, workers=2)
    images(ld, 2)
    cfg = ld.cfg
    val = eval_loader(cfg, Storage(data_root), 4, 0, 1, torch.device("cpu"))
    next(iter(val))
    workers = list(ld._it.it._workers) + list(val._iterator._workers)
    assert len(workers) == 4 and all(w.is_alive() for w in workers)
    ld.close()
    val.stop_workers()
    assert not any(w.is_alive() for w in workers) and val._iterator is None


@pytest.mark.parametrize(
    "ahead, restored", [(3, 3), (5, 3), (3, None)], ids=["lands-there", "lands-elsewhere", "nothing-restored"]
)
def test_a_loader_started_ahead_gives_a_fresh_ones_batches(data_root, tmp_path, reference, ahead, restored):
    """A (re)start starts the loader at the step it will most likely continue at (start_at, the
    first candidate commit's) before the checkpoint is read, so the first batch is made meanwhile.
    A restore that lands there keeps those workers and batches; one that lands elsewhere (the
    newest commit did not load) or nowhere starts over at its own step: the batches are the
    uninterrupted run's either way."""
    ref, ref_chain = reference
    a = loader(data_root, tmp_path / "c", workers=2)
    images(a, 3)
    sd = a.state_dict()
    a.close()
    b = loader(data_root, tmp_path / "c", workers=2)
    b.start_at(ahead)
    started = b._it
    assert started is not None and all(w.is_alive() for w in started.it._workers)  # forked before the read
    if restored is not None:
        b.load_state_dict(sd)
    first = restored or 0
    got = images(b, STEPS - first)
    kept = b._it is started
    b.close()
    assert kept == (ahead == first)
    assert len(got) == STEPS - first and all(torch.equal(x, y) for x, y in zip(got, ref[first:]))
    assert b.chain.hexdigest == ref_chain


def test_a_prefetch_of_cached_files_starts_one_thread(data_root, tmp_path):
    """After a restart the node cache holds the next steps' files: the first prefetch call hands
    them to one task that checks them, instead of starting every prefetch thread for nothing (tens
    of ms on a restart's path)."""
    ld = loader(data_root, tmp_path, workers=0)
    images(ld, 5)  # an epoch: every file cached
    ld.close()
    src = CachedSource(Storage(data_root), str(tmp_path), prefetch_threads=4)
    files = list(ld.files.files)
    src.prefetch(files, set(files))
    threads = [t for t in src._pool._threads]
    src._pool.shutdown(wait=True)
    src.close()
    assert len(threads) == 1
    assert src.stats()["data/prefetched_files"] == 0 and not src._inflight


def test_workers_forked_while_another_thread_is_in_tempfiles_first_call_deliver(
    data_root, tmp_path, monkeypatch
):
    """Seen in CI and in a suite run here (py-spy): a DataLoader worker forked while another thread
    (MLflow's upload thread, writing a temp file) was inside tempfile's first gettempdir() inherited
    tempfile's module lock held, and waited forever for the temp dir that handing its first batch to
    the main process needs: the run made no step until the test gave up. The loader settles the temp
    dir before it forks (settle_before_fork; without it this test times out)."""
    import tempfile
    import threading

    # the first call still to come, as at a job's start (and no multiprocessing temp dir made yet;
    # the names of temp files already drawn, as by any temp file before: no other wait on the lock)
    tempfile._get_candidate_names()
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.delitem(mp.current_process()._config, "tempdir", raising=False)
    held, forked = threading.Event(), threading.Event()

    def first_call_elsewhere():  # a thread inside tempfile's first gettempdir() as the workers fork
        with tempfile._once_lock:
            held.set()
            forked.wait(3)  # the fix waits for it to end (3 s); without it the fork comes first

    th = threading.Thread(target=first_call_elsewhere, daemon=True)
    th.start()
    held.wait(10)
    ld = loader(data_root, tmp_path, workers=2)
    ld.start_at(0)  # forks the workers
    forked.set()
    got: list = []
    take = threading.Thread(target=lambda: got.append(images(ld, 3)), daemon=True)
    take.start()
    take.join(60)
    stuck = take.is_alive()
    # stuck: free the main process's wait (the workers die, the loader raises in `take`; torch's
    # SIGCHLD handler reports the kill in this thread)
    with contextlib.suppress(RuntimeError):
        for w in ld._it.it._workers if stuck else ():
            os.kill(w.pid, signal.SIGKILL)
        take.join(30)
        ld.close()
    th.join(10)
    assert not stuck, "a worker waited for tempfile's lock, held by a thread of its parent at the fork"
    assert got and len(got[0]) == 3
