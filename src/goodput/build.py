"""The components of a worker, each built from its own config node.

Every function here takes the resolved config (a plain dict) and returns one component; `Trainer`
holds what a rank trains with. Nothing here decides *when* anything happens: that is the worker's
(goodput.worker), the loop's (goodput.loop) and the checkpoint manager's job.
"""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import torch
from hydra.utils import instantiate

from goodput.accounting import Attempts, Ledger
from goodput.checkpoint import AppState, CheckpointConfig, CheckpointManager, RNGState
from goodput.data.loader import DataConfig, ResumableLoader, eval_loader
from goodput.fault import Faults
from goodput.parallel import STRATEGIES, set_collective_timeout
from goodput.recovery import Recovery, agent_phases, restart_round
from goodput.recovery import failure_time as recovery_failure_time
from goodput.storage import Storage
from goodput.tracking import Tracker
from goodput.watchdog import Watchdog

log = logging.getLogger("goodput")


def storage(c: dict, root: str) -> Storage:
    """The data root and the checkpoint dir are both opened through the `storage` node."""
    return instantiate(c["storage"])(root)


def checkpoint_manager(c: dict, d=None, fault=None) -> CheckpointManager:
    """The `checkpoint` node's manager and backend. Without `d` (the job process): rank 0 of 1, to
    list and check the run's checkpoints before any worker starts."""
    ck = c["checkpoint"]
    rank, world, local_rank, pg = (d.rank, d.world, d.local_rank, d.ckpt_pg) if d else (0, 1, 0, None)
    return CheckpointManager(
        CheckpointConfig(**ck),
        storage(c, ck["dir"]),
        instantiate(ck["backend"]),
        rank,
        world,
        local_rank,
        pg=pg,
        fault=fault,
        commit_info={"config_hash": c.get("config_hash"), "mlflow_run_id": c.get("mlflow_run_id"),
                     "run": c["run"]["name"]},
    )  # fmt: skip


class Trainer:
    """Everything a rank trains with. Built twice only if a failed restore touched the state."""

    def __init__(self, c: dict, d, recovery: Recovery | None = None):
        self.cfg, self.dist = c, d
        self.recovery = recovery or Recovery()
        seed = c["seed"]
        torch.manual_seed(seed)  # same initial weights on every rank
        np.random.seed(seed % 2**32)
        random.seed(seed)
        dc, tr = c["data"], c["trainer"]
        data_cfg = DataConfig(**dc)
        data_store = storage(c, dc["root"])
        # The loader builds the per-sample pipeline (decode, then the `augment` node's transforms).
        self.loader = ResumableLoader(
            data_cfg, data_store, seed, tr["global_batch_size"], tr["max_steps"], d.rank, d.world, d.device,
            augment=c["augment"],
        )  # fmt: skip
        local_bs = tr["global_batch_size"] // d.world
        self.val_loader = eval_loader(data_cfg, data_store, local_bs, d.rank, d.world, d.device, c["augment"])
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

        self.ckpt = checkpoint_manager(c, d)
        self.ckpt_store = self.ckpt.storage
        f = c["fault"]
        self.faults = Faults(self.ckpt_store, d.rank, f["kill_at_step"], f["kill_during_save"], f["rank"])
        self.faults.arm_hang(
            f["hang_at_step"], f["hang_site"], f["hang_rank"], f["slow_rank"], f["slow_seconds"]
        )
        self.ckpt.fault = self.faults
        if (
            f["hang_at_step"] is not None
        ):  # hang drills inside storage calls: reads of the data, writes of saves
            site = f["hang_site"]
            (data_store if site in ("storage_read", "dataloader") else self.ckpt_store).fault = self.faults
        self.watchdog = Watchdog(tr["hang_timeout_s"], d.init_timeout_s, d.rank, self.ckpt_store)
        self.ckpt.progress = self.watchdog.doing  # a save begun is progress: it gets its own bound
        self.attempts = Attempts(self.ckpt_store)
        ml = c["mlflow"]
        self.tracker = Tracker(
            ml["tracking_uri"],
            c["mlflow_run_id"],
            enabled=d.rank == 0,
            system_metrics_s=ml["system_metrics_interval_s"],
        )
        self.tracker.log_dataset(dc["root"], self.loader.files.fingerprint)

    def attempts_beat(self, step: int) -> None:
        """The loop calls this after every step: the first one after a (re)start ends the recovery."""
        self.watchdog.beat(step)
        if "first_step" not in self.recovery.marks:
            self.recovery.mark("first_step")
            set_collective_timeout(self.cfg["parallel"]["collective_timeout_s"])  # warm-up is over
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
        self.watchdog.stop()
        self.ckpt.close()
        self.loader.close()
