"""Rescue checkpoints: when a peer fails, the ranks that survive write the last finished step.

In a data-parallel job every surviving replica holds the whole training state of the last finished
optimizer step. A regular save needs every rank (its collectives plan and commit it), so a failure
used to cost the work since the last commit, about half the interval. A rescue needs none: each
surviving rank writes its part with DCP's single-process path (`no_dist=True`), and the store
decides who writes what:

- The state is cut into `n_shards` parts, the ranks of one replica group (goodput.parallel:
  `replica_group`): one part under single and ddp (every rank holds all of it), one per rank under
  fsdp, `parallel.shard_size` under hsdp. Shard s is written by the first rank holding it that
  claims it (an exclusive create of `claims/<s>.json`: one writer, no collective); the others exit.
- Each writer saves locally first (the node-local staging dir: a relaunch on this node reads it
  from there), renames its files to `__<s>_<i>.distcp`, uploads them with its DCP metadata
  (`rescue-<s>.metadata`) and a manifest (`ranks/rescue-<s>.json`: sizes and checksums).
- The writer that finds every shard's manifest there claims the commit, merges the shards'
  metadata into one `.metadata` (each read through the checkpoint reader's allow-list) and writes
  COMMIT.json (kind `rescue`, the ranks that wrote it) with an exclusive create.

The result is a step dir like any other (`step-000000073.rescue`): verified byte by byte before a
restore uses it, fenced by config hash and run name, reshared on load, removed once a regular
commit supersedes it. Anything not committed within `checkpoint.rescue_timeout_s` stays
uncommitted and is never loaded: the relaunch uses the newest regular commit.

What makes the written state exact is the Rescue object the loop drives (`boundary`, `updating`):
docs/checkpointing.md, "Rescue checkpoints".
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import threading
import time
from dataclasses import dataclass
from functools import partial

import torch

from goodput.checkpoint.layout import (
    COMMIT,
    RANKS,
    CommitError,
    check_files,
    commit_record,
    is_rescue,
    newest_first,
    parse_step,
    step_dir,
)
from goodput.storage.checksum import CHECKSUM
from goodput.storage.local import atomic_write
from goodput.storage.remote import DIR
from goodput.untrusted import RecordError, field, parse_record

log = logging.getLogger(__name__)

CLAIMS = "claims"
DEFER_S = 0.5  # how long a shard's other holders let its lowest rank claim it first
RECORDS = "rescues"  # beside the checkpoints: one record per rank that tried (goodput.resilience.bookkeeping)
# what a record's outcome can be (docs/goodput.md): the summary counts failures by these names
OUTCOMES = ("committed", "written", "claimed_by_another", "already_committed", "in_update", "nothing_new",
            "timed_out", "failed")  # fmt: skip


@dataclass(frozen=True)
class Writer:
    """What a commit record says wrote the files (layout.commit_record's `backend`)."""

    name: str = "rescue"
    format: str = "dcp"


class Rescue:
    """The loop's side: where the state stands, so a failure can write the last finished step.

    `boundary(step, evaluated, stop_reason)`: the state is whole at the end of `step` (its optimizer
    update, schedule and EMA are done); `evaluated`: and so is its evaluation, if it has one (else a
    rescue says so, and the relaunch evaluates that step first, as the run would have: the same
    metrics, early-stopping counter and best). The run's parts (the loader's position, the schedule,
    the monitors: all but the time ledger) and the model's buffers are noted here, because what
    follows changes them before the next update: the loader delivers the next batch, the forward
    updates BatchNorm statistics, an evaluation the monitors. The random streams need nothing:
    they are reseeded from (seed, rank, step) before every step (checkpoint.state.RNGState.at_step).
    `updating()`: the optimizer update starts, parameters are about to be half-written: no rescue
    until the next boundary. On CUDA it first waits for the step's kernels: the host runs ahead,
    and a dead NCCL peer must be noticed (a gradient all-reduce that never ends) before the update
    is queued, not after.

    On a failure (no collective; bounded by `timeout_s`), this rank writes its shard of the boundary
    state and commits the rescue when every shard is there: `write(why)` from the main thread (its
    loop raised), `request(why)` from another thread (the grace timer, the hang watchdog), which
    hands the rescue to the main thread if that one reaches a step boundary or an update in time
    (it was slow, not stuck: it must not change the state under the writer), else writes it
    itself while the main thread, stuck, cannot. Either returns the outcome, once per process."""

    def __init__(self, enabled: bool, timeout_s: float, store, staging_dir: str, rank: int, world: int,
                 strategy, app, rng, model, info, attempt=lambda: 0):  # fmt: skip
        self.enabled, self.timeout_s = enabled, timeout_s
        self.store, self.staging_dir, self.rank, self.world = store, staging_dir, rank, world
        group = strategy.replica_group(rank, world)
        self.shard, self.n_shards = group.index(rank), len(group)
        # the ranks whose per-rank state this shard's writer writes: every rank at its shard position
        self.speaks_for = [r for r in range(world) if _position(strategy, r, world) == self.shard]
        others = set(app.rank_parts) - {"rng"}
        if others:  # a rescue writes per-rank state for ranks it cannot ask: it must be derivable
            raise ValueError(
                f"per-rank parts {sorted(others)} cannot be rescued (only the RNG state is derived)"
            )
        self.app, self.rng, self.model = app, rng, model
        self.device = next(iter(model.parameters()), torch.empty(0)).device
        self.info, self.attempt = info, attempt  # info(): the commit record's fields (the manager's)
        self.step: int | None = None  # the boundary the state is at (None: inside an update, or not yet)
        self.reached = 0  # the newest step whose update finished
        self.since: int | None = None  # the step this attempt started from: nothing to gain at or before it
        self._parts: dict = {}
        self._evaluated, self._stop_reason, self._time = True, None, 0.0
        self._buffers: dict[str, torch.Tensor] = {}
        self._keys: dict[str, str] | None = None
        self._lock = threading.Lock()  # held while writing: the main thread waits at its next boundary
        self._result: dict | None = None
        self._requested: str | None = None
        self._handed = threading.Event()
        self._asked: float | None = None  # when another thread asked: the bound counts from there

    # -- the loop's side ---------------------------------------------------------------------------
    def boundary(self, step: int, evaluated: bool = True, stop_reason: str | None = None) -> None:
        if not self.enabled:
            return
        with self._lock:
            if self.since is None:
                self.since = step
            self.reached = step
            # (the loader's state settles the delivered batches' hash; the ledger keeps running)
            self._parts = {k: p.state_dict() for k, p in self.app.parts.items() if k != "ledger"}
            with torch.no_grad():
                self._buffers = {key: b.detach().clone() for key, b in self._named_buffers()}
            self._evaluated, self._stop_reason = evaluated, stop_reason
            self._time = time.time()
            self.step = step
        self._safe_point()

    def updating(self) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":  # the gradient sync done (or hung) before the update is queued
            torch.cuda.synchronize(self.device)
        self._safe_point()
        with self._lock:
            self.step = None

    # -- an in-process recovery's side (goodput.run.spares): the same boundary, kept live ---------
    def noted(self) -> tuple[int | None, str | None]:
        """(the step whose boundary the state stands at, None), or (None, why it stands at none):
        what a survivor reports before a spare may take a dead peer's place."""
        with self._lock:
            if not self.enabled:
                return None, "checkpoint.rescue=false: no step boundary is noted"
            if self.step is None:
                return None, "inside an optimizer update"
            if not self._evaluated:
                return None, f"before the evaluation of step {self.step} was done"
            return self.step, None

    def rewind(self) -> None:
        """Put back what the step in flight changed since the boundary: the run's parts (the
        loader's position first) and the model's buffers. The parameters, the optimizer and the
        EMA have not moved: the update had not begun (`noted`)."""
        with self._lock:
            for k, sd in self._parts.items():
                self.app.parts[k].load_state_dict(sd)
            with torch.no_grad():
                for key, b in self._named_buffers():
                    b.copy_(self._buffers[key])

    def _named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """(state-dict key, live buffer) of the model; the key mapping is worked out once."""
        if self._keys is None:
            self._keys = _buffer_keys(self.model)
        return [(self._keys[name], b) for name, b in self.model.named_buffers() if name in self._keys]

    def _safe_point(self) -> None:
        """The main thread, where the state is whole: a rescue another thread asked for is written
        here, then the main thread waits for that thread to end the process."""
        if self._requested is not None and threading.current_thread() is threading.main_thread():
            self.write(self._requested)
            self._handed.set()
            self.park()

    @staticmethod
    def park() -> None:
        """The main thread after writing a rescue another thread asked for: that thread ends the process."""
        threading.Event().wait()

    # -- the failure's side ------------------------------------------------------------------------
    def write(self, why: str, wait_s: float | None = None) -> dict:
        """This rank's part of the boundary state, written once per process (a second caller gets
        the first one's outcome). `wait_s`: how long another thread may wait for the lock."""
        if not self._lock.acquire(timeout=-1 if wait_s is None else max(0.0, wait_s)):
            return self._stuck_inside(why)
        try:
            if self._result is None:
                self._result = self._bounded(why)
            return self._result
        finally:
            self._lock.release()

    def request(self, why: str, handoff_s: float | None = None) -> dict:
        """`write` from a thread that is not the main thread (see the class docstring). `handoff_s`:
        how long the main thread may take to reach a boundary (default: a third of the timeout, at
        most 5 s; 0 when it is known to be stuck, as when the hang watchdog fires)."""
        if threading.current_thread() is threading.main_thread():
            return self.write(why)
        asked = time.monotonic()
        # The main thread holds the lock while it notes a boundary (device work: a clone, an .item()):
        # a device wedged there must not keep the watchdog or the grace timer from ending the process.
        if not self._lock.acquire(timeout=self.timeout_s):
            return self._stuck_inside(why)
        try:
            if self._result is not None or not self.enabled:
                return self._result or {"outcome": "off"}
            self._requested = why
            self._asked = asked
        finally:
            self._lock.release()
        handoff_s = min(5.0, self.timeout_s / 3) if handoff_s is None else handoff_s
        if handoff_s > 0 and self._handed.wait(handoff_s):
            return self._result
        # the main thread is stuck: while this writes, it cannot pass a boundary
        return self.write(why, wait_s=asked + self.timeout_s - time.monotonic())

    def _stuck_inside(self, why: str) -> dict:
        """The main thread did not leave a boundary within the bound: the state it was noting is
        not known to be whole. Nothing is written."""
        log.warning(
            "rescue: rank %d: the main thread stayed inside a step boundary past "
            "checkpoint.rescue_timeout_s=%gs: nothing to rescue", self.rank, self.timeout_s,
        )  # fmt: skip
        out = {"attempt": self.attempt(), "rank": self.rank, "time": time.time(), "reason": why[:500],
               "reached": self.reached, "step": None, "shard": self.shard}  # fmt: skip
        return self._record({**out, "outcome": "timed_out", "seconds": self.timeout_s})

    def _bounded(self, why: str) -> dict:
        t0 = time.monotonic()
        # from the request, not from the end of the hand-over wait: the grace and the bound together
        # are what fits before the agent's SIGKILL (checked at compose time)
        deadline = (self._asked if self._asked is not None else t0) + self.timeout_s
        out = {"attempt": self.attempt(), "rank": self.rank, "time": time.time(), "reason": why[:500],
               "reached": self.reached, "step": self.step, "shard": self.shard}  # fmt: skip
        if not self.enabled or self.since is None:  # off, or failed before training (nothing to save)
            return {**out, "outcome": "off" if not self.enabled else "not_started", "seconds": 0.0}
        if self.step is None:
            log.warning("rescue: rank %d was inside an optimizer update (parameters half-written): "
                        "nothing to rescue", self.rank)  # fmt: skip
            return self._record({**out, "outcome": "in_update", "seconds": 0.0})
        if self.step <= self.since and self._evaluated:
            return self._record({**out, "outcome": "nothing_new", "seconds": 0.0})
        box: dict = {}
        th = threading.Thread(target=self._write, args=(self.step, box, deadline), name="rescue", daemon=True)
        th.start()
        th.join(max(0.0, deadline - time.monotonic()))
        seconds = time.monotonic() - t0
        if th.is_alive() or isinstance(box.get("error"), TimeoutError):
            log.warning("rescue: rank %d did not finish step %d within checkpoint.rescue_timeout_s=%gs: "
                        "it stays uncommitted, the relaunch uses the newest regular commit",
                        self.rank, self.step, self.timeout_s)  # fmt: skip
            return self._record({**out, "outcome": "timed_out", "seconds": seconds})
        if "error" in box:
            log.warning("rescue: rank %d could not write step %d: %r", self.rank, self.step, box["error"])
            error = repr(box["error"])[:500]
            return self._record({**out, "outcome": "failed", "error": error, "seconds": seconds})
        rec = {**out, **box, "seconds": seconds}
        if rec["outcome"] in ("committed", "written"):
            log.warning("rescue: rank %d wrote shard %d/%d of step %d in %.2fs%s (the failure: %s)",
                        self.rank, self.shard, self.n_shards, self.step, seconds,
                        ", and committed it" if rec["outcome"] == "committed" else "", why[:200])  # fmt: skip
        else:
            log.warning("rescue: rank %d: step %d %s", self.rank, self.step, rec["outcome"].replace("_", " "))
        return self._record(rec)

    def _write(self, step: int, box: dict, deadline: float) -> None:
        # `time`: when the state was whole (a regular commit's: when it was saved). The restart adds the
        # stalls detected after it to the ledger, which holds none of them (a hang before this rescue)
        extra = {"time": self._time, **({"evaluate_first": True} if not self._evaluated else {})}
        if self._stop_reason is not None:  # the run stopped at this step (early stopping): it stays stopped
            extra["stop_reason"] = self._stop_reason
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # a new thread's current device is cuda:0
            # the lowest holder first, where it matters: a model with buffers (DDP's are rank 0's)
            defer = DEFER_S if self._buffers and self.rank != self.speaks_for[0] else 0.0
            box.update(write_shard(self.store, self.staging_dir, step, self.shard, self.n_shards,
                                   self.rank, self.world, self.state(step), lambda: {**self.info(), **extra},
                                   deadline, defer, evaluated=self._evaluated))  # fmt: skip
        except BaseException as e:  # CheckpointException derives from BaseException
            box["error"] = e

    def state(self, step: int) -> dict:
        """The state dict at the boundary after `step`, on the host: the model's buffers and the
        run's parts as noted there, this shard's per-rank entries for every rank it speaks for.
        No collective, nothing written into the live state."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        rank_parts = {r: {"rng": self.rng.derived(r, step)} for r in self.speaks_for}
        sd = self.app.state_dict(StateDictOptions(), parts=self._parts, rank_parts=rank_parts)
        sd["model"] = {**sd["model"], **{k: v for k, v in self._buffers.items() if k in sd["model"]}}
        # On CUDA, on a stream of its own: after an NCCL failure the default stream may wait forever
        # behind a collective (and what is queued behind it never runs).
        stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        return _to_host(sd, stream)

    def _record(self, rec: dict) -> dict:
        """What this rank did, beside the checkpoints (the summary's `rescues`, the ledger's
        `rescue` seconds). Bounded: the store may be what failed."""
        path = f"{RECORDS}/attempt{rec['attempt']:04d}-rank{rec['rank']}.json"
        th = threading.Thread(target=_quietly, args=(self.store.write_bytes, path, json.dumps(rec).encode()),
                              daemon=True)  # fmt: skip
        th.start()
        th.join(timeout=5.0)
        return rec


def _buffer_keys(model) -> dict[str, str]:
    """named_buffers name -> state-dict key of the model's buffers: a wrapper's prefix (DDP's
    `module.`, compile's `_orig_mod.`) taken off as get_model_state_dict does."""
    from torch.distributed.checkpoint.state_dict import _get_fqns  # torch's own name mapping

    return {name: fqn for name, _ in model.named_buffers() for fqn in _get_fqns(model, name)}


def _position(strategy, rank: int, world: int) -> int:
    return strategy.replica_group(rank, world).index(rank)


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:
        log.warning("rescue: could not write its record: %r", e)


def _to_host(sd, stream):
    """Tensors (DTensors too: their shard) copied to host memory on `stream` (CUDA; None: the
    tensors are on the CPU already)."""
    if stream is None:
        return sd

    def walk(tree):
        if isinstance(tree, dict):
            return {k: walk(v) for k, v in tree.items()}
        return tree.detach().to("cpu") if torch.is_tensor(tree) and tree.device.type != "cpu" else tree

    with torch.cuda.stream(stream):
        out = walk(sd)
    stream.synchronize()
    return out


# -- the store's side: claims, shards, the commit ----------------------------------------------------
def write_shard(store, staging_dir: str, step: int, shard: int, n_shards: int, rank: int, world: int,
                sd: dict, info, deadline: float = float("inf"), defer_s: float = 0.0,
                evaluated: bool = True) -> dict:  # fmt: skip
    """Write shard `shard` of `n_shards` of the rescue of `step` (no collective), and commit the
    rescue if every shard is there. Returns {"outcome": ...}: `committed`, `written` (another
    rank commits), `claimed_by_another`, `already_committed`. Past `deadline` (time.monotonic) it
    commits nothing: TimeoutError. `defer_s`: wait that long before claiming (a rank that is not
    the lowest holding its shard: under ddp the lowest's BatchNorm statistics are the ones the next
    step would have used, DDP broadcasts rank 0's). `evaluated`: `sd` was noted after the step's
    evaluation (or it has none); the shards of one commit must agree on it."""
    rel = step_dir(step, rescue=True)
    # The survivors' restart waits on this: the store's round trips that do not depend on each
    # other go out together (a 30 ms one on an object store is the cost of the whole call here).
    if any(_together(*(partial(store.exists, f"{d}/{COMMIT}") for d in (step_dir(step), rel)))):
        return {"outcome": "already_committed"}
    time.sleep(defer_s)
    me = json.dumps({"rank": rank, "shard": shard, "pid": os.getpid(), "time": time.time()}).encode()
    claim = f"{rel}/{CLAIMS}/{shard}.json"
    if not store.create_exclusive(claim, me):
        return {"outcome": "claimed_by_another"}
    local = os.path.join(staging_dir, rel)
    try:
        files = _save_locally(sd, local, shard)
        uploaded = dict(zip(files, _together(*(partial(_put, store, local, rel, name) for name in files))))
        manifest = {"files": uploaded, "rank": rank, "shard": shard, "evaluated": evaluated}
        _in_time(deadline)  # a manifest makes the shard count for another rank's commit
        store.write_bytes(f"{rel}/{RANKS}/rescue-{shard}.json", json.dumps(manifest).encode())
    except BaseException:
        # Nothing of this part is published: give the claim back, so that a holder whose failure
        # comes later (a peer of a rank that failed by its own error: its collective fails only
        # once this process exits) can still write it, from its own node's disk.
        try:
            store.rm(claim)
        except Exception as e:
            log.warning("rescue: could not give back the claim %s: %r", claim, e)
        raise
    if n_shards > 1:  # one shard: this rank's, written just now
        present = store.ls(f"{rel}/{RANKS}")
        if not all(f"rescue-{s}.json" in present for s in range(n_shards)):
            return {"outcome": "written"}
    _in_time(deadline)
    if not store.create_exclusive(f"{rel}/{CLAIMS}/commit.json", me):
        return {"outcome": "written"}
    commit(store, local, rel, step, n_shards, world, info(), deadline, own=manifest)
    return {"outcome": "committed"}


def _save_locally(sd: dict, local: str, shard: int) -> list[str]:
    """DCP's single-process save of `sd` into `local`, its files renamed for shard `shard`; returns
    the file names to upload (the data files, then `rescue-<shard>.metadata`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from goodput import logs
    from goodput.checkpoint.backends import load_metadata

    tmp = os.path.join(local, f"shard-{shard}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(local, exist_ok=True)
    # DCP warns that no_dist is meant for one process: here that is the point (no collective)
    with logs.known_warning("torch.distributed is disabled", "torch.distributed.checkpoint"):
        dcp.save(sd, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=True)
    with open(os.path.join(tmp, ".metadata"), "rb") as f:
        md = load_metadata(f.read())
    names = {}
    for info in md.storage_data.values():  # __0_<i>.distcp (rank 0 of one) -> __<shard>_<i>.distcp
        old = str(info.relative_path)
        new = names.setdefault(old, f"__{shard}_{old.split('_', 3)[3]}")
        info.relative_path = new
    for old, new in names.items():
        os.replace(os.path.join(tmp, old), os.path.join(local, new))
    meta = f"rescue-{shard}.metadata"
    atomic_write(os.path.join(local, meta), pickle.dumps(md))
    shutil.rmtree(tmp, ignore_errors=True)
    return sorted(set(names.values())) + [meta]


def _together(*calls) -> list:
    """The results of `calls` (functions of no argument), run at once on daemon threads of their own.
    Not a ThreadPoolExecutor: the interpreter joins its threads at exit, and a store call that hangs
    must not hold the process there (the rescue's deadline gives up on it, as on the rescue's own
    thread). The first error raises."""
    out: list = [None] * len(calls)
    n = len(calls)

    def run(i: int) -> None:
        try:
            out[i] = (True, calls[i]())
        except BaseException as e:  # raised on the waiting thread below
            out[i] = (False, e)

    threads = [threading.Thread(target=run, args=(i,), name="rescue-io", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ok, value in out:
        if not ok:
            raise value
    return [value for _, value in out]


def _put(store, local: str, rel: str, name: str) -> dict:
    t = store.put(os.path.join(local, name), f"{rel}/{name}")
    return {"bytes": t.size, CHECKSUM: t.digest}


def parse_rescue_manifest(data: bytes, shard: int) -> dict:
    """`ranks/rescue-<shard>.json`, checked as untrusted input (RecordError naming the file)."""
    what = f"{RANKS}/rescue-{shard}.json"
    rec = parse_record(data, what)
    field(rec, "rank", int, what, minimum=0)
    if field(rec, "shard", int, what, minimum=0) != shard:
        raise RecordError(f"{what}: 'shard' is {rec['shard']}, the file name says {shard}")
    try:
        rec["files"] = check_files(rec.get("files"))
    except CommitError as e:
        raise RecordError(f"{what}: {e}") from None
    if f"rescue-{shard}.metadata" not in rec["files"]:
        raise RecordError(f"{what}: lists no rescue-{shard}.metadata")
    field(rec, "evaluated", bool, what)
    return rec


def _in_time(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError("checkpoint.rescue_timeout_s passed: committing nothing")


def commit(store, local: str, rel: str, step: int, n_shards: int, world: int, info: dict,
           deadline: float = float("inf"), own: dict | None = None) -> None:  # fmt: skip
    """Merge every shard's metadata into `.metadata` and write COMMIT.json (exclusive). `own`: the
    manifest this rank wrote for its shard, whose files are in `local` (the ones it uploaded, their
    sizes and checksums taken as they streamed out): not read back. The other shards' manifests
    and metadata are read from the store, as untrusted input."""
    from goodput.checkpoint.backends import load_metadata

    files, parts, ranks, evaluated = {}, [], [], []
    for s in range(n_shards):
        mine = own is not None and own["shard"] == s
        data = json.dumps(own).encode() if mine else store.read_bytes(f"{rel}/{RANKS}/rescue-{s}.json")
        m = parse_rescue_manifest(data, s)
        if m["rank"] >= world:
            raise RecordError(f"{RANKS}/rescue-{s}.json: rank {m['rank']} is not below world size {world}")
        ranks.append(m["rank"])
        evaluated.append(m["evaluated"])
        meta = f"rescue-{s}.metadata"
        if mine:
            with open(os.path.join(local, meta), "rb") as f:
                parts.append(load_metadata(f.read()))
        else:
            path = os.path.join(local, f".{meta}.got")
            want = m["files"][meta]
            got = store.get(f"{rel}/{meta}", path, limit=want["bytes"])
            if got.size != want["bytes"] or got.digest != want[CHECKSUM]:
                raise RecordError(f"{store.url(f'{rel}/{meta}')}: differs from {RANKS}/rescue-{s}.json")
            with open(path, "rb") as f:
                parts.append(load_metadata(f.read()))
            os.unlink(path)
        files.update({k: v for k, v in m["files"].items() if k != meta})
    if len(set(evaluated)) > 1:  # a peer failed inside the evaluation's collective: it ended on some ranks
        raise RecordError(
            f"{store.url(rel)}: its shards were noted before and after step {step}'s evaluation "
            f"(evaluated: {evaluated}): their run state differs, committing nothing"
        )
    atomic_write(os.path.join(local, ".metadata"), pickle.dumps(merge_metadata(parts)))
    # DCP's own marker goes after every shard; the search for the newest regular commit beside it
    regular, files[".metadata"] = _together(partial(newest_regular, store, step),
                                            partial(_put, store, local, rel, ".metadata"))  # fmt: skip
    fields = {"kind": "rescue", "rescued_by": sorted(set(ranks)), "regular_step": regular}
    record = commit_record(step, Writer(), world, files, {**info, **fields})
    _in_time(deadline)
    if not store.create_exclusive(f"{rel}/{COMMIT}", record):
        raise FileExistsError(f"{store.url(rel)}: committed by another rank meanwhile")


def newest_regular(store, below: int) -> int:
    """The newest regular commit before step `below` (0: none): what a relaunch would resume from
    without the rescue (summary.json's rescues.steps_saved)."""
    names = [n for n, size in store.ls().items() if size == DIR and parse_step(n) is not None]
    for name in newest_first(n for n in names if not is_rescue(n) and parse_step(n) < below):
        if store.exists(f"{name}/{COMMIT}"):
            return parse_step(name)
    return 0


def merge_metadata(parts: list):
    """One DCP Metadata from the shards' own: each sharded tensor's chunks united (a chunk two shards
    both hold kept once), a whole one (a buffer, the run's JSON parts, which may differ by a few
    bytes between ranks: each keeps its own time ledger) from the first shard; each chunk's
    location from the shard it was taken from. Refuses shards that disagree on a sharded tensor's
    size or dtype, and a tensor whose chunks do not cover it (a missing shard)."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    from goodput.checkpoint.backends import CheckpointLoadError

    tensors: dict = {}
    storage: dict = {}
    planner: dict = {}
    for md in parts:
        for fqn, t in md.state_dict_metadata.items():
            have = tensors.get(fqn)
            if have is None:
                tensors[fqn] = TensorStorageMetadata(t.properties, t.size, list(t.chunks))
                continue
            if _whole(have):  # not sharded (a buffer, the run's JSON parts): the first shard's copy
                continue
            if have.size != t.size or have.properties.dtype != t.properties.dtype:
                raise CheckpointLoadError(f"rescue shards disagree on {fqn}: {have.size} vs {t.size}")
            seen = {(tuple(c.offsets), tuple(c.sizes)) for c in have.chunks}
            have.chunks += [c for c in t.chunks if (tuple(c.offsets), tuple(c.sizes)) not in seen]
        for index, where in (md.storage_data or {}).items():  # in shard order: the first holder's
            storage.setdefault(index, where)
        for k, v in (md.planner_data or {}).items():
            planner.setdefault(k, v)
    for fqn, t in tensors.items():
        covered = sum(_numel(c.sizes) for c in t.chunks)
        if covered != _numel(t.size):
            raise CheckpointLoadError(f"rescue shards cover {covered} of {_numel(t.size)} elements of {fqn}")
    first = parts[0]
    return Metadata(state_dict_metadata=tensors, planner_data=planner, storage_data=storage,
                    storage_meta=first.storage_meta, version=first.version)  # fmt: skip


def _whole(t) -> bool:
    return len(t.chunks) == 1 and tuple(t.chunks[0].sizes) == tuple(t.size)


def _numel(size) -> int:
    n = 1
    for d in size:
        n *= int(d)
    return n


def check_record(data: bytes, what: str) -> dict:
    """A rescue record (Rescue._record), every field the accounting reads checked."""
    rec = parse_record(data, what)
    field(rec, "attempt", int, what, minimum=0)
    field(rec, "rank", int, what, minimum=0)
    field(rec, "time", (int, float), what)
    field(rec, "reached", int, what, minimum=0)
    if field(rec, "step", (int, type(None)), what) is not None:
        field(rec, "step", int, what, minimum=0)
    if field(rec, "outcome", str, what) not in OUTCOMES:
        raise RecordError(f"{what}: outcome {rec['outcome'][:40]!r} is none of {', '.join(OUTCOMES)}")
    field(rec, "seconds", (int, float), what, minimum=0)
    return rec
