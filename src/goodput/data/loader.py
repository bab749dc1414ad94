"""The training data pipeline: sampler + dataset + DataLoader, resumable at any delivered step.

`ResumableLoader` is the one object the loop talks to: `next(loader)` gives the batch of the next
step; `state_dict()` describes what was *delivered* (not what workers prefetched), so a checkpoint
taken after step k resumes at step k+1 exactly, with any `data.num_workers`. Its `chain` hashes the
sample indices the job's batches actually carried (every rank's part), not the ones the order meant:
a loader that restarted its epoch on resume or skipped a batch shows in `sample_order_sha256`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import logging
import multiprocessing.sharedctypes
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch.utils.data import DataLoader, default_collate

from goodput.data import augment as augmentation
from goodput.data.augment import AugmentConfig
from goodput.data.config import DataConfig
from goodput.data.dataset import ImageDataset
from goodput.data.sampler import OrderHash, StepBatchSampler, dropped_per_epoch
from goodput.errors import IncompatibleCheckpoint, UserError
from goodput.resilience.signals import obey_parent_only, signals_blocked
from goodput.storage.remote import Storage

log = logging.getLogger(__name__)


class DatasetChangedError(IncompatibleCheckpoint):
    """The training listing differs from the checkpoint's: another file count, other file names, or
    the same names with other sizes (images replaced in place)."""


def sizes_digest(sizes: list[int]) -> str:
    """16 hex digits of sha256 over the listing's file sizes, in listing order: what a resume checks
    of the files' contents (the listing has them; no byte is read). About 35 ms per million files."""
    return hashlib.sha256(np.asarray(sizes, dtype="<i8").tobytes()).hexdigest()[:16]


# How long the other workers wait for the first batch at most (FirstBatchFirst): a bound, not a
# schedule. The main process releases them on every way out (stop_workers, a worker's error).
FIRST_BATCH_WAIT_S = 30.0


def _init_worker(worker_id: int, first_batch: FirstBatchFirst | None = None) -> None:
    # A preemption notice goes to the whole process group; a worker that died of it would fail the
    # main process before it could checkpoint. Workers leave shutdown to the main process...
    obey_parent_only()
    # ...and do not outlive it (see die_with_parent).
    if sys.platform == "linux":
        die_with_parent(worker_id)
    if first_batch is not None and worker_id > 0:
        first_batch.wait(FIRST_BATCH_WAIT_S)


class FirstBatchFirst:
    """The DataLoader's collate, and a flag it raises once a worker has made a batch: the other
    workers wait for it in their init before they start on theirs.

    A (re)started rank needs batch 0 before anything else, but its iterator hands batch k to worker
    k mod n at once, and every worker starts decoding while the rank restores its checkpoint: on
    busy cores batch 0 came as late as the n-th. Worker 0 makes it alone; the rest start after,
    while the first step computes (the work they would have done is not lost: later steps find
    their batches ready). The order and content of the batches are unchanged.

    The flag is a byte of shared memory that the waiting workers poll, not a multiprocessing Event:
    an Event's set() waits for every sleeper to wake, and blocks for good once a waiting worker was
    killed (the OOM killer), in worker 0's collate and in the main process's release alike."""

    POLL_S = 0.01

    def __init__(self, collate):
        self.collate = collate
        self.made = multiprocessing.sharedctypes.RawValue("b", 0)  # no lock: one byte, only ever set
        self._told = False  # per process: the shared byte is written once by each

    def __call__(self, samples):
        batch = self.collate(samples)
        if not self._told:
            self.made.value, self._told = 1, True
        return batch

    def release(self) -> None:
        self.made.value = 1

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.made.value and time.monotonic() < deadline:
            time.sleep(self.POLL_S)


