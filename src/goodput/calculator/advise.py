"""What a finished run measured, for `advise`: its save stall, commit delay, restart cost, step time
and how often a restart resumed from a rescue checkpoint (or a spare took the dead rank's place)."""

from __future__ import annotations

import os

from goodput.calculator import InputError


def _is_dir(run: str) -> bool:
    return "://" in run or os.path.isdir(run)


def run_id(run: str) -> str:
    """A checkpoint dir's newest COMMIT.json names the MLflow run; anything else is taken as a run id."""
    if _is_dir(run):
        from goodput.checkpoint.commits import Commits
        from goodput.storage.remote import Storage

        for rec in Commits(Storage(run)).committed():  # newest first, by the job's own rules
            rid = rec.get("mlflow_run_id")
            if isinstance(rid, str) and rid:
                return rid
        raise InputError("run", f"no committed checkpoint with an MLflow run id in {run}")
    return run


def attempts(run: str) -> list[dict]:
    """The per-attempt heartbeat records beside a run's checkpoints (none for a bare run id)."""
    if not _is_dir(run):
        return []
    from goodput.resilience.accounting import _ATTEMPT, check_attempt
    from goodput.storage.remote import Storage

    store, out = Storage(run), []
    for name in sorted(store.ls("attempts")):
        if (m := _ATTEMPT.fullmatch(name)) is None:
            continue
        try:
            out.append(check_attempt(store.read_bytes(f"attempts/{name}"), name, int(m.group(1))))
        except (FileNotFoundError, ValueError):  # RecordError: the trainer moves it aside on its next start
            continue
    return sorted(out, key=lambda r: r["attempt"])


def in_process(run: str) -> list[dict]:
    """The in-process recoveries onto a spare beside a run's checkpoints (parallel.spares; none for a
    bare run id), each checked; a malformed one is left out (the trainer moves it aside)."""
    if not _is_dir(run):
        return []
    from goodput.resilience.spares import _RECORD, RECORDS, check_record
    from goodput.storage.remote import Storage
    from goodput.untrusted import RecordError

    store, out = Storage(run), []
    for name in sorted(store.ls(RECORDS)):
        if _RECORD.fullmatch(name) is None:
            continue
        try:
            out.append(check_record(store.read_bytes(f"{RECORDS}/{name}"), name))
        except (FileNotFoundError, RecordError):
            continue
    return out


def restart_cost(
    metrics: dict[str, float], steps: int, records: list[dict] = (), spared: list[dict] = ()
) -> dict[str, float | str]:
    """Seconds from a failure until training resumes, and where the number comes from.

    From the ledger (`goodput/*` metrics): with restarts, (lost_seconds - lost_steps x mean productive
    step seconds) / restarts, the part of the lost time that is not redone steps; without restarts,
    start-up seconds per attempt (a floor: the crash-to-relaunch gap is unknown). The ledger's lost
    time also holds whatever the loop did outside its categories (logging, heartbeats), and start-up
    of the resumed attempt is booked as start-up, so both are estimates. Time a hung rank spent until
    the watchdog ended it (`goodput/hung_seconds`: the measured detection time) counts in the restart
    cost: it is lost to the failure as much as the restart itself. When the attempt records are
    at hand (RUN given as a checkpoint dir), the restart cost is measured directly instead: from the
    crashed attempt's last heartbeat to the moment the next attempt was ready to train (after its restore),
    and for each in-process recovery onto a spare (`spared`: parallel.spares) its record's failure to
    first step. The ledger's restarts count both kinds.
    """
    restarts = int(metrics.get("goodput/restarts", 0))
    hung = metrics.get("goodput/hung_seconds", 0.0)
    out: dict[str, float | str] = {"restarts": restarts, "hung_seconds": hung}
    if restarts > 0 and steps > 0:
        step_s = metrics.get("goodput/productive_seconds", 0.0) / steps
        redone = metrics.get("goodput/lost_steps", 0.0) * step_s
        # A hang's detection (the watchdog's wait, booked as `hung`) is part of what a restart costs.
        ledger = (max(0.0, metrics.get("goodput/lost_seconds", 0.0) - redone) + hung) / restarts
        source = (
            "ledger: (lost_seconds - lost_steps x mean productive step seconds + hung_seconds) / restarts"
        )
    else:
        ledger = metrics.get("goodput/startup_seconds", 0.0) / (1 + restarts)
        source = "ledger: start-up seconds per attempt (no restarts: the crash-to-relaunch gap is missing)"
    out["restart_seconds_ledger"] = ledger
    # `start` is when the attempt's process started, `startup` how long it took to be ready to train
    gaps = [
        b["start"] + b.get("startup", 0.0) - a["last_seen"]
        for a, b in zip(records, records[1:])
        if "last_seen" in a
    ]
    spare_gaps = [r["total_seconds"] for r in spared if r.get("total_seconds")]
    if gaps or spare_gaps:
        out["restart_seconds_attempts"] = out["restart_seconds"] = sum(gaps + spare_gaps) / len(
            gaps + spare_gaps
        )
        out["restart_source"] = f"attempt records: last heartbeat to the next attempt's start ({len(gaps)})"
        if spare_gaps:
            out["restart_source"] += (
                f", in-process recoveries onto a spare: failure to first step ({len(spare_gaps)})"
            )
    else:
        out.update(restart_seconds=ledger, restart_source=source)
    return out


