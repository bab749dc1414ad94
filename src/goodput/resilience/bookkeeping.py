"""The run's goodput bookkeeping behind one object: the ledger, this attempt's record, its recovery.

The worker calls `begin` once the restore is done, the loop `add` at every ledger boundary and
`step_done` after every step, rank 0 `summary` at the end. What each part measures:
goodput.resilience.accounting (the ledger, the attempt records), goodput.resilience.recovery (the
phases of a restart). docs/goodput.md.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import torch.distributed as dist

from goodput.resilience.accounting import Attempts, Ledger, Rescues, rescue_seconds, summarize_rescues
from goodput.resilience.recovery import Recovery, agent_phases, failure_time, restart_round, summarize
from goodput.resilience.spares import Recoveries
from goodput.resilience.watchdog import hung_seconds
from goodput.storage.remote import Storage

log = logging.getLogger("goodput")


class Goodput:
    """`ledger` is checkpointed (the Trainer registers it in the AppState as "ledger"); the attempt
    record lives beside the checkpoints in `store`. `faults` gives the fired fault markers (kill
    times, hangs), `tracker` takes tags and the recovery/* metrics, `compile_paid` returns what this
    start paid torch.compile until its first step (None when compile is off)."""

    def __init__(
        self,
        ledger: Ledger,
        store: Storage,
        rank: int,
        world: int,
        run_dir: str,
        tracker,
        faults,
        recovery: Recovery | None = None,
        compile_paid: Callable[[], dict | None] = lambda: None,
    ):
        self.ledger, self.attempts, self.rescues = ledger, Attempts(store), Rescues(store)
        self.rank, self.world, self.run_dir = rank, world, run_dir
        self.tracker, self.faults, self.compile_paid = tracker, faults, compile_paid
        self.recovery = recovery or Recovery()
        self.restarts = 0
        self.spares = False  # parallel.spares is on: `begin` counts the in-process recoveries so far
        self.in_process = 0  # in-process recoveries onto a spare so far, in the whole run (parallel.spares)
        self.after_recovery = None  # called with the step after the first step that follows one
        self._found: tuple = ([], {}, [])  # rank 0: the earlier attempts, fault markers, rescues (`begin`)

    def add(self, category: str, seconds: float) -> None:
        self.ledger.add(category, seconds)

    def begin(self, restored: dict | None, t_start: float) -> int:
        """Record this start (rank 0) and settle the ledger: the wall clock runs from the run's first
        start, and the start-up of every attempt the restored state does not hold (one that crashed
        before it committed) is start-up, not unexplained loss. `restored`: the commit record
        resumed from (None: nothing), `t_start`: when this attempt's start-up began. Every rank
        calls it (rank 0 broadcasts what it read). Returns the number of restarts so far."""
        resumed = restored["step"] if restored else None
        if restored:
            self.ledger.resumed_from.append(restored["step"])
        # (restarts so far, the run's first start, uncounted start-ups, hangs, rescues, in-process recoveries)
        info = [0, t_start, 0.0, 0.0, 0.0, 0]
        kind = restored.get("kind", "regular") if restored else None
        if self.rank == 0:
            # Kept for the recovery record at the first step: what the failed attempt left (its
            # record, its fault marker, its ranks' rescue records) was all written before this start.
            self._found = previous, fired, rescues = (
                self.attempts.previous(), self.faults.fired(), self.rescues.records()
            )  # fmt: skip
            uncounted = sum(a.get("startup", 0.0) for a in previous if a["attempt"] > self.ledger.attempt)
            # the restored ledger lacks the hangs detected after its save, and the rescues since
            hung = hung_seconds(fired, restored.get("time", 0.0) if restored else 0.0)
            rescued = rescue_seconds(rescues, self.ledger.attempt)
            restarts = self.attempts.begin(resumed, start=t_start, resumed_kind=kind)
            if kind == "rescue":  # the regular commit the restart would have used: summary's steps_saved
                self.attempts.record["rescued_over"] = restored.get("regular_step", 0)
            # (one more read of the store on a restart's path: only where there can be any)
            recovered = len(Recoveries(self.attempts.storage).records()) if self.spares else 0
            first_start = min([t_start] + [a["start"] for a in previous])
            info = [restarts, first_start, uncounted, hung, rescued, recovered]
        if self.world > 1:
            dist.broadcast_object_list(info, src=0)
        restarts, first_start, uncounted, hung, rescued, self.in_process = info
        self.restarts = restarts
        self.ledger.add("hung", hung)
        self.ledger.add("rescue", rescued)
        if restarts:
            tags = {"restarts": restarts, f"restart.{restarts}.resumed_from": resumed}
            if kind == "rescue":  # which failure cost one step, and who saved it
                tags[f"restart.{restarts}.rescued_by"] = ",".join(map(str, restored["rescued_by"]))
            self.tracker.set_tags(tags)
        if restored is None:  # nothing restored: wall time still counts from the run's first attempt
            self.ledger.run_start = first_start
        self.ledger.attempt = restarts
        self.ledger.add("startup", uncounted + time.time() - t_start)
        return restarts

    def step_done(self, step: int) -> bool:
        """After every step: the heartbeat (rank 0, async, never blocks). The first step after a
        (re)start ends the recovery: its compile cost and, after a restart, its phase record go to
        the attempt record. Returns whether this was that first step."""
        first = "first_step" not in self.recovery.marks
        if first:
            self.recovery.mark("first_step")
            paid = self.compile_paid() if self.rank == 0 else None
            if paid is not None:  # cold or warm: what this start paid
                self.attempts.record["compile"] = paid
            if self.rank == 0 and self.attempts.record["attempt"] > 0:
                self._record_recovery(step)
        after, self.after_recovery = self.after_recovery, None
        if after is not None:  # the first step after an in-process recovery (goodput.run.spares)
            after(step)
        if self.rank == 0:
            self.attempts.beat_async(step)
        return first or after is not None

    def _record_recovery(self, step: int) -> None:
        """Rank 0, once the first step after a restart is done: the restart's phase record goes to the
        attempt record (the summary gathers them), to MLflow (recovery/*, step = restart number)."""
        try:
            n = self.attempts.record["attempt"]
            previous, fired, rescues = self._found  # read by `begin`: no round trip on the loop's path
            prev = next((a for a in previous if a["attempt"] == n - 1), None)
            failure, source = failure_time(fired, prev)
            rec = self.recovery.record(failure, source, agent_phases(self.run_dir, restart_round()))
            if "compile" in self.attempts.record:  # inside `first_step`, not a phase of its own
                rec["compile_seconds"] = self.attempts.record["compile"]["first_step_seconds"]
            if prev is not None and rec["round"] > 0 and "round" in prev and prev["round"] < rec["round"]:
                rec["rounds"] = rec["round"] - prev["round"]  # > 1: a round was burnt without a failure
            if prev is not None:  # the steps the failed attempt finished that this one redoes
                tried = [r for r in rescues if r["attempt"] == n - 1]
                reached = max([prev["step"]] + [r["reached"] for r in tried])
                rec["lost_steps"] = max(0, reached - (self.attempts.record["resumed_from"] or 0))
                rec["resumed_kind"] = self.attempts.record.get("resumed_kind")
            self.attempts.record["recovery"] = rec
            self.attempts.beat(step)
            metrics = {f"recovery/{k}_seconds": v for k, v in rec["seconds"].items()}
            if "total_seconds" in rec:
                metrics["recovery/total_seconds"] = rec["total_seconds"]
            self.tracker.log(metrics, n)
            log.info("recovery %d: %s", n, json.dumps(rec["seconds"]))
        except Exception as e:  # measuring must never stop training
            log.warning("could not record the recovery phases: %s", e)

    def summary(self, steps: int) -> dict:
        """Rank 0, once training is over (what follows is not counted): the last heartbeat, and
        summary.json's `restarts`, `resumed_from_steps`, `goodput` (the ledger's breakdown),
        `recovery` (every restart's phase record and their medians) and `compile` (per start)."""
        self.attempts.beat(steps)
        recs = sorted(self.attempts.previous() + [self.attempts.record], key=lambda a: a["attempt"])
        per = [{"attempt": a["attempt"], **a["recovery"]} for a in recs if "recovery" in a]
        # in-process recoveries onto a spare (parallel.spares) count as restarts too: each is a
        # failure recovered. An attempt's restart record first, then its in-process ones.
        spared = Recoveries(self.attempts.storage).records()
        per = sorted(per + spared, key=lambda r: (r["attempt"], "n" in r, r.get("n", 0)))
        goodput = self.ledger.report(self.restarts + len(spared), self.attempts.lost_steps(), len(spared))
        return {
            "restarts": self.restarts + len(spared),
            "resumed_from_steps": self.ledger.resumed_from,
            "rescues": summarize_rescues(recs, self.rescues.records()),
            "goodput": goodput,
            "recovery": {
                **summarize(per),
                **({"in_process": len(spared)} if spared else {}),
                "per_restart": per,
            },
            # trainer.compile: what each start paid until its first step (cold or warm cache); [] if off
            "compile": [{"attempt": a["attempt"], **a["compile"]} for a in recs if "compile" in a],
        }