@contextlib.contextmanager
def frozen_for_fork():
    """Processes forked inside never collect what they inherit (gc.freeze, the recipe of its docs).

    Objects the parent had left for its garbage collector (a failed run's trainer in a traceback
    cycle: its process group, its own loader's workers, an object store client's runtime) are the
    parent's: finalized in a forked worker, they act on threads and sockets that are not there,
    and the worker segfaults or hangs. A worker's collector also no longer writes to every
    inherited object's header, so fewer pages are copied. A user's earlier gc.freeze is kept."""
    kept = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        yield
    finally:
        if not kept:
            gc.unfreeze()


def settle_before_fork() -> None:
    """What a forked worker needs that sits behind a lock another thread of this process may hold.

    A fork copies a lock in the state it has at that instant; a lock another thread held then is
    held for good in the child. tempfile computes its directory once, under a module lock, on the
    first call: the MLflow upload thread writes a temp file as the workers fork, and a worker then
    waited forever for the temp dir its first batch needs (tensors go to the main process by file
    descriptor, through multiprocessing's resource sharer, which listens on a socket in a temp dir).
    Computed here, the directory is inherited and the lock is never taken again; so are the random
    temp names (the same lock guards their first draw: private, hence the getattr)."""
    tempfile.gettempdir()
    getattr(tempfile, "_get_candidate_names", lambda: None)()


class QuietWorkersLoader(DataLoader):
    """A DataLoader whose workers ignore preemption signals from their first instruction (the
    signals are blocked while the iterator forks them, closing the window before worker_init_fn),
    leave alone what they inherited (frozen_for_fork) and find no lock they need held
    (settle_before_fork)."""

    def __iter__(self):
        settle_before_fork()
        with signals_blocked(), frozen_for_fork():
            return _PlainErrors(super().__iter__(), self._release)

    def resume(self):
        """A new pass over the batches on the workers already running (persistent: none is forked,
        so nothing is frozen for a fork, and the next collection walks no heap that unfreezing
        would have put back in its reach)."""
        return _PlainErrors(super().__iter__(), self._release)

    def _release(self) -> None:
        if isinstance(self.collate_fn, FirstBatchFirst):  # workers waiting for a batch that will not come
            self.collate_fn.release()

    def stop_workers(self) -> None:
        """Persistent workers stopped now, not at interpreter exit: there multiprocessing terminates
        daemonic children, and torch's SIGCHLD handler turns a worker ended by SIGTERM into
        "DataLoader worker is killed by signal", exit 1 after a run that finished."""
        self._release()  # a waiting worker reads its stop request only once it runs (else: a 5 s join)
        it, self._iterator = getattr(self, "_iterator", None), None
        shutdown = getattr(it, "_shutdown_workers", None)  # torch's own teardown (private)
        if shutdown is not None:
            shutdown()


class _PlainErrors:
    """A DataLoader iterator whose refusals (UserError: a file that does not decode, ...) arrive as
    the worker raised them. torch re-raises a worker's exception as the same type with "Caught X in
    DataLoader worker process N. Original Traceback ..." pasted into its message, and the message
    is what the entry point prints as its one line (the worker's traceback stays in the debug log)."""

    def __init__(self, it, release):
        self.it, self.release = it, release

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self.it)

    def __next__(self) -> dict:
        try:
            return next(self.it)
        except BaseException as e:
            self.release()  # the first batch failed: nobody waits for it any longer
            if not isinstance(e, UserError):
                raise
            plain = raised_in_worker(e)
            if plain is None:
                raise
            log.debug("%s", e)
            error = type(e)(plain)
        # The refusal ends the run: stop the workers now. torch's re-raised copy sits in a reference
        # cycle with the iterator, and a persistent iterator also stays with its DataLoader, so they
        # would live until interpreter exit, be killed there, and print a traceback of their own.
        shutdown = getattr(self.it, "_shutdown_workers", None)  # torch's own teardown (private)
        if shutdown is not None:
            shutdown()
        raise error


def raised_in_worker(e: BaseException) -> str | None:
    """The message a DataLoader worker's exception had, from torch's re-raised copy (None if `e`
    is not such a copy): what follows the last `module.Class: ` of the pasted traceback."""
    msg, name = str(e), f"{type(e).__module__}.{type(e).__qualname__}: "
    if not (msg.startswith("Caught ") and "Original Traceback" in msg and name in msg):
        return None
    return msg[msg.rfind(name) + len(name) :].strip()


