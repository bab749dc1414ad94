"""The goodput ledger: where a run's wall time went, across every attempt and restart.

Totals for the surviving lineage (start-up, productive compute, waiting for data, checkpoint stalls,
evaluation, torch.compile) are saved inside each checkpoint, so after a crash they roll back with the
model: work done after the last commit drops out of the totals. The run's first start time is saved too, so
wall time includes every attempt and the gaps between them. What wall time the totals do not cover
is `lost_seconds`: steps redone after a crash, and the time between a crash and the relaunch.

    goodput = productive compute of surviving steps / total wall time
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable

from goodput.storage.remote import Storage
from goodput.untrusted import RecordError, field, parse_record, set_aside

log = logging.getLogger(__name__)
_ATTEMPT = re.compile(r"([0-9]{4,})\.json")

# What an attempt resumed from: a regular checkpoint, or a rescue checkpoint (the state of the last finished
# step, written by a surviving rank without a collective); None for a first start or an older record.
RESUMED_KINDS = ("regular", "rescue", None)

CATEGORIES = ("startup", "productive", "fetch", "checkpoint", "eval", "compile", "hung", "rescue")
# hung: from a rank's last progress until the hang watchdog ended it (goodput.resilience.watchdog)
# rescue: a failed attempt writing its last finished step (goodput.checkpoint.rescue)


def sync_point(device) -> Callable[[], None]:
    """What the loop calls at a ledger boundary. On CUDA the host runs ahead of the kernels, so a
    clock read right after launching a step would time the launch, not the step (and charge its
    kernels to whatever waits next: the fetch, a checkpoint copy). One synchronize per step, at the
    step's end, makes the split honest; it costs the host's run-ahead into the next `next(loader)`,
    which the prefetching loader keeps to a queue pop. Elsewhere (CPU) a no-op: ops are synchronous."""
    import torch

    if torch.device(device).type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return lambda: None


def restart_round() -> int:
    """The elastic agent's restart round this worker belongs to: 0 for the first start (and outside
    the agent), n after the n-th restart of the worker group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def process_start() -> float:
    """Wall-clock time at which this process started, so start-up includes the interpreter and
    every import (torch alone takes seconds). Worked out once per process, as early as it can be
    (when this module is imported, or at the first call in a child forked after that): it is a
    difference between the wall clock and the kernel's uptime clock, and those two step apart (NTP,
    a VM paused or migrated), so one worked out later strays by every step since."""
    pid = os.getpid()
    if _START[0] != pid:  # a forked child (the forkserver's workers) has its own start
        _START[:] = [pid, _kernel_start()]
    return _START[1]


