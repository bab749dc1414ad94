"""Checkpoint manager: when to save, stage -> upload -> commit, discovery, retention, resume.

Remote layout under `checkpoint.dir` (a path or fsspec URL):
    step-000000120/            one fresh directory per save (DCP's overwrite would open a window
        __0_0.distcp ...        with no .metadata)
        .metadata               DCP's marker, uploaded after every shard
        ranks/<r>.json          rank r's files and sizes, written after its upload finished
        COMMIT.json             ours, written last by rank 0 once every rank's manifest is there
A step directory without a readable COMMIT.json is incomplete and is never loaded.

Every rank writes its part into node-local `staging_dir` (fast disk), then uploads it through the
shared Storage (where the remote emulation applies). For `dcp_async` the write, the upload and the
commit all run on a background thread; the loop only pays for staging.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from goodput.checkpoint.state import AppState
from goodput.storage import Storage

log = logging.getLogger(__name__)

COMMIT = "COMMIT.json"


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def parse_step(name: str) -> int | None:
    if name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None


@dataclass
class CheckpointConfig:
    backend: str
    dir: str
    staging_dir: str
    every_n_steps: int | None
    every_n_minutes: float | None
    keep_last: int
    async_type: str = "thread"
    on_error: str = "raise"  # or "continue": a failed save is logged, training goes on
    commit_timeout_s: float = 1800.0


class SaveFailed(RuntimeError):
    pass


class IncompatibleCheckpoint(RuntimeError):
    """An intact checkpoint that cannot continue this run (the dataset changed, another seed or
    global batch size): an error to show, never a reason to fall back or start fresh."""


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
    ):
        self.cfg, self.storage, self.backend = cfg, storage, backend
        self.rank, self.world, self.local_rank, self.pg = rank, world, local_rank, pg
        self.fault = fault
        self.commit_info = commit_info or {}
        self._pending = None  # (step, Pending, thread)
        self._bg_error: BaseException | None = None
        self._last_save_time = time.monotonic()
        self.last_committed_step: int | None = None
        self._existing: set[str] | None = None  # step dirs on the remote at start (rank 0)
        self.metrics: list[dict] = []  # per-save metrics, drained by the loop
        os.makedirs(cfg.staging_dir, exist_ok=True)

    # -- when ------------------------------------------------------------------------------
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
    def save(self, step: int, app: AppState, extra_commit: dict | None = None) -> float:
        """Start a checkpoint of `step`; returns the seconds the loop was blocked."""
        t0 = time.perf_counter()
        self._finish_pending()  # one save in flight at most
        self._last_save_time = time.monotonic()
        local = os.path.join(self.cfg.staging_dir, step_dir(step))
        shutil.rmtree(local, ignore_errors=True)
        os.makedirs(local, exist_ok=True)
        prep_error = None
        if self.rank == 0:
            try:
                self._set_aside(step)
            except Exception as e:  # keep the ranks in step: fail this save after the collectives
                prep_error = e
        self._site("save")
        # Every rank learns whether rank 0 could prepare the step dir before anyone writes into it.
        ok = torch.tensor([0 if prep_error else 1])
        if self.world > 1:
            dist.all_reduce(ok, group=self.pg, op=dist.ReduceOp.MIN)
        if not ok.item():
            return self._failed(
                step, prep_error or RuntimeError("rank 0 could not prepare the step dir"), 0.0
            )
        sd = app.state_dict(self.backend.options)
        try:
            pending = self.backend.save(sd, local, self.rank, self.world, self.pg)
        except BaseException as e:  # CheckpointException derives from BaseException
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            return self._failed(step, e, time.perf_counter() - t0)
        info = {**self.commit_info, **(extra_commit or {})}
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
        meta["blocking"] = blocking
        return blocking

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
            total = time.perf_counter() - meta["t0"]
            self.metrics.append(
                {"ckpt/total_seconds": total, "ckpt/bytes": sum(files.values()), "ckpt/step": step}
            )
            log.info(
                "checkpoint step %d %s in %.2fs", step, "committed" if self.rank == 0 else "uploaded", total
            )
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            self._mark_failed(step, e)
            raise SaveFailed(f"checkpoint of step {step} failed: {e!r}") from e
        finally:
            if self.rank == 0:  # the others removed their files as they uploaded them
                shutil.rmtree(local, ignore_errors=True)

    def _site(self, name: str) -> None:
        if self.fault is not None:
            self.fault.site(name)  # chaos drills may SIGKILL here

    def _set_aside(self, step: int) -> None:
        """Never write into an existing step dir (a re-run after resuming from an older step): a
        half-overwritten dir next to an old COMMIT.json could look complete. Move it aside instead
        of deleting it: it might hold the only copy of something."""
        rel = step_dir(step)
        if self._existing is None:  # one listing per attempt, not a remote round trip per save
            self._existing = {n for n, size in self.storage.ls().items() if size == -1}
        if rel in self._existing and self.storage.exists(rel):
            self._existing.discard(rel)
            aside = f"{rel}.superseded-{int(time.time())}"
            log.warning("%s exists from an earlier attempt: moving it to %s", self.storage.url(rel), aside)
            self.storage.mv(rel, aside)

    def _upload(self, step: int, local: str) -> dict[str, int]:
        rel = step_dir(step)
        names = self.backend.rank_files(local, self.rank)
        sizes = {}
        for i, name in enumerate(n for n in names if n != ".metadata"):
            sizes[name] = self.storage.put(os.path.join(local, name), f"{rel}/{name}")
            os.remove(os.path.join(local, name))  # staging space is node-local and small
            if i == 0 and self.fault is not None:
                self.fault.during_save(step)  # SIGKILL here when fault.kill_during_save says so
            self._site("upload")
        if ".metadata" in names:
            sizes[".metadata"] = os.path.getsize(os.path.join(local, ".metadata"))
        self.storage.write_bytes(f"{rel}/ranks/{self.rank}.json", json.dumps({"files": sizes}).encode())
        return sizes

    def _mark_failed(self, step: int, e: BaseException) -> None:
        try:  # lets rank 0 stop waiting for this rank's manifest
            self.storage.write_bytes(f"{step_dir(step)}/ranks/{self.rank}.failed", repr(e).encode())
        except Exception:
            pass

    def _commit(self, step: int, local: str, my_files: dict[str, int], info: dict) -> None:
        rel = step_dir(step)
        deadline = time.monotonic() + self.cfg.commit_timeout_s
        while True:
            names = self.storage.ls(f"{rel}/ranks")
            failed = [n for n in names if n.endswith(".failed")]
            if failed:
                raise SaveFailed(f"rank(s) {failed} failed to upload step {step}")
            if sum(n.endswith(".json") for n in names) >= self.world:
                break
            if time.monotonic() > deadline:
                raise SaveFailed(f"timed out waiting for all {self.world} ranks to upload step {step}")
            time.sleep(0.05)
        files: dict[str, int] = {}
        for r in range(self.world):
            files.update(json.loads(self.storage.read_bytes(f"{rel}/ranks/{r}.json"))["files"])
        if ".metadata" in my_files:  # DCP's own completeness marker goes after every shard
            self.storage.put(os.path.join(local, ".metadata"), f"{rel}/.metadata")
        self._site("commit")
        record = {
            "step": step,
            "backend": self.backend.name,
            "world_size": self.world,
            "files": files,
            "bytes": sum(files.values()),
            "time": time.time(),
            "torch": torch.__version__,
            **info,
        }
        self.storage.write_bytes(f"{rel}/{COMMIT}", json.dumps(record, indent=1, sort_keys=True).encode())

    def _failed(self, step: int, e: BaseException, blocking: float) -> float:
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
        self._finish_pending()

    def close(self) -> None:
        self.wait()
        self.backend.close()

    # -- discovery ---------------------------------------------------------------------------
    def committed(self) -> list[dict]:
        """Committed checkpoints, newest first. Cheap checks only: COMMIT.json parses and every
        listed file exists with its size. Loading is the real test (see restore)."""
        out = []
        listing = self.storage.ls()
        self._existing = {n for n, size in listing.items() if size == -1}
        for name, size in sorted(listing.items(), reverse=True):
            step = parse_step(name)
            if step is None or size != -1:
                continue
            rec = self.read_commit(name)
            if rec is not None:
                out.append(rec)
        return out

    def read_commit(self, rel: str) -> dict | None:
        try:
            rec = json.loads(self.storage.read_bytes(f"{rel}/{COMMIT}"))
            present = self.storage.ls(rel)
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError) as e:
            log.warning("skipping %s: unreadable %s (%s)", self.storage.url(rel), COMMIT, e)
            return None
        bad = [f for f, s in rec.get("files", {}).items() if present.get(f) != s]
        if bad:
            log.warning("skipping %s: files missing or of the wrong size: %s", self.storage.url(rel), bad[:5])
            return None
        rec["dir"] = rel
        return rec

    def clean_incomplete(self) -> None:
        """Rank 0 at start: remove step dirs that never committed (no COMMIT.json at all). A dir whose
        commit exists but fails to load is left alone: it may be someone's only copy."""
        for name, size in self.storage.ls().items():
            if parse_step(name) is not None and size == -1 and not self.storage.exists(f"{name}/{COMMIT}"):
                log.info("removing incomplete checkpoint %s", self.storage.url(name))
                self.storage.rm(name, recursive=True)

    def _retention(self) -> None:
        committed = self.committed()  # newest first; only committed ones count
        for rec in committed[max(1, self.cfg.keep_last) :]:
            if rec["step"] == self.last_committed_step:
                continue  # never the one just committed
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

    def _download(self, rec: dict) -> str:
        """One download per node (local rank 0); the other ranks of the node read the same copy."""
        local = self._restore_dir(rec)
        marker = os.path.join(local, ".complete")
        err = None
        if self.local_rank == 0 and not os.path.exists(marker):
            try:
                shutil.rmtree(local, ignore_errors=True)
                for name, size in rec["files"].items():
                    got = self.storage.get(f"{rec['dir']}/{name}", os.path.join(local, name))
                    if got != size:
                        raise OSError(f"{name}: downloaded {got} bytes, the commit says {size}")
                open(marker, "w").close()
            except Exception as e:
                err = e
        if self.world > 1:
            dist.barrier()
        if not os.path.exists(marker):
            raise RuntimeError(f"download of {self.storage.url(rec['dir'])} failed: {err!r}")
        return local

    def restore(self, app: AppState, candidates: list[dict]) -> tuple[dict | None, list[str]]:
        """Load the first candidate that loads on *every* rank. Returns (record, skipped reasons).

        Collective: all ranks call it with the same candidates and make the same collective calls
        whatever fails where: agree the files are here, build the template (collective under FSDP),
        agree the files are readable and fit, run the collective load, agree it applied. A
        checkpoint that is intact but belongs to another setup (IncompatibleCheckpoint: the dataset
        changed, another seed or global batch) stops every rank: falling back would silently restart."""
        skipped = []

        def fail(rec, err):
            skipped.append(f"{rec['dir']}: {err!r}" if err else f"{rec['dir']}: failed on another rank")

        for rec in candidates:
            err, local = None, None
            try:
                local = self._download(rec)
            except Exception as e:
                err = e
            if not self._agree(err is None):
                fail(rec, err)
                continue
            template = app.template(self.backend.options, rec["world_size"])
            try:
                sd = self.backend.prepare_load(template, local)
            except Exception as e:
                err = e
            if not self._agree(err is None):
                fail(rec, err)
                continue
            try:
                self.backend.load(sd, local)
                app.apply(sd, self.backend.options, rec["step"])
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt | SystemExit):
                    raise
                err = e
            if self._any(isinstance(err, IncompatibleCheckpoint)):
                raise IncompatibleCheckpoint(
                    f"{self.storage.url(rec['dir'])} cannot continue this run: {err or 'see rank 0'}"
                ) from err
            if self._agree(err is None):
                self.last_committed_step = rec["step"]
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
            if n is not None and n > step and size == -1:
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


def config_hash(resolved: dict) -> str:
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:16]