def open_split(cfg: DataConfig, storage: Storage, split: str):
    """(source, file list) of one split: the `data.source` node's class, built with the data root's
    storage and the node cache dir, lists it (goodput.data.sources: the source protocol)."""
    source = instantiate(cfg.source, storage=storage, cache_dir=cfg.cache_dir)
    return source, source.open(split, cfg.dataset)


def data_record(storage: Storage, cfg: DataConfig) -> dict:
    """Where a run's data is and how it is listed, for its commit records: scripts/evaluate.py reads
    the val/ (or test/) split of a checkpoint's run from it. A local root is made absolute."""
    root = storage.root if "://" in storage.root else os.path.abspath(storage.root)
    return {"root": root, "dataset": json.loads(json.dumps(dict(cfg.dataset)))}


def make_loader_kwargs(
    num_workers: int, prefetch_factor: int, device: torch.device, first_batch_first: bool = False
) -> dict:
    """DataLoader defaults for remote data: workers kept alive across epochs (re-forking them
    costs seconds per epoch and loses nothing but time), deep prefetch, pinned memory on CUDA.
    `first_batch_first`: the other workers start once the first batch is made (FirstBatchFirst;
    new kwargs for each DataLoader: the flag is the loader's)."""
    kw: dict = {"num_workers": num_workers, "pin_memory": device.type == "cuda"}
    if num_workers > 0:
        kw.update(prefetch_factor=prefetch_factor, persistent_workers=True, worker_init_fn=_init_worker)
        if sys.platform == "linux":
            # Elastic workers come from a forkserver (or spawn), and such a process inherits that as
            # its default start method: each DataLoader worker would be a new interpreter that
            # re-imports torch (seconds of fetch after every restart). Fork, as elsewhere.
            kw["multiprocessing_context"] = "fork"
    if first_batch_first and num_workers > 1:
        gate = FirstBatchFirst(default_collate)
        kw.update(collate_fn=gate, worker_init_fn=functools.partial(_init_worker, first_batch=gate))
    return kw


def die_with_parent(worker_id: int) -> None:
    """A forked DataLoader worker holds copies of its rank's sockets and of the pipe the elastic
    agent watches: while it lives, neither the peers nor the agent see a killed rank die (the
    worker only notices after its 5 s watchdog). Ask the kernel to kill it with its parent."""
    import ctypes
    import os
    import signal

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