def rescued(run: str, records: list[dict], spared: list[dict] = ()) -> dict[str, float | int | str]:
    """The share of restarts that resumed from a rescue checkpoint, from the attempt records'
    `resumed_kind`: restarts are the attempts after the first (number 0: a record moved aside keeps its
    number taken, so the count cannot shift). A restart saying nothing (an older record, or one with no
    checkpoint to resume) counts as not rescued. An in-process recovery onto a spare (`spared`) loses
    the step in flight as a rescue does: it counts as one. No records or no restarts: 0, and the
    source says so."""
    restarts = [r for r in records if r["attempt"] > 0]
    n = sum(r.get("resumed_kind") == "rescue" for r in restarts)
    failures = len(restarts) + len(spared)
    if not _is_dir(run):
        source = "no attempt records (RUN is a run id, not its checkpoint dir): 0 assumed"
    elif not failures:
        source = "attempt records: no restarts, 0 assumed"
    else:
        source = f"attempt records: {n} of {len(restarts)} restarts resumed from a rescue checkpoint"
        if spared:
            source += f", and {len(spared)} in-process recoveries onto a spare lost only the step in flight"
    p = (n + len(spared)) / failures if failures else 0.0
    return {"rescue_probability": p, "rescue_restarts": failures, "rescue_source": source}


def measured(run: str, tracking_uri: str) -> dict[str, float | str]:
    """The run's median save stall, its median delay from stall end to commit, its restart cost, its
    mean productive seconds per step (what a rescued failure loses) and its rescue probability."""
    from mlflow.tracking import MlflowClient

    rid = run_id(run)
    client = MlflowClient(tracking_uri)
    try:
        info = client.get_run(rid)
    except Exception as e:
        raise InputError("run", f"no MLflow run {rid!r} in {tracking_uri} ({e})") from e
    stalls = sorted(m.value for m in client.get_metric_history(rid, "ckpt/blocking_seconds"))
    if not stalls:
        raise InputError("run", f"run {rid} logged no ckpt/blocking_seconds")
    totals = sorted(m.value for m in client.get_metric_history(rid, "ckpt/total_seconds"))  # start -> commit
    stall = stalls[len(stalls) // 2]
    commit = max(0.0, totals[len(totals) // 2] - stall) if totals else 0.0
    metrics = info.data.metrics
    if "goodput/startup_seconds" not in metrics:
        raise InputError("run", f"run {rid} logged no goodput/* ledger (did it finish?)")
    # The ledger is logged once at the end, at the step count the run reached.
    steps = max(m.step for m in client.get_metric_history(rid, "goodput/productive_seconds"))
    step_s = metrics.get("goodput/productive_seconds", 0.0) / steps if steps > 0 else None
    records, spared = attempts(run), in_process(run)
    return {"run_id": rid, "save_stall_seconds": stall, "commit_delay_seconds": commit, "steps": steps,
            "productive_step_seconds": step_s, **restart_cost(metrics, steps, records, spared),
            **rescued(run, records, spared)}  # fmt: skip
