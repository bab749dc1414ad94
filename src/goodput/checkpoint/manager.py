"""Checkpoint manager: when to save, stage -> upload -> commit, discovery, retention, resume.

The remote layout is in `layout.py`. Every rank writes its part into node-local `staging_dir` (fast
disk), then uploads it through the shared Storage (where the remote emulation applies), hashing each
file as it streams out; its manifest (`ranks/<r>.json`) records sizes and checksums, and rank 0's
COMMIT.json, written last, collects them. For `dcp_async` the write, the upload and the commit all
run on a background thread; the loop only pays for staging.

Restore verifies every byte before any of it is used: each file's checksum is computed while it
downloads (or, for the node-local copy of the newest save that staging keeps, read back from local
disk) and compared with the commit record. A mismatch anywhere is a collective fallback.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import threading
import time

import torch
import torch.distributed as dist

from goodput.checkpoint.backends import READERS
from goodput.checkpoint.commits import Commits
from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.layout import (
    COMMIT,
    RANKS,
    commit_record,
    manifest,
    parse_manifest,
    parse_step,
    step_dir,
)
from goodput.checkpoint.rescue import Rescue
from goodput.checkpoint.state import AppState
from goodput.errors import IncompatibleCheckpoint
from goodput.monitor import Best
from goodput.resilience.lock import LockLost, check_held
from goodput.resilience.signals import signals_blocked
from goodput.storage.checksum import CHECKSUM, file_digest
from goodput.storage.remote import DIR, FOREIGN, Storage, each
from goodput.untrusted import printable

log = logging.getLogger(__name__)


def _no_phase(what: str):
    return contextlib.nullcontext()


def view(cfg: CheckpointConfig, storage: Storage) -> Commits:
    """The read-only view of `cfg`'s commits in `storage` (checkpoint.dir), verifying against the
    node-local copies in staging_dir where they are: what the job process checks the run with,
    without building a backend or creating the staging dir. Here, not in commits.py: the manager is
    the one component that reads checkpoint.staging_dir (tests/unit/test_keys.py)."""
    return Commits(storage, kept=cfg.staging_dir)


class ChecksumMismatch(OSError):
    """A file whose bytes differ from what its commit recorded."""


class SaveFailed(RuntimeError):
    pass


class CheckpointManager:
    def __init__(
        self,
        cfg: CheckpointConfig,
        storage: Storage,
        backend,
        rank: int,
        world: int,
        local_rank: int,
        pg=None,
        fault=None,
        commit_info: dict | None = None,
        lock_token: str | None = None,
    ):
        self.cfg, self.storage, self.backend = cfg, storage, backend
        self.lock_token = lock_token  # the run lock this job holds: checked before each save and commit
        self.rank, self.world, self.local_rank, self.pg = rank, world, local_rank, pg
        self.fault = fault
        self.phase = _no_phase  # a save is a phase of its own for the hang watchdog (its phase())
        self.commit_info = commit_info or {}
        self._pending = None  # (step, Pending, thread)
        self._saving = False  # inside save()
        self._bg_error: BaseException | None = None
        self._last_save_time = time.monotonic()
        self.last_committed_step: int | None = None
        self._existing: set[str] | None = None  # step dirs on the remote at start (rank 0)
        self._foreign: set[str] = set()  # links and special files there: never written through
        self.remote_check: threading.Thread | None = None  # verifying the remote after a local restore
        self.remote_corrupt: list[str] = []  # what it found
        self.metrics: list[dict] = []  # per-save metrics, drained by the loop
        self.best = Best(cfg.keep_best_by, cfg.keep_best_mode)  # Stateful: registered in the AppState
        self._new_best = False
        self.commits = view(cfg, storage)  # listing and verification: the job process's rules too
        os.makedirs(cfg.staging_dir, exist_ok=True)

    # -- when ------------------------------------------------------------------------------
    def maybe_save(
        self, step: int, app: AppState, last: bool = False, info: dict | None = None
    ) -> float | None:
        """The loop's one call after each step: save when the interval says so, when this step's
        evaluation is a new best (keep_best_by), or when this is the last step of the run or of this
        attempt (the end of training, an agreed stop signal). `info` goes into the commit record.
        Returns the seconds the loop was blocked, or None when there was nothing to save."""
        new_best, self._new_best = self._new_best, False
        # `last` and `new_best` are the same on every rank (metrics are all-reduced): due()'s
        # collective stays matched
        if not (last or new_best or self.due(step)):
            return None
        with signals_blocked():  # the first async save may start DCP's daemon and threads: they
            return self.save(step, app, info)  # inherit the blocked mask (see goodput.resilience.signals)

    def observe(self, metrics: dict, step: int) -> None:
        """An evaluation's metrics (the same on every rank): a new best of keep_best_by is saved
        by the next maybe_save, and protected from retention while it is the best."""
        self._new_best = self.best.observe(metrics, step)

    def due(self, step: int) -> bool:
        """Step-count and wall-clock triggers. The wall clock is rank 0's, broadcast, so all ranks agree."""
        by_steps = bool(self.cfg.every_n_steps) and step % self.cfg.every_n_steps == 0
        by_time = False
        if self.cfg.every_n_minutes:
            elapsed = torch.tensor([time.monotonic() - self._last_save_time], dtype=torch.float64)
            if self.world > 1:
                dist.broadcast(elapsed, src=0)
            by_time = elapsed.item() >= 60 * self.cfg.every_n_minutes
        return by_steps or by_time

    # -- saving -----------------------------------------------------------------------------
    def save(self, step: int, app: AppState, extra: dict | None = None) -> float:
        """Start a checkpoint of `step`; returns the seconds the loop was blocked (waiting for the
        previous upload included): a known long phase, with the watchdog's phase bound."""
        with self.phase(f"checkpoint save of step {step}"):
            self._saving = True
            try:
                return self._save(step, app, extra)
            finally:
                self._saving = False

    def saving(self) -> bool:
        """A save is under way: this rank is inside one, or an async one has not committed yet (its
        commit needs every rank's part: an in-process recovery must not go on past it)."""
        return self._saving or (self._pending is not None and self._pending[2].is_alive())

    def _save(self, step: int, app: AppState, extra: dict | None) -> float:
        t0 = time.perf_counter()
        self._finish_pending()  # one save in flight at most
        self._last_save_time = time.monotonic()
        local = os.path.join(self.cfg.staging_dir, step_dir(step))
        if self.local_rank == 0:  # one per node: a peer's rmtree between another's mkdir and its
            shutil.rmtree(local, ignore_errors=True)  # isdir check fails makedirs (seen on 4 ranks);
            os.makedirs(local, exist_ok=True)  # nobody writes into it before the collective below
        prep_error = None
        if self.rank == 0:
            try:
                self._fence()  # before anything is written: the step dir may be another job's now
                self._set_aside(step)
            except Exception as e:  # keep the ranks in step: fail this save after the collectives
                prep_error = e
        self._site("save")
        # Every rank learns whether rank 0 could prepare the step dir before anyone writes into it
        # (-1: the run lock is another job's, and every rank stops).
        ok = torch.tensor([-1 if isinstance(prep_error, LockLost) else 0 if prep_error else 1])
        if self.world > 1:
            dist.all_reduce(ok, group=self.pg, op=dist.ReduceOp.MIN)
        if ok.item() < 1:
            lost = LockLost("rank 0 found the run lock held by another job: stopping before the next commit")
            other = lost if ok.item() < 0 else RuntimeError("rank 0 could not prepare the step dir")
            return self._failed(step, prep_error or other, 0.0)
        sd = app.state_dict(self.backend.options)
        try:
            pending = self.backend.save(sd, local, self.rank, self.world, self.pg, app.buffer_keys())
        except BaseException as e:  # CheckpointException derives from BaseException
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            return self._failed(step, e, time.perf_counter() - t0)
        info = {**self.fields(app), **(extra or {})}
        if self.best.by is not None and self.best.last is not None and self.best.last[0] == step:
            info["metric"] = {self.best.by: self.best.last[1]}
        meta = {"t0": t0, "step": step}
        if self.backend.is_async:
            th = threading.Thread(
                target=self._background,
                args=(step, pending, local, info, meta),
                name=f"ckpt-{step}",
                daemon=True,
            )
            th.start()
            self._pending = (step, pending, th)
            # On CPU the staging copy is synchronous inside async_save; on CUDA the loop waits
            # for it in wait_for_staging(), right before the optimizer mutates parameters.
            blocking = time.perf_counter() - t0
        else:
            try:
                self._complete(step, pending, local, info, meta)
            except SaveFailed as e:
                return self._failed(step, e, time.perf_counter() - t0)
            blocking = time.perf_counter() - t0
        return blocking

    def fields(self, app: AppState) -> dict:
        """What every commit record of this run says besides its files: the run's fence (config
        hash, run name, identity), the model record, the parts a restore may ask for, the best."""
        info = {**self.commit_info, "time": time.time(), "torch": torch.__version__}
        info["parts"] = sorted(app.parts)  # what a restore may ask for (AppState's optional parts)
        if self.best.by is not None:
            info["best"] = self.best.describe()
        return info

    def _fence(self) -> None:
        """LockLost unless the run lock still names this job (goodput.resilience.lock.check_held):
        a job whose lock was taken over writes no step dir and no commit."""
        if self.lock_token is not None:
            check_held(self.storage, self.lock_token)

    def _fenced_fields(self, app: AppState) -> dict:
        self._fence()
        return self.fields(app)

    def rescuer(self, strategy, app: AppState, rng, model, attempt) -> Rescue:
        """This rank's rescue (goodput.checkpoint.rescue): the same store, staging dir and commit
        fields as a save; `attempt()` numbers its record."""
        info = functools.partial(self._fenced_fields, app)  # read when the rescue commits
        return Rescue(self.cfg.rescue, self.cfg.rescue_timeout_s, self.storage, self.cfg.staging_dir,
                      self.rank, self.world, strategy, app, rng, model, info, attempt)  # fmt: skip

    def drain_metrics(self) -> list[dict]:
        out, self.metrics = self.metrics, []
        return out

    def wait_for_staging(self) -> None:
        if self._pending is not None:
            self._pending[1].staged()

    def _background(self, step, pending, local, info, meta) -> None:
        try:
            self._complete(step, pending, local, info, meta)
        except BaseException as e:  # surfaced on the training thread at the next save/wait
            self._bg_error = (step, e)

    def _complete(self, step, pending, local, info, meta) -> None:
        """Finish writing locally, upload this rank's files, and (rank 0) commit."""
        try:
            pending.result()
            self._site("staged")
            files = self._upload(step, local)
            if self.rank == 0:
                self._commit(step, local, files, info)
                self.last_committed_step = step
                self._retention()
            if self.local_rank == 0:
                self._prune_staging(step)
            total = time.perf_counter() - meta["t0"]
            nbytes = sum(f["bytes"] for f in files.values())
            self.metrics.append({"ckpt/total_seconds": total, "ckpt/bytes": nbytes, "ckpt/step": step})
            log.info(
                "checkpoint step %d %s in %.2fs", step, "committed" if self.rank == 0 else "uploaded", total
            )
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt | SystemExit | LockLost):
                raise
            self._mark_failed(step, e)
            raise SaveFailed(f"checkpoint of step {step} failed: {e!r}") from e

    def _site(self, name: str) -> None:
        if self.fault is not None:
            self.fault.site(name)  # chaos drills may SIGKILL here

    def _set_aside(self, step: int) -> None:
        """Never write into an existing step dir (a re-run after resuming from an older step): a
        half-overwritten dir next to an old COMMIT.json could look complete. Move it aside instead
        of deleting it: it might hold the only copy of something."""
        rel = step_dir(step)
        if self._existing is None:  # one listing per attempt, not a remote round trip per save
            self._listed(self.storage.ls())
        if rel in self._foreign:  # a link would be written through: refuse, touch nothing
            raise SaveFailed(f"{self.storage.url(rel)} is a symbolic link or special file: remove it")
        if rel in self._existing and self.storage.exists(rel):
            self._existing.discard(rel)
            aside = f"{rel}.superseded-{int(time.time())}"
            log.warning("%s exists from an earlier attempt: moving it to %s", self.storage.url(rel), aside)
            self.storage.mv(rel, aside)

    def _put(self, local: str, rel: str, name: str) -> dict:
        t = self.storage.put(os.path.join(local, name), f"{rel}/{name}")  # hashed as it streams
        return {"bytes": t.size, CHECKSUM: t.digest}

    def _upload(self, step: int, local: str) -> dict[str, dict]:
        """Upload this rank's files (DCP's .metadata is rank 0's, at commit) and write its manifest.
        The staged files stay: the newest save's local copy is what a restart on this node reads."""
        rel = step_dir(step)
        files = {}
        for i, name in enumerate(n for n in self.backend.rank_files(local, self.rank) if n != ".metadata"):
            files[name] = self._put(local, rel, name)
            if i == 0 and self.fault is not None:
                self.fault.during_save(step)  # SIGKILL here when fault.kill_during_save says so
            self._site("upload")
        self.storage.write_bytes(f"{rel}/{RANKS}/{self.rank}.json", manifest(files))
        return files

    def _prune_staging(self, step: int) -> None:
        """Drop staged saves older than this one (a restart reads the newest instead of the remote).
        Older saves are finished on every rank of the node: each joins its pending save first."""
        root = self.cfg.staging_dir
        for name in os.listdir(root):
            n = parse_step(name)
            if n is not None and n < step:  # a newer one may already be in progress on a peer
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def _mark_failed(self, step: int, e: BaseException) -> None:
        try:  # lets rank 0 stop waiting for this rank's manifest
            self.storage.write_bytes(f"{step_dir(step)}/ranks/{self.rank}.failed", repr(e).encode())
        except Exception:
            pass

    def _commit(self, step: int, local: str, my_files: dict[str, dict], info: dict) -> None:
        rel = step_dir(step)
        deadline = time.monotonic() + self.cfg.commit_timeout_s
        while True:
            names = self.storage.ls(f"{rel}/{RANKS}")
            failed = [n for n in names if n.endswith(".failed")]
            if failed:
                raise SaveFailed(f"rank(s) {failed} failed to upload step {step}")
            if all(f"{r}.json" in names for r in range(self.world)):  # (exact names: not a temp file)
                break
            if time.monotonic() > deadline:
                raise SaveFailed(f"timed out waiting for all {self.world} ranks to upload step {step}")
            time.sleep(0.05)
        files: dict[str, dict] = {}
        for r in range(self.world):
            files.update(parse_manifest(self.storage.read_bytes(f"{rel}/{RANKS}/{r}.json"), r))
        if ".metadata" in self.backend.rank_files(local, self.rank):
            files[".metadata"] = self._put(local, rel, ".metadata")  # DCP's own marker: after every shard
        self._site("commit")
        self._fence()  # the last look before the commit: the upload may have taken long
        record = commit_record(step, self.backend, self.world, files, info)
        self.storage.write_bytes(f"{rel}/{COMMIT}", record)

    def _failed(self, step: int, e: BaseException, blocking: float) -> float:
        if isinstance(e, LockLost):  # not a failed save: the run is another job's now
            raise e
        log.error("checkpoint of step %d failed: %r; the previous committed checkpoint stays", step, e)
        if self.cfg.on_error == "raise":
            raise SaveFailed(f"checkpoint of step {step} failed: {e!r}") from e
        return blocking

    def _finish_pending(self) -> None:
        if self._pending is not None:
            step, _, th = self._pending
            th.join()
            self._pending = None
        if self._bg_error is not None:
            (step, e), self._bg_error = self._bg_error, None
            self._failed(step, e, 0.0)

    def wait(self) -> None:
        """Block until the in-flight save is uploaded (and committed, on rank 0)."""
        with self.phase("waiting for the last checkpoint upload"):
            self._finish_pending()

    def close(self) -> None:
        self.wait()
        self.backend.close()

    # -- discovery ---------------------------------------------------------------------------
    def committed(self) -> list[dict]:
        """Committed checkpoints, newest first (goodput.checkpoint.commits.Commits.committed); the
        listing also tells `_set_aside` which step dirs exist and which entries are links."""
        listing = self.storage.ls()
        self._listed(listing)
        return self.commits.committed(listing)

    def _listed(self, listing: dict[str, int]) -> None:
        self._existing = {n for n, size in listing.items() if size == DIR}
        self._foreign = {n for n, size in listing.items() if size == FOREIGN}

    def read_commit(self, rel: str) -> dict | None:
        return self.commits.read_commit(rel)

    def verify(self, rec: dict, local: bool = True) -> str | None:
        return self.commits.verify(rec, local)

    def newest_verified(self, committed: list[dict]) -> dict | None:
        return self.commits.newest_verified(committed)

    def clean_incomplete(self) -> None:
        """Rank 0 at start: remove step dirs that never committed (no COMMIT.json at all). A dir whose
        commit exists but fails to load is left alone: it may be someone's only copy."""
        dirs = [n for n, size in self.storage.ls().items() if parse_step(n) is not None and size == DIR]
        for name, done in zip(dirs, each(lambda d: self.storage.exists(f"{d}/{COMMIT}"), dirs)):
            if not done:
                log.info("removing incomplete checkpoint %s", self.storage.url(name))
                self.storage.rm(name, recursive=True)

    def _retention(self) -> None:
        committed = self.committed()  # newest first; only committed ones count
        # The best is kept while it is the best: the one this process knows, and the one the newest
        # commit names (this process's may be newer than any commit yet, in an async save's window).
        best = {self.best.step, (committed[0].get("best") or {}).get("step") if committed else None}
        # A rescue is superseded by a regular commit of its step or a later one (the same state or a
        # newer one, written by every rank): it goes at once, outside keep_last, unless it is the best.
        regular = [r["step"] for r in committed if r.get("kind", "regular") == "regular"]
        for rec in [
            r for r in committed if r.get("kind") == "rescue" and regular and r["step"] <= regular[0]
        ]:
            if rec["step"] in best:
                continue
            log.info("retention: removing %s (a rescue superseded by step %d)", self.storage.url(rec["dir"]),
                     regular[0])  # fmt: skip
            self.storage.rm(rec["dir"], recursive=True)
            committed.remove(rec)
        for rec in committed[max(1, self.cfg.keep_last) :]:
            if rec["step"] == self.last_committed_step or rec["step"] in best:
                continue  # never the one just committed, never the best
            self._site("retention")
            log.info("retention: removing %s", self.storage.url(rec["dir"]))
            self.storage.rm(rec["dir"], recursive=True)

    # -- restore -----------------------------------------------------------------------------
    def _agree(self, ok: bool) -> bool:
        t = torch.tensor([1 if ok else 0])
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _any(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0])
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _restore_dir(self, rec: dict) -> str:
        # Keyed by the commit's identity, not just its step: a re-run of the same step (or a run that
        # was overwritten) must never be served from an older download.
        ident = hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:12]
        return os.path.join(self.cfg.staging_dir, "restore", f"{rec['dir']}-{ident}")

    def _fetch(self, rec: dict) -> str:
        """Put the commit's files in one local dir, every byte verified against the record. One copy
        per node (local rank 0 makes it; the node's other ranks read it). Each file comes from the
        node-local copy of that save when staging still holds it and it verifies, else from the
        remote (the source of truth), hashed as it downloads."""
        local = self._restore_dir(rec)
        marker = os.path.join(local, ".complete")
        err = None
        if self.local_rank == 0:
            try:
                shutil.rmtree(local, ignore_errors=True)
                os.makedirs(local)
                kept = os.path.join(self.cfg.staging_dir, rec["dir"])
                from_remote, served_locally = [], []
                for name, want in rec["files"].items():
                    dst = os.path.join(local, name)
                    why = _link_if_verified(os.path.join(kept, name), dst, want)
                    if why is None:
                        served_locally.append(name)
                        continue
                    from_remote.append(f"{name} ({why})")
                    got = self.storage.get(f"{rec['dir']}/{name}", dst, limit=want["bytes"])
                    if got.size != want["bytes"] or got.digest != want[CHECKSUM]:
                        raise ChecksumMismatch(
                            f"{self.storage.url(rec['dir'] + '/' + name)}: expected {want['bytes']} bytes "
                            f"with {CHECKSUM} {want[CHECKSUM]}, got {got.size} bytes with {got.digest}"
                        )
                n_local = len(rec["files"]) - len(from_remote)
                self._served_locally = (rec["dir"], served_locally)
                if from_remote:
                    log.info(
                        "restore %s: %d file(s) from the node-local copy, %d from the remote: %s",
                        rec["dir"], n_local, len(from_remote), "; ".join(from_remote[:4]),
                    )  # fmt: skip
                else:
                    log.info(
                        "restore %s: all %d files from the node-local copy (verified)", rec["dir"], n_local
                    )
                open(marker, "w").close()
            except Exception as e:
                err = e
        if self.world > 1:
            dist.barrier()
        if not os.path.exists(marker):
            raise RuntimeError(f"fetching {self.storage.url(rec['dir'])} failed: {err!r}")
        return local

    def _check_remote_later(self, rec: dict, names: list[str]) -> None:
        """The node-local copy served these files of `rec`: verify their remote copies in the
        background (the remote is what a new node reads) and name each corrupt one. Report only:
        rewriting a committed step dir would break the rule that nothing writes into one, and the
        next commit supersedes it anyway; the warning says how to repair it by hand."""

        def check():
            for name in names:
                why = self.verify({"dir": rec["dir"], "files": {name: rec["files"][name]}}, local=False)
                if why is not None and not self.storage.exists(f"{rec['dir']}/{COMMIT}"):
                    return  # retention removed the step meanwhile: nothing left to report on
                if why is not None:
                    self.remote_corrupt.append(why)
                    log.warning(
                        "remote copy of the restored checkpoint is bad: %s. This run restored from the "
                        "verified node-local copy; a new node would fall back to an older commit until the "
                        "next one (copy %s over it to repair it now)",
                        why, os.path.join(self.cfg.staging_dir, rec["dir"], name),
                    )  # fmt: skip

        self.remote_check = threading.Thread(target=check, name=f"verify-{rec['dir']}", daemon=True)
        self.remote_check.start()

    def restore(self, app: AppState, candidates: list[dict]) -> tuple[dict | None, list[str]]:
        """Load the first candidate that loads on *every* rank. Returns (record, skipped reasons).

        Collective: all ranks call it with the same candidates and make the same collective calls
        whatever fails where: agree the files are here (every byte verified), agree on the classes,
        build the template (collective under FSDP), agree the files are readable and fit, run the
        collective load, agree it applied. A
        checkpoint that is intact but belongs to another setup (IncompatibleCheckpoint: the dataset
        changed, another seed or global batch) stops every rank: falling back would silently restart."""
        skipped = []

        def fail(rec, err):
            skipped.append(f"{rec['dir']}: {err!r}" if err else f"{rec['dir']}: failed on another rank")

        for rec in candidates:
            err, local = None, None
            reader = READERS[rec["format"]]()
            try:
                local = self._fetch(rec)
            except Exception as e:
                err = e
            if not self._agree(err is None):
                fail(rec, err)
                continue
            # Decided on the commit whose bytes verified (its record is all that says which classes):
            # a junk step dir ahead with an edited class list is skipped above, never blamed on the data.
            other = _other_classes(rec.get("model"), self.commit_info.get("model"))
            if self._any(bool(other)):  # decided together: each rank listed the data itself
                if self.local_rank == 0:
                    shutil.rmtree(local, ignore_errors=True)
                why = other or "the data's classes differ from the checkpoint's on another rank"
                raise IncompatibleCheckpoint(
                    f"{self.storage.url(rec['dir'])} cannot continue this run: {why}"
                )
            template = app.template(reader.options, rec["world_size"], rec.get("parts"))
            try:
                sd = reader.prepare_load(template, local)
            except Exception as e:
                err = e
            if not self._agree(err is None):
                fail(rec, err)
                continue
            try:
                reader.load(sd, local)
                app.apply(sd, reader.options, rec["step"])
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt | SystemExit):
                    raise
                err = e
            if self._any(isinstance(err, IncompatibleCheckpoint)):
                why = err or "refused on another rank (its log says why)"
                raise IncompatibleCheckpoint(
                    f"{self.storage.url(rec['dir'])} cannot continue this run: {why}"
                ) from err
            if self._agree(err is None):
                self.last_committed_step = rec["step"]
                served = getattr(self, "_served_locally", (None, []))
                if self.local_rank == 0 and served[0] == rec["dir"] and served[1]:
                    self._check_remote_later(rec, served[1])
                if self.world > 1:
                    dist.barrier()
                if self.local_rank == 0:  # staging space is small: drop the downloaded copy
                    shutil.rmtree(local, ignore_errors=True)
                return rec, skipped
            fail(rec, err)
        return None, skipped

    def supersede_after(self, step: int) -> None:
        """Rank 0, after resuming from `step`: committed checkpoints above it belong to an abandoned
        lineage (they failed to load, or the user chose an older one). Move them aside, so that
        neither auto-resume nor retention ever confuses them with this run's newer commits."""
        for name, size in self.storage.ls().items():
            n = parse_step(name)
            if n is not None and n > step and size == DIR:
                aside = f"{name}.superseded-{int(time.time())}"
                log.warning(
                    "%s is newer than the resumed step %d: moving it to %s",
                    self.storage.url(name),
                    step,
                    aside,
                )
                self.storage.mv(name, aside)
                if self._existing is not None:
                    self._existing.discard(name)


