"""A run: config -> checks -> launch -> (per rank) build, restore, loop, summary.

`prepare()` runs once in the Hydra job (validation, demo data, the MLflow run, "already done?"),
then `goodput.launch` starts the workers, each of which runs `worker()`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from goodput import loop
from goodput.accounting import Attempts, Ledger, plot
from goodput.checkpoint import BACKENDS, AppState, CheckpointConfig, CheckpointManager, RNGState
from goodput.checkpoint.manager import config_hash
from goodput.checkpoint.resume import explicit_checkpoint, resume
from goodput.config import validate
from goodput.data import augment
from goodput.data.loader import DataConfig, ResumableLoader, eval_loader
from goodput.data.shards import ensure_packed, packed_root
from goodput.data.synthetic import COMPLETE, make_dataset, read_record
from goodput.fault import Faults
from goodput.lock import RunLock
from goodput.model import model_sha256
from goodput.parallel import STRATEGIES, init_distributed, shutdown_distributed
from goodput.recovery import Recovery, agent_phases, restart_round, summarize
from goodput.recovery import failure_time as recovery_failure_time
from goodput.signals import PREEMPT_SIGNALS
from goodput.storage import Storage, StorageConfig
from goodput.tracking import Tracker, flatten, source_tags, start_run

log = logging.getLogger("goodput")


class AlreadyDone(Exception):
    pass


def storage_config(c: dict) -> StorageConfig:
    return StorageConfig(**c["storage"])


# -- once per job, before workers --------------------------------------------------------------
def prepare(
    cfg: DictConfig, run_dir: str, multirun_suffix: str | None = None, choices: dict | None = None
) -> tuple[dict, RunLock | None]:
    """Resolve and check the config, take the run lock, create demo data, open the MLflow run.
    Returns the plain resolved config and the lock (held by rank 0's job process)."""
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    if not re.match(r"^[a-z][a-z0-9+.-]*://", str(cfg.paths.root)):
        cfg.paths.root = os.path.abspath(str(cfg.paths.root))  # async daemons and workers need absolute paths
    if multirun_suffix:
        cfg.run.name = f"{cfg.run.name}/{multirun_suffix}"  # each sweep job gets its own checkpoints
    c = OmegaConf.to_container(cfg, resolve=True)
    c["run_dir"] = run_dir
    c["job_start"] = time.time()  # wall time of this launch counts toward the goodput ledger
    validate(c)
    # Under an external launcher (torchrun, srun) every rank runs this; only global rank 0 writes
    # (demo data, overwrite, the MLflow run) and tells the others in worker().
    leader = int(os.environ.get("RANK", "0")) == 0

    if leader:
        ensure_data(c)
    ck = c["checkpoint"]
    store = Storage(ck["dir"], storage_config(c))
    mgr = CheckpointManager(_ckpt_config(c), store, BACKENDS[ck["backend"]](**ck), 0, 1, 0)
    committed = mgr.committed()
    resume = str(c["run"]["resume"])
    lock = None
    if leader:
        lock = RunLock(store, c["run"]["lock_stale_seconds"])
        lock.acquire()
    try:
        _prepare_run(c, store, committed, resume, leader, choices)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return c, lock


def _prepare_run(c: dict, store: Storage, committed: list, resume: str, leader: bool, choices) -> None:
    if resume not in ("auto", "none"):  # fail now, with exit 2, rather than inside the workers
        ck = c["checkpoint"]
        explicit_checkpoint(
            CheckpointManager(_ckpt_config(c), store, BACKENDS[ck["backend"]](**ck), 0, 1, 0), resume
        )
    if leader and resume == "none" and (committed or store.ls("attempts")):
        if not c["run"]["overwrite"]:
            raise FileExistsError(
                f"run '{c['run']['name']}' already has checkpoints in {store.url()}; use run.resume=auto to "
                f"continue it, run.overwrite=true to discard them, or another run.name"
            )
        log.warning("run.overwrite=true: discarding %s", store.url())
        for name in store.ls():
            if name != RunLock.NAME:
                store.rm(name, recursive=True)
        committed = []
    if resume == "auto" and committed and committed[0]["step"] >= c["trainer"]["max_steps"]:
        raise AlreadyDone(
            f"run '{c['run']['name']}' already reached step {committed[0]['step']} "
            f"(trainer.max_steps={c['trainer']['max_steps']}): nothing to do. "
            f"Checkpoint: {store.url(committed[0]['dir'])}"
        )
    previous_run_id = committed[0].get("mlflow_run_id") if committed and resume == "auto" else None
    choices = {k: v for k, v in (choices or {}).items() if not k.startswith("hydra")}
    params = flatten({k: v for k, v in c.items() if k not in ("run_dir", "job_start")})
    params.update({f"choice.{k}": str(v) for k, v in choices.items()})
    c["config_hash"] = config_hash(params)
    c["mlflow_run_id"] = None
    if not leader:
        return
    c["mlflow_run_id"] = start_run(
        c["mlflow"]["tracking_uri"],
        c["mlflow"]["experiment"],
        c["run"]["name"],
        params,
        previous_run_id,
        c["mlflow"]["artifact_location"],
        tags=source_tags(sys.argv[0]),
    )


def ensure_data(c: dict) -> None:
    dc = c["data"]
    if not (dc["backend"] == "shards" and packed_root(dc["root"], storage_config(c)) == dc["root"]):
        _ensure_imagefolder(c)  # (a root that already holds packed shards needs no ImageFolder)
    ensure_packed(dc, storage_config(c))  # data=shards: pack once, before the ranks start


def _ensure_imagefolder(c: dict) -> None:
    root = c["data"]["root"]
    if c["data"]["root"] == c["paths"]["data_dir"]:
        if read_record(root) is not None:
            return
        if os.path.isdir(os.path.join(root, "train")):  # no completion record: a killed generator's
            log.warning("demo data at %s is incomplete (no %s): generating it again", root, COMPLETE)
        ds = c["dataset"]
        log.info("demo data not found: generating it at %s", root)
        t0 = time.time()
        n = make_dataset(
            root, ds["num_classes"], ds["train_per_class"], ds["val_per_class"], ds["image_size"], ds["seed"]
        )
        log.info("wrote %d train / %d val JPEGs in %.1fs", n["train"], n["val"], time.time() - t0)
        return
    store = Storage(root, storage_config(c))
    try:
        present = store.exists("train")
    except Exception as e:
        raise FileNotFoundError(f"data.root {root} is unreachable: {e}") from e
    if not present:
        raise FileNotFoundError(
            f"data.root {root} has no train/ folder. Point data.root at an ImageFolder dataset "
            f"(train/<class>/*.jpg, val/<class>/*.jpg), or create demo data there with "
            f"`python scripts/make_dataset.py --root {root}`"
        )


def _ckpt_config(c: dict) -> CheckpointConfig:
    return CheckpointConfig(**c["checkpoint"])  # every key is there: the schema (goodput.config) says so


# -- per rank ----------------------------------------------------------------------------------
class Trainer:
    """Everything a rank trains with. Built twice only if a failed restore touched the state."""

    def __init__(self, c: dict, d, recovery: Recovery | None = None):
        self.cfg, self.dist = c, d
        self.recovery = recovery or Recovery()
        seed = c["seed"]
        torch.manual_seed(seed)  # same initial weights on every rank
        np.random.seed(seed % 2**32)
        random.seed(seed)
        dc = c["data"]
        data_cfg = DataConfig(**dc)
        train_tf, eval_tf = augment.build(c["augment"], dc["image_size"])
        data_store = Storage(dc["root"], storage_config(c))
        tr = c["trainer"]
        self.loader = ResumableLoader(
            data_cfg, data_store, seed, tr["global_batch_size"], tr["max_steps"], d.rank, d.world, d.device,
            transform=train_tf,
        )  # fmt: skip
        local_bs = tr["global_batch_size"] // d.world
        self.val_loader = eval_loader(data_cfg, data_store, local_bs, d.rank, d.world, d.device, eval_tf)
        if self.val_loader.dataset.files.classes != self.loader.files.classes:
            raise ValueError(
                f"val/ classes {self.val_loader.dataset.files.classes} differ from train/ classes"
            )
        self.recovery.mark("data_listed")

        model = instantiate(c["model"], num_classes=self.loader.num_classes).to(d.device)
        self.model = STRATEGIES[c["parallel"]["strategy"]]().wrap(model, d)
        self.optimizer = instantiate(c["optim"]["optimizer"])(params=self.model.parameters())
        self.scheduler = instantiate(c["optim"]["schedule"])(self.optimizer)
        self.ledger = Ledger()
        self.app = AppState(self.model, self.optimizer, d.rank)
        self.app.register("data", self.loader)
        self.app.register("scheduler", self.scheduler)
        self.app.register("ledger", self.ledger)
        self.app.register("rng", RNGState(seed, d.rank), per_rank=True)

        ck = c["checkpoint"]
        self.ckpt_store = Storage(ck["dir"], storage_config(c))
        self.ckpt = CheckpointManager(
            _ckpt_config(c),
            self.ckpt_store,
            BACKENDS[ck["backend"]](**ck),
            d.rank,
            d.world,
            d.local_rank,
            pg=d.ckpt_pg,
            fault=None,
            commit_info={
                "config_hash": c["config_hash"],
                "mlflow_run_id": c["mlflow_run_id"],
                "run": c["run"]["name"],
            },
        )
        f = c["fault"]
        self.faults = Faults(self.ckpt_store, d.rank, f["kill_at_step"], f["kill_during_save"], f["rank"])
        self.ckpt.fault = self.faults
        self.attempts = Attempts(self.ckpt_store)
        self.tracker = Tracker(c["mlflow"]["tracking_uri"], c["mlflow_run_id"], enabled=d.rank == 0)
        self.tracker.log_dataset(dc["root"], self.loader.files.fingerprint)

    def attempts_beat(self, step: int) -> None:
        if "first_step" not in self.recovery.marks:  # the loop calls this after every step
            self.recovery.mark("first_step")
            if self.dist.rank == 0 and self.attempts.record["attempt"] > 0:
                self.record_recovery(step)
        if self.dist.rank == 0:
            self.attempts.beat_async(step)

    def record_recovery(self, step: int) -> None:
        """Rank 0, once the first step after a restart is done: the restart's phase record goes to the
        attempt record (the summary gathers them), to MLflow (recovery/*, step = restart number)."""
        try:
            n = self.attempts.record["attempt"]
            prev = next((a for a in self.attempts.previous() if a["attempt"] == n - 1), None)
            failure, source = recovery_failure_time(self.faults.fired(), prev)
            rec = self.recovery.record(failure, source, agent_phases(self.cfg["run_dir"], restart_round()))
            if prev is not None and rec["round"] > 0 and "round" in prev and prev["round"] < rec["round"]:
                rec["rounds"] = rec["round"] - prev["round"]  # > 1: a round was burnt without a failure
            self.attempts.record["recovery"] = rec
            self.attempts.beat(step)
            metrics = {f"recovery/{k}_seconds": v for k, v in rec["seconds"].items()}
            if "total_seconds" in rec:
                metrics["recovery/total_seconds"] = rec["total_seconds"]
            self.tracker.log(metrics, n)
            log.info("recovery %d: %s", n, json.dumps(rec["seconds"]))
        except Exception as e:  # measuring must never stop training
            log.warning("could not record the recovery phases: %s", e)

    def close(self) -> None:
        self.ckpt.close()
        self.loader.close()


def worker(c: dict) -> dict | None:
    """One rank of the job. Returns the summary on rank 0."""
    if threading.current_thread() is threading.main_thread():
        for sig in PREEMPT_SIGNALS:  # a worker from the forkserver inherits SIG_IGN (forkserver_init):
            if signal.getsignal(sig) == signal.SIG_IGN:  # until the loop handles them, a stop
                signal.signal(sig, signal.SIG_DFL)  # request ends the process, as it always did
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(name)s] %(message)s", force=True)
    torch.set_num_threads(c["trainer"]["num_threads"])
    if c["trainer"]["deterministic"]:
        torch.use_deterministic_algorithms(True)
    # Start-up counts from the launch (imports, data listing, process groups, restore). After an
    # elastic restart, from this worker's start: the gap since the crash is lost time.
    first = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    t_start = c["job_start"] if first else time.time()
    recovery = Recovery()
    recovery.mark("imports_done")  # this function's module is imported before it is called
    d = init_distributed()
    recovery.mark("pg_ready")
    if d.world > 1:  # external launchers: rank 0's MLflow run and run dir are the job's
        shared = [c["mlflow_run_id"], c["run_dir"]]
        dist.broadcast_object_list(shared, src=0)
        c = {**c, "mlflow_run_id": shared[0], "run_dir": shared[1]}
    if d.rank != 0:  # rank hygiene: warnings and errors only
        logging.getLogger().setLevel(logging.WARNING)
    t, finished = None, False
    try:
        t = Trainer(c, d, recovery)
        recovery.mark("built")
        rec, touched = resume(t.ckpt, t.app, c["run"]["resume"])
        recovery.mark("checkpoint_read")
        if touched:  # a failed load may have written into the live state: rebuild it fresh
            t.close()
            t = Trainer(c, d, recovery)
        resumed = rec["step"] if rec else None
        if rec:
            t.ledger.resumed_from.append(rec["step"])
        info = [0, t_start]  # (restarts so far, when the run first started), rank 0's view
        if d.rank == 0:
            info = [t.attempts.begin(resumed), min([t_start] + [a["start"] for a in t.attempts.previous()])]
        if d.world > 1:
            dist.broadcast_object_list(info, src=0)
        restarts, first_start = info
        f = c["fault"]
        t.faults.arm_random(f["mtbf_seconds"], f["max_kills"], c["seed"], restarts)
        t.faults.arm_chaos(f["chaos_p"], f["chaos_seed"], f["max_kills"], restarts)
        if restarts:
            t.tracker.set_tags({"restarts": restarts, f"restart.{restarts}.resumed_from": resumed})
        if rec is None:  # nothing restored: wall time still counts from the run's first attempt
            t.ledger.run_start = first_start
        t.ledger.add("startup", time.time() - t_start)
        recovery.mark("ready")
        result = loop.train(t)
        digest = model_sha256(t.model)
        summary = None
        if d.rank == 0:
            t.attempts.beat(result["steps"])
            goodput = t.ledger.report(restarts, t.attempts.lost_steps())
            summary = {
                **result,
                "model_sha256": digest,
                "sample_order_sha256": t.loader.chain.hexdigest,
                "restarts": restarts,
                "resumed_from_steps": t.ledger.resumed_from,
                "goodput": goodput,
                "recovery": recovery_summary(t.attempts),
                "mlflow_run_id": c["mlflow_run_id"],
                "checkpoint_dir": t.ckpt_store.url(),
                "last_committed_step": t.ckpt.last_committed_step,
                "world_size": d.world,
                "config": {k: c[k] for k in ("checkpoint", "data", "parallel")},
            }
            write_summary(c["run_dir"], summary)
            t.tracker.log({f"goodput/{k}": v for k, v in goodput.items()}, result["steps"])
            t.tracker.log({"summary/val_accuracy": result["val_accuracy"] or 0.0}, result["steps"])
            t.tracker.artifact(os.path.join(c["run_dir"], "summary.json"))
            plot(goodput, os.path.join(c["run_dir"], "goodput.png"))
            t.tracker.artifact(os.path.join(c["run_dir"], "goodput.png"))
            hydra_dir = os.path.join(c["run_dir"], ".hydra")
            if os.path.isdir(hydra_dir):
                t.tracker.artifacts(hydra_dir, "hydra")
        finished = True
        return summary
    except BaseException as e:
        if os.environ.get("TORCHELASTIC_RUN_ID") and not isinstance(e, KeyboardInterrupt | SystemExit):
            fail_fast(e, t)
        raise
    finally:
        if t is not None:
            t.close()
            t.tracker.close("FINISHED" if finished else "FAILED")
        shutdown_distributed()


