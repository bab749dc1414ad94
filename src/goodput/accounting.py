"""The goodput ledger: where a run's wall time went, across every attempt and restart.

Totals for the surviving lineage (start-up, productive compute, waiting for data, checkpoint stalls,
evaluation) are saved inside each checkpoint, so after a crash they roll back with the model: work
done after the last commit drops out of the totals. The run's first start time is saved too, so
wall time includes every attempt and the gaps between them. What wall time the totals do not cover
is `lost_seconds`: steps redone after a crash, and the time between a crash and the relaunch.

    goodput = productive compute of surviving steps / total wall time
"""

from __future__ import annotations

import json
import time

from goodput.storage import Storage

CATEGORIES = ("startup", "productive", "fetch", "checkpoint", "eval")


class Ledger:
    def __init__(self):
        self.run_start = time.time()
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self.resumed_from: list[int] = []

    def add(self, category: str, seconds: float) -> None:
        self.totals[category] += seconds

    def state_dict(self) -> dict:
        return {
            "run_start": self.run_start,
            "totals": dict(self.totals),
            "resumed_from": list(self.resumed_from),
        }

    def load_state_dict(self, sd: dict) -> None:
        self.run_start = sd["run_start"]
        self.totals = {c: float(sd["totals"].get(c, 0.0)) for c in CATEGORIES}
        self.resumed_from = list(sd["resumed_from"])

    def report(self, restarts: int, now: float | None = None) -> dict:
        wall = (now or time.time()) - self.run_start
        accounted = sum(self.totals.values())
        out = {f"{c}_seconds": round(v, 4) for c, v in self.totals.items()}
        out.update(
            wall_seconds=round(wall, 4),
            lost_seconds=round(max(0.0, wall - accounted), 4),
            goodput=round(self.totals["productive"] / wall, 6) if wall > 0 else 0.0,
            restarts=restarts,
        )
        return out


class Attempts:
    """One small record per start of the run, beside the checkpoints: counts restarts (including
    crashes before the first checkpoint) and tells how far each attempt got (its last heartbeat)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.path = None

    def begin(self, resumed_from: int | None) -> int:
        n = len([k for k in self.storage.ls("attempts") if k.endswith(".json")])
        self.path = f"attempts/{n:04d}.json"
        self.record = {
            "attempt": n,
            "start": time.time(),
            "resumed_from": resumed_from,
            "step": resumed_from or 0,
        }
        self.beat(resumed_from or 0)
        return n

    def beat(self, step: int) -> None:
        if self.path is not None:
            self.record.update(step=step, last_seen=time.time())
            self.storage.write_bytes(self.path, json.dumps(self.record).encode())

    def previous(self) -> list[dict]:
        out = []
        for k in sorted(self.storage.ls("attempts")):
            if k.endswith(".json") and f"attempts/{k}" != self.path:
                try:
                    out.append(json.loads(self.storage.read_bytes(f"attempts/{k}")))
                except (ValueError, FileNotFoundError):
                    pass
        return out