class _Parked:
    """A batch sampler with no position yet (ResumableLoader.park): empty until `inner` is set.
    Its first batch comes as `split` chunks, one per worker: they make it together, where one
    worker would make it alone while the others make the next ones (the loader merges them)."""

    inner = None
    split = 1

    def __iter__(self):
        return self._chunked(iter(self.inner)) if self.inner is not None else iter(())

    def _chunked(self, it):
        first = next(it, None)
        if first is None:
            return
        n = len(first)
        yield from (first[i * n // self.split : (i + 1) * n // self.split] for i in range(self.split))
        yield from it

    def __len__(self) -> int:
        return len(self.inner) if self.inner is not None else 0


class ResumableLoader:
    keep_last = False
    """Keep a copy of the newest batch, so that a load of the state one step back delivers it
    again without restarting the workers (an in-process recovery: goodput.run.spares)."""

    def __init__(
        self,
        cfg: DataConfig,
        storage: Storage,
        seed: int,
        global_batch_size: int,
        max_steps: int,
        rank: int,
        world: int,
        device: torch.device,
        augment: AugmentConfig | None = None,
    ):
        self.cfg, self.rank, self.world, self.max_steps = cfg, rank, world, max_steps
        self.source, self.files = open_split(cfg, storage, "train")
        order = self.source.order(self.files, global_batch_size, seed, cfg.prefetch_steps)
        self.order = order.repeated(cfg.repeated_augment)
        dropped = dropped_per_epoch(len(self.files), global_batch_size, world)
        if dropped and rank == 0:
            log.warning("%s", dropped)
        train_tf = augmentation.build(augment, cfg.train_crop_size)[
            0
        ]  # the `augment` node; None = its defaults
        self.dataset = ImageDataset(
            self.source, self.files, cfg.train_crop_size, seed, True, cfg.on_bad_sample, train_tf
        )
        self.device = device
        self.seed = seed
        self.sizes_sha256 = sizes_digest(self.files.sizes)
        self.step = 0  # next step to deliver
        self._chain = OrderHash()
        self._delivered = None  # the newest batch's indices, being gathered from every rank
        self._dl = self._it = None
        self._it_step = 0
        self._parked = None  # a spare's sampler, its position unset (park)
        self._chunks = 1  # the next batch comes in this many chunks (a parked loader's first)
        self._last = self._again = None  # (step, batch): the newest delivery, and one to deliver again
        self.first_delivery: float | None = None  # when the first batch was delivered (time.time())
        self.io = {
            "data/cache_hits": 0,
            "data/cache_misses": 0,
            "data/bytes_fetched": 0,
            "data/bad_samples": 0,
        }

    @property
    def num_classes(self) -> int:
        return len(self.files.classes)

    @property
    def epoch(self) -> int:
        return self.order.epoch_of(self.step)

    # -- iteration ---------------------------------------------------------------------------
    def start_at(self, step: int) -> None:
        """Fork the workers and put the batches from `step` on in flight now, while the rest of a
        (re)start runs (the checkpoint read): a restore that lands on `step` finds the first batch
        made. Changes nothing else: the first `next()` at another step starts over from there."""
        if self._it is None and 0 <= step < self.max_steps:
            self._start(step)

    def park(self) -> None:
        """A spare's loader (goodput.run.spares): fork the workers now, with no position yet; the
        first `start_at` gives them the rank and step. They wait on their queues meanwhile."""
        if self._it is None and self.cfg.num_workers > 0:
            self._parked = _Parked()
            g = torch.Generator().manual_seed(self.seed)
            kw = make_loader_kwargs(self.cfg.num_workers, self.cfg.prefetch_factor, self.device)
            self._dl = QuietWorkersLoader(self.dataset, batch_sampler=self._parked, generator=g, **kw)
            iter(self._dl)  # forks the workers; nothing to fetch

    def _start(self, step: int) -> None:
        sampler = StepBatchSampler(self.order, self.rank, self.world, step, self.max_steps)
        if self._parked is not None:  # the parked workers get their position: no fork
            per_rank = self.order.global_batch_size // self.world
            self._parked.split = self._chunks = max(1, min(self.cfg.num_workers, per_rank))
            self._parked.inner, self._parked = sampler, None
            self._it, self._it_step = self._dl.resume(), step
            self._prefetched_until = step
            self._prefetch(step)
            return
        # A private generator: creating the iterator draws a base seed, and drawing it from the global
        # RNG would shift every later draw of a resumed run (dropout, for one) by one.
        g = torch.Generator().manual_seed(self.seed)
        cfg = self.cfg
        kw = make_loader_kwargs(cfg.num_workers, cfg.prefetch_factor, self.device, first_batch_first=True)
        self._dl = QuietWorkersLoader(self.dataset, batch_sampler=sampler, generator=g, **kw)
        self._it, self._it_step = iter(self._dl), step  # the step the iterator's next batch is for
        self._prefetched_until = step
        self._prefetch(step)

    def _prefetch(self, step: int) -> None:
        # Tell the source which files this rank needs in the next `prefetch_steps` steps, and which
        # files any rank on the node may still read (never evicted). Pure functions of the order.
        horizon = min(step + self.cfg.prefetch_steps, self.max_steps)
        files = self.files.files
        want = []
        for s in range(max(self._prefetched_until, step), horizon):
            want += [files[i] for i in self.order.rank_batch(s, self.rank, self.world)]
        self._prefetched_until = max(self._prefetched_until, horizon)
        protect = {
            files[i] for s in range(max(0, step - 1), horizon) for i in self.order.global_batch(s).tolist()
        }
        self.source.prefetch(want, protect)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.step >= self.max_steps:
            raise StopIteration
        again, self._again = self._again, None
        if again is not None and again[0] == self.step:  # rewound by one step (rewind): the same batch
            batch = again[1]
        else:
            if self._it is not None and self._it_step != self.step:  # started ahead at another step
                self._drop_iterator()
            if self._it is None:
                self._start(self.step)
            batch = next(self._it)
            if self._chunks > 1:  # a parked loader's first batch, made by every worker (_Parked)
                batch = _merged([batch, *(next(self._it) for _ in range(self._chunks - 1))])
                self._chunks = 1
            self._it_step += 1
            if self.keep_last:
                kept = {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
                self._last = (self.step, kept)
            self.io["data/cache_hits"] += int(batch["hit"].sum())
            self.io["data/cache_misses"] += int((1 - batch["hit"]).sum())
            self.io["data/bytes_fetched"] += int(batch["bytes"].sum())
            self.io["data/bad_samples"] += int((1 - batch["ok"]).sum())
        if self.first_delivery is None:
            self.first_delivery = time.time()
        # Count what was delivered: this step is consumed only now, and the hash chain takes the
        # indices the batch carries (gathered from every rank while the step computes).
        self._settle()
        self._delivered = _gather_indices(batch["index"], self.world)
        self.step += 1
        self._prefetch(self.step)
        return batch

    @property
    def chain(self) -> OrderHash:
        """The hash chain over the job's delivered sample indices, up to the newest delivered step."""
        self._settle()
        if self._chain is None:
            raise RuntimeError(
                f"this loader delivered rank {self.rank}'s slices of a world of {self.world} without "
                "that process group: the job's delivered sample order is unknown"
            )
        return self._chain

    def _settle(self) -> None:
        if self._delivered is not None:
            indices, work = self._delivered
            if work is not None:
                work.wait()
            if indices is None or self._chain is None:  # no group to gather from (a loader of one
                self._chain = None  # rank's slices built outside a job, as a test does)
            else:
                self._chain.update(indices)
            self._delivered = None

    def stats(self) -> dict[str, float]:
        return {**self.io, **self.source.stats()}

    def _drop_iterator(self) -> None:
        if self._dl is not None:
            self._dl.stop_workers()
        self._dl = self._it = None

    def close(self) -> None:
        self._drop_iterator()
        self.source.close()

    # -- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "step": self.step,  # epoch and position within it follow from step (GlobalOrder)
            "num_samples": self.order.num_samples,
            "fingerprint": self.files.fingerprint,
            "sizes_sha256": self.sizes_sha256,
            "global_batch_size": self.order.global_batch_size,
            "repeated_augment": self.order.repeats,
            "sample_order_sha256": self.chain.hexdigest,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Continue from a checkpoint's data state. The training listing must be the one it was
        taken on: the same file count, names (the fingerprint) and sizes; each rank checks its own
        listing, and the restore stops every rank when one refuses (CheckpointManager.restore)."""
        n = self.order.num_samples
        changed = (
            f"it had {sd['num_samples']} training files, now {n}" if sd["num_samples"] != n
            else f"the same number of training files ({n}), other file names"
            if sd["fingerprint"] != self.files.fingerprint
            else f"the same {n} training file names, other file sizes: files were replaced in place"
            if sd.get("sizes_sha256", self.sizes_sha256) != self.sizes_sha256  # (older checkpoints: none)
            else None
        )  # fmt: skip
        if changed:
            raise DatasetChangedError(
                f"data.root={self.cfg.root} changed since the checkpoint: {changed}. Resuming would "
                f"train this run on other data than its checkpoints; restore the data, or train on it "
                f"as a new run: run.name=<another name>"
            )
        repeats = sd.get("repeated_augment", 1)  # (older checkpoints: none, 1)
        if (sd["global_batch_size"], sd["seed"], repeats) != (
            self.order.global_batch_size,
            self.seed,
            self.order.repeats,
        ):
            raise IncompatibleCheckpoint(
                f"checkpoint used seed={sd['seed']} global_batch_size={sd['global_batch_size']} "
                f"data.repeated_augment={repeats}, this run seed={self.seed} global_batch_size="
                f"{self.order.global_batch_size} data.repeated_augment={self.order.repeats}: "
                f"the sample order would differ"
            )
        self.step = sd["step"]
        self._chain, self._delivered = OrderHash(sd["sample_order_sha256"]), None
        # one step back, with its batch kept (keep_last: an in-process recovery redoes the step in
        # flight): the iterator stays, and that batch is delivered again
        if self._last is not None and self._last[0] == self.step and self._it_step == self.step + 1:
            self._again = self._last
        # an iterator started ahead (start_at) is kept only if its next batch is this step's
        elif self._it is not None and self._it_step != self.step:
            self._drop_iterator()


def _merged(chunks: list[dict]) -> dict:
    """One batch from consecutive chunks of it: what default_collate would have made of all its
    samples at once (tensors stacked per sample, so concatenated per chunk)."""
    return {k: torch.cat([c[k] for c in chunks]) if torch.is_tensor(v) else [x for c in chunks for x in c[k]]
            for k, v in chunks[0].items()}  # fmt: skip


def _gather_indices(mine: torch.Tensor, world: int):
    """(the global batch's delivered indices in rank order, the pending gather or None). Ranks hold
    equal contiguous slices of the global batch (goodput.data.sampler), so rank order is batch
    order and the chain is the same on every world size. Asynchronous: it completes while the step
    computes (on the CPU side of the default group: gloo)."""
    mine = mine.to(torch.int64).contiguous()
    if world == 1:
        return mine, None
    if not (dist.is_initialized() and dist.get_world_size() == world):
        return None, None  # ResumableLoader.chain then says so when it is read
    out = torch.empty(world * mine.numel(), dtype=torch.int64)
    return out, dist.all_gather_into_tensor(out, mine, async_op=True)


def eval_loader(
    cfg: DataConfig,
    storage: Storage,
    batch_size: int,
    rank: int,
    world: int,
    device,
    augment: AugmentConfig | None = None,
    split: str = "val",
) -> DataLoader:
    """Validation split (or `split`: scripts/evaluate.py --split test), sharded across ranks with
    equal batch counts (padding index -1 is ignored). Training reads train/ and val/ only."""
    source, files = open_split(cfg, storage, split)
    # derived from the same node (one normalization): resize to val_resize_size, crop to val_crop_size
    eval_tf = augmentation.build(augment, cfg.train_crop_size, cfg.val_resize_size, cfg.val_crop_size)[1]
    ds = ImageDataset(source, files, cfg.val_crop_size, 0, False, cfg.on_bad_sample, eval_tf)
    ds.resize_size = cfg.val_resize_size  # the view's resize, for the model record
    return eval_loader_of(ds, cfg, batch_size, rank, world, device)


def eval_loader_of(
    ds: ImageDataset, cfg: DataConfig, batch_size: int, rank: int, world: int, device
) -> DataLoader:
    """The loader of rank `rank`'s share of an evaluation dataset (eval_loader's, or another rank's
    dataset for a spare that took a rank's place: no second listing)."""
    files = ds.files
    per_rank = -(-len(files) // world)
    idx = list(range(rank, len(files), world))
    idx += [-1] * (per_rank - len(idx))
    bs = max(1, batch_size)
    batches = [idx[i : i + bs] for i in range(0, len(idx), bs)]
    kw = make_loader_kwargs(min(cfg.num_workers, 2), cfg.prefetch_factor, device)
    return QuietWorkersLoader(ds, batch_sampler=batches, generator=torch.Generator().manual_seed(0), **kw)