def fail_fast(e: BaseException, t: Trainer | None) -> None:
    """A rank that failed under the elastic agent (usually: a peer died in a collective) has one job
    left: exit, because the agent restarts nobody until every rank of the group is gone. Python's
    own teardown (DataLoader workers joined, prefetch threads drained) took 2-2.5 s on 2 cores, and
    waiting for a checkpoint in flight can hang: its commit needs the dead peer (10 s, until the
    SIGTERM grace ran out). A save that did not commit is cleaned up by the next attempt. So: flush
    the MLflow queue (at most 2 s), leave the error file the agent reports (as torch's @record
    would), and exit at once."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    try:
        log.error("rank failed, exiting for a restart: %r", e, exc_info=e)
        if t is not None:
            flush = threading.Thread(target=t.tracker.close, args=("FAILED",), daemon=True)
            flush.start()
            flush.join(timeout=2)
        ErrorHandler().record_exception(e)
    except BaseException as cleanup:
        log.error("while failing: %r", cleanup)
    finally:
        for h in logging.getLogger().handlers:
            h.flush()
        os._exit(1)


def recovery_summary(attempts: Attempts) -> dict:
    """Every restart's phase record (from the attempt records) and their medians."""
    recs = sorted(attempts.previous() + [attempts.record], key=lambda a: a["attempt"])
    per = [{"attempt": a["attempt"], **a["recovery"]} for a in recs if "recovery" in a]
    return {**summarize(per), "per_restart": per}


def write_summary(run_dir: str, summary: dict) -> None:
    os.makedirs(run_dir, exist_ok=True)
    tmp = os.path.join(run_dir, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2, default=str)
    shutil.move(tmp, os.path.join(run_dir, "summary.json"))
