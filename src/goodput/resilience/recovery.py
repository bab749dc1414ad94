"""Where a restart's time goes: one timestamp per phase, all on one clock (time.time()).

    failure -> detected -> workers_gone -> rendezvous_done -> process_started -> imports_done
            -> pg_ready -> data_listed -> built -> checkpoint_read -> first_step

- `failure`: the kill time the fault injector wrote in its marker; for a kill from outside, the
  crashed attempt's last heartbeat (`failure_source` says which).
- `detected`, `workers_gone`, `rendezvous_done`: the elastic agent's own profiling metrics
  (torch.distributed.elastic.metrics), recorded by `AgentPhases` in the agent's process and read
  back here; absent under an external launcher (torchrun, srun). torch's process context already
  stops the survivors before it reports a failure, so their exit falls in `detected` and
  `workers_gone` (the agent's own stop) is ~0.
- `process_started`: this process's start time from the kernel; the rest are marked by the worker
  (`built`: model, optimizer and checkpoint manager made; `first_step`: the first step after the
  restore is done).

Each phase's duration is the gap to the previous known timestamp, so they sum to
`total_seconds` (failure -> first resumed step) by construction.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
import time

from torch.distributed.elastic import metrics

from goodput.resilience.accounting import process_start, restart_round

log = logging.getLogger(__name__)

PHASES = (
    "failure",
    "detected",
    "workers_gone",
    "rendezvous_done",
    "process_started",
    "imports_done",
    "pg_ready",
    "data_listed",
    "built",
    "checkpoint_read",
    "ready",
    "first_step",
)
AGENT_FILE = "elastic/agent_phases.jsonl"


class AgentPhases(metrics.MetricHandler):
    """In the elastic agent's process: turns the agent's `@prof` metrics into restart timestamps.

    `_stop_workers` ends when the old workers are gone (it began when the failure was detected),
    `_rendezvous` ends when the new round is agreed, `_start_workers` ends when the new processes
    are running; then the round's record is appended to `<run_dir>/elastic/agent_phases.jsonl`."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, AGENT_FILE)
        self.round, self.rec = 0, {}
        self._lock = threading.Lock()

    def install(self) -> None:
        metrics.configure(self, group="torchelastic")

    def emit(self, m) -> None:
        if not m.name.endswith(".duration.ms"):
            return
        now = time.time()
        what = m.name[: -len(".duration.ms")].rsplit(".", 1)[-1]
        with self._lock:
            if what == "_stop_workers":
                self.rec = {"detected": now - m.value / 1000.0, "workers_gone": now}
            elif what == "_rendezvous":
                self.rec["rendezvous_done"] = now
            elif what == "_start_workers":
                self.rec.update(round=self.round, workers_started=now)
                self.round += 1
                try:
                    os.makedirs(os.path.dirname(self.path), exist_ok=True)
                    with open(self.path, "a") as f:
                        f.write(json.dumps(self.rec) + "\n")
                except OSError as e:
                    log.debug("could not record agent phases: %s", e)
                self.rec = {}


def agent_phases(run_dir: str, round_: int) -> dict:
    try:
        with open(os.path.join(run_dir, AGENT_FILE)) as f:
            recs = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return {}
    return next((r for r in reversed(recs) if r.get("round") == round_), {})


def failure_time(fault_markers: dict[str, dict], previous: dict | None) -> tuple[float | None, str]:
    """When the previous attempt died: the newest injected kill after it started, else its last heartbeat."""
    if previous is None:
        return None, "none"
    kills = [m["time"] for m in fault_markers.values() if m.get("time", 0) >= previous["start"]]
    if kills:
        return max(kills), "fault_marker"
    return previous.get("last_seen"), "last_heartbeat"


class Recovery:
    """Marks of one attempt (every rank marks; rank 0's record is the one kept)."""

    def __init__(self):
        self.marks: dict[str, float] = {}
        self.marks["process_started"] = process_start()  # fork or exec, as the kernel recorded it

    def mark(self, phase: str) -> None:
        self.marks.setdefault(phase, time.time())

    def record(self, failure: float | None, source: str, agent: dict) -> dict:
        ts = {**{k: agent[k] for k in ("detected", "workers_gone", "rendezvous_done") if k in agent}}
        ts.update(self.marks)
        if failure is not None:
            ts["failure"] = failure
        known = [p for p in PHASES if p in ts]
        out = {"round": restart_round(), "failure_source": source, "at": {p: round(ts[p], 4) for p in known}}
        # each phase lasts from the previous known mark to its own
        out["seconds"] = {b: round(ts[b] - ts[a], 4) for a, b in zip(known, known[1:])}
        if "failure" in ts and "first_step" in ts:
            out["total_seconds"] = round(ts["first_step"] - ts["failure"], 4)
        return out


def summarize(records: list[dict]) -> dict:
    """Medians per phase and of the total, the p90 of the total, and restart rounds per failure."""
    out: dict = {"restarts": len(records)}
    if not records:
        return out
    from goodput.resilience.spares import PHASES as IN_PROCESS  # an in-process recovery's own phases

    every = dict.fromkeys(PHASES + IN_PROCESS)
    phases = [p for p in every if any(p in r.get("seconds", {}) for r in records)]
    out["median_seconds"] = {
        p: round(statistics.median(r["seconds"][p] for r in records if p in r["seconds"]), 4) for p in phases
    }
    totals = sorted(r["total_seconds"] for r in records if "total_seconds" in r)
    if totals:
        out["total_median_seconds"] = round(statistics.median(totals), 4)
        out["total_p90_seconds"] = round(totals[math.ceil(0.9 * len(totals)) - 1], 4)  # nearest rank
        out["total_max_seconds"] = round(totals[-1], 4)
    rounds = [r["rounds"] for r in records if r.get("rounds") is not None]
    if rounds:
        out["extra_rounds"] = sum(n - 1 for n in rounds)
    return out