def _kernel_start() -> float:
    """Linux: the kernel's start time of the process, taken relative to the uptime clock (both in
    10 ms ticks; /proc/stat's boot time is whole seconds). Elsewhere: psutil when installed, else
    the time goodput was first imported."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:
        return _IMPORTED


_IMPORTED = time.time()
_START: list = [None, None]  # [pid, start]
process_start()


class Ledger:
    def __init__(self):
        self.run_start = time.time()
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self.resumed_from: list[int] = []
        self.attempt = (
            -1
        )  # the attempt (goodput.resilience.accounting.Attempts) whose start-up is the newest counted

    def add(self, category: str, seconds: float) -> None:
        self.totals[category] += seconds

    def state_dict(self) -> dict:
        return {
            "run_start": self.run_start,
            "totals": dict(self.totals),
            "resumed_from": list(self.resumed_from),
            "attempt": self.attempt,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.run_start = sd["run_start"]
        self.totals = {c: float(sd["totals"].get(c, 0.0)) for c in CATEGORIES}
        self.resumed_from = list(sd["resumed_from"])
        self.attempt = int(sd.get("attempt", -1))  # (absent in checkpoints of earlier versions)

    def report(
        self, restarts: int, lost_steps: int = 0, in_process: int = 0, now: float | None = None
    ) -> dict:
        wall = (now or time.time()) - self.run_start
        accounted = sum(self.totals.values())
        out = {f"{c}_seconds": round(v, 4) for c, v in self.totals.items()}
        out.update(
            wall_seconds=round(wall, 4),
            lost_seconds=round(max(0.0, wall - accounted), 4),
            goodput=round(self.totals["productive"] / wall, 6) if wall > 0 else 0.0,
            restarts=restarts,
            lost_steps=lost_steps,
        )
        if in_process:  # of the restarts, in-process recoveries onto a spare (parallel.spares)
            out["in_process_recoveries"] = in_process
        return out


def plot(report: dict, path: str) -> None:
    """Stacked bar of where the wall time went (the MLflow artifact `goodput.png`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [(c, report[f"{c}_seconds"]) for c in CATEGORIES] + [("lost", report["lost_seconds"])]
    colors = {"productive": "#2ca02c", "fetch": "#ff7f0e", "checkpoint": "#1f77b4", "startup": "#9467bd",
              "eval": "#8c564b", "compile": "#e377c2", "hung": "#7f7f7f", "rescue": "#17becf",
              "lost": "#d62728"}  # fmt: skip
    fig, ax = plt.subplots(figsize=(7, 1.8))
    left = 0.0
    for name, sec in parts:
        ax.barh([0], [sec], left=left, color=colors[name], label=f"{name} {sec:.1f}s")
        left += sec
    ax.set_yticks([])
    ax.set_xlabel("seconds of wall time")
    ax.set_title(f"goodput {100 * report['goodput']:.1f}%  ({report['restarts']} restarts)")
    ax.legend(ncol=3, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)


class Attempts:
    """One small record per start of the run, beside the checkpoints: counts restarts (including
    crashes before the first checkpoint) and tells how far each attempt got (its last heartbeat)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.path = None
        self._beating = None

    def begin(
        self, resumed_from: int | None, start: float | None = None, *, resumed_kind: str | None = None
    ) -> int:
        """Called once the attempt is ready to train; `start` is when its process started, and
        `startup` (seconds until now) stays in the record should it crash before committing.
        `resumed_kind` (one of RESUMED_KINDS) lets the planner measure how often a restart was rescued."""
        if resumed_kind not in RESUMED_KINDS:
            raise ValueError(f"resumed_kind must be one of {RESUMED_KINDS}, got {resumed_kind!r}")
        # Next after the highest number ever used (a record moved aside keeps its number taken).
        used = [int(m.group(1)) for k in self.storage.ls("attempts") if (m := _ATTEMPT.match(k))]
        n = max(used, default=-1) + 1
        self.path = f"attempts/{n:04d}.json"
        now = time.time()
        self.record = {
            "attempt": n,
            "start": start or now,
            "startup": now - (start or now),
            "resumed_from": resumed_from,
            "resumed_kind": resumed_kind,
            "step": resumed_from or 0,
            "round": restart_round(),
        }
        self.beat(resumed_from or 0)
        return n

    def beat(self, step: int) -> None:
        if self.path is not None:
            self.record.update(step=step, last_seen=time.time())
            self.storage.write_bytes(self.path, json.dumps(self.record).encode())

    def beat_async(self, step: int) -> None:
        """A heartbeat that never blocks the loop: skipped while the previous one is still writing."""
        if self._beating is not None and self._beating.is_alive():
            return
        self._beating = threading.Thread(target=self._beat_quietly, args=(step,), daemon=True)
        self._beating.start()

    def _beat_quietly(self, step: int) -> None:
        try:
            self.beat(step)
        except Exception as e:
            log.debug("heartbeat failed: %s", e)

    def lost_steps(self) -> int:
        """Steps done by crashed attempts after the checkpoint their successor resumed from."""
        recs = sorted(self.previous() + [self.record], key=lambda r: r["attempt"])
        return sum(max(0, a["step"] - (b["resumed_from"] or 0)) for a, b in zip(recs, recs[1:]))

    def previous(self) -> list[dict]:
        """The records of earlier attempts, each checked as untrusted input; a malformed one (a crash
        mid-write on a store without atomic writes, a hand edit) is moved aside with a warning:
        it drops out of the restart accounting instead of crashing every relaunch."""
        names = [
            (k, m) for k, size in sorted(self.storage.ls("attempts").items())
            if (m := _ATTEMPT.fullmatch(k)) and size >= 0 and f"attempts/{k}" != self.path
        ]  # fmt: skip
        out = []
        for (k, m), data in zip(names, self.storage.read_each(f"attempts/{k}" for k, _ in names)):
            try:
                if data is not None:  # (None: gone since the listing)
                    out.append(check_attempt(data, k, int(m.group(1))))
            except RecordError as e:
                set_aside(self.storage, f"attempts/{k}", e)
        return out


def check_attempt(data: bytes, name: str, number: int) -> dict:
    """One attempt record, every field the accounting reads checked (RecordError naming the file)."""
    what = f"attempts/{name}"
    rec = parse_record(data, what)
    if field(rec, "attempt", int, what, minimum=0) != number:
        raise RecordError(f"{what}: 'attempt' is {rec['attempt']}, the file name says {number}")
    field(rec, "start", (int, float), what)
    field(rec, "startup", (int, float), what, default=0.0, minimum=0)
    field(rec, "step", int, what, minimum=0)
    field(rec, "round", int, what, default=0, minimum=0)
    if field(rec, "resumed_from", (int, type(None)), what) is not None:
        field(rec, "resumed_from", int, what, minimum=0)
    field(rec, "last_seen", (int, float), what, default=0.0)
    # read by goodput.calculator.advise (the measured rescue probability); absent in older records
    if field(rec, "resumed_kind", (str, type(None)), what, default=None) not in RESUMED_KINDS:
        raise RecordError(
            f"{what}: 'resumed_kind' is {rec['resumed_kind']!r}, expected 'regular', 'rescue' or null"
        )
    field(rec, "rescued_over", int, what, default=0, minimum=0)  # summarize_rescues: steps saved
    recovery = field(rec, "recovery", dict, what, default=None)
    if recovery is not None:  # read by goodput.resilience.recovery.summarize, copied to summary.json
        where = f"{what} recovery"
        _numbers(field(recovery, "seconds", dict, where, default={}), f"{where} seconds")
        _numbers(field(recovery, "at", dict, where, default={}), f"{where} at")
        field(recovery, "total_seconds", (int, float), where, default=0.0)
        field(recovery, "compile_seconds", (int, float), where, default=0.0)
        field(recovery, "failure_source", str, where, default="")
        field(recovery, "rounds", int, where, default=1, minimum=1)
        field(recovery, "round", int, where, default=0, minimum=0)
        field(recovery, "lost_steps", int, where, default=0, minimum=0)
        if field(recovery, "resumed_kind", (str, type(None)), where, default=None) not in RESUMED_KINDS:
            raise RecordError(f"{where}: 'resumed_kind' is {recovery['resumed_kind']!r}")
        _no_attempt(recovery, where)
    paid = field(rec, "compile", dict, what, default=None)
    if paid is not None:  # goodput.run.compiler.CompileClock.paid: summary.json's `compile`
        where = f"{what} compile"
        field(paid, "first_step_seconds", (int, float), where, minimum=0)
        field(paid, "cache_source", (str, type(None)), where, default=None)
        for key in set(paid) - {"first_step_seconds", "cache_source"}:  # artifacts loaded, cache hits
            field(paid, key, int, where, minimum=0)
        _no_attempt(paid, where)
    return rec


def _numbers(values: dict, where: str) -> None:
    for k in values:
        field(values, k, (int, float), where)


def _no_attempt(part: dict, where: str) -> None:
    if "attempt" in part:  # the summary puts the record's own number first: this would overwrite it
        raise RecordError(f"{where}: has an 'attempt' of its own")


_RESCUE = re.compile(r"attempt([0-9]{4,})-rank([0-9]+)\.json")


class Rescues:
    """The rescue records beside the checkpoints (`rescues/attempt<NNNN>-rank<r>.json`, one per rank
    that tried: goodput.checkpoint.rescue.Rescue), each checked as untrusted input; a malformed one
    is moved aside with a warning naming it."""

    def __init__(self, storage: Storage):
        self.storage = storage

    def records(self) -> list[dict]:
        from goodput.checkpoint.rescue import RECORDS, check_record

        names = [
            (k, m) for k, size in sorted(self.storage.ls(RECORDS).items())
            if (m := _RESCUE.fullmatch(k)) and size >= 0
        ]  # fmt: skip
        out = []
        for (k, m), data in zip(names, self.storage.read_each(f"{RECORDS}/{k}" for k, _ in names)):
            if data is None:  # gone since the listing
                continue
            try:
                rec = check_record(data, f"{RECORDS}/{k}")
                if (rec["attempt"], rec["rank"]) != (int(m.group(1)), int(m.group(2))):
                    raise RecordError(f"{RECORDS}/{k}: attempt and rank differ from the file name")
                out.append(rec)
            except RecordError as e:
                set_aside(self.storage, f"{RECORDS}/{k}", e)
        return out


def rescue_seconds(records: list[dict], since_attempt: int) -> float:
    """Seconds the failed attempts from `since_attempt` on spent rescuing (their ranks rescue at
    once: the longest per attempt), which the restored ledger does not hold."""
    per: dict[int, float] = {}
    for r in records:
        if r["attempt"] >= since_attempt:
            per[r["attempt"]] = max(per.get(r["attempt"], 0.0), float(r["seconds"]))
    return sum(per.values())


def summarize_rescues(attempts: list[dict], records: list[dict]) -> dict:
    """summary.json's `rescues`: `count` restarts that resumed from a rescue, `steps_saved` (each
    one's step minus the regular commit the restart would have used instead), `failures` failed
    attempts whose rescue was tried and did not commit, `outcomes` per failed attempt."""
    # one rescue may be resumed twice (the restart after it failed before any commit): counted once
    resumed = {a["resumed_from"]: a for a in attempts if a.get("resumed_kind") == "rescue"}
    outcomes: dict[int, list[str]] = {}
    for r in records:
        outcomes.setdefault(r["attempt"], []).append(r["outcome"])
    tried, landed = ("timed_out", "failed", "written"), ("committed", "already_committed")
    # a commit that landed after its writer had given up (its record says timed_out) and was resumed
    used = {r["attempt"] for r in records if r.get("step") is not None and r["step"] in resumed}
    failures = [
        n for n, o in outcomes.items()
        if any(x in tried for x in o) and not any(x in landed for x in o) and n not in used
    ]  # fmt: skip
    return {
        "count": len(resumed),
        "steps_saved": sum(max(0, step - a.get("rescued_over", 0)) for step, a in resumed.items()),
        "failures": len(failures),
        "seconds": round(sum(float(r["seconds"]) for r in records), 4),
        "outcomes": {str(n): sorted(set(o)) for n, o in sorted(outcomes.items())},
    }