def _other_classes(saved, current) -> str | None:
    """Why a commit's model record (untrusted: only a list of names is read) does not fit this run's
    classes, or None. Another number of classes failed DCP's plan as a size mismatch, every commit
    alike, and the run started over from step 0; the same number under other names would load and
    train each head row on another label. A record without classes (older commits) is let through."""
    old = saved.get("classes") if isinstance(saved, dict) else None
    new = current.get("classes") if isinstance(current, dict) else None
    if not isinstance(old, list) or not isinstance(new, list) or old == new:
        return None

    def listed(names):
        shown = ", ".join(printable(n) for n in names[:12])  # names from a record: escaped
        return f"{len(names)} ({shown}{', ...' if len(names) > 12 else ''})"

    return (
        f"its model was trained on the classes {listed(old)}, the data has {listed(new)}: the dataset's "
        f"classes changed since the checkpoint. Resuming would fit no head or mislabel it; restore the "
        f"data, or train on it as a new run: another run.name"
    )


def _link_if_verified(path: str, dst: str, want: dict) -> str | None:
    """Hard-link a node-local copy into the restore dir if its size and checksum match the record;
    else say why not (the caller then reads the remote)."""
    if not os.path.exists(path):
        return "no local copy"
    try:
        try:
            os.link(path, dst)  # verify the very bytes that will be read
        except OSError:
            shutil.copyfile(path, dst)
        got = file_digest(dst)
    except OSError as e:
        got = e
    if isinstance(got, OSError) or got.size != want["bytes"] or got.digest != want[CHECKSUM]:
        if os.path.exists(dst):
            os.unlink(dst)
        return "local copy unreadable" if isinstance(got, OSError) else "local copy differs from the commit"
    return None
