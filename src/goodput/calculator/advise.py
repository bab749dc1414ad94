"""What a finished run measured, for `advise`: its save stall and its restart cost, from MLflow."""

from __future__ import annotations

import json
import os

from goodput.calculator import InputError


def run_id(run: str) -> str:
    """A checkpoint dir's newest COMMIT.json names the MLflow run; anything else is taken as a run id."""
    if "://" in run or os.path.isdir(run):
        from goodput.storage import Storage

        store = Storage(run)
        for name in sorted((n for n in store.ls() if n.startswith("step-")), reverse=True):
            try:
                return json.loads(store.read_bytes(f"{name}/COMMIT.json"))["mlflow_run_id"]
            except (FileNotFoundError, ValueError, KeyError):
                continue
        raise InputError("run", f"no committed checkpoint with an MLflow run id in {run}")
    return run


def restart_cost(metrics: dict[str, float], steps: int) -> dict[str, float | str]:
    """Seconds from a failure until training resumes, from the ledger's `goodput/*` totals.

    With restarts: what `lost_seconds` holds beyond the redone steps (the gap from the crash to the
    new worker: detection, respawn, imports), per restart, plus start-up per attempt (rendezvous,
    data listing, restore; the ledger books that as start-up, not lost). A redone step costs what a
    step costs: compute plus waiting for its batch. Without restarts only start-up per attempt is
    known, so the gap is missing and the cost is a floor.
    """
    restarts = int(metrics.get("goodput/restarts", 0))
    startup = metrics.get("goodput/startup_seconds", 0.0) / (1 + restarts)
    out: dict[str, float | str] = {"startup_seconds_per_attempt": startup, "restarts": restarts}
    if restarts > 0 and steps > 0:
        step_s = (
            metrics.get("goodput/productive_seconds", 0.0) + metrics.get("goodput/fetch_seconds", 0.0)
        ) / steps
        redone = metrics.get("goodput/lost_steps", 0.0) * step_s
        gap = max(0.0, metrics.get("goodput/lost_seconds", 0.0) - redone) / restarts
        out.update(
            restart_seconds=gap + startup,
            restart_gap_seconds=gap,
            restart_source="(lost_seconds - lost_steps x mean step seconds) / restarts + start-up/attempt",
        )
    else:
        out.update(
            restart_seconds=startup,
            restart_source="start-up seconds per attempt (no restarts: the crash-to-relaunch gap is missing)",
        )
    return out


def measured(run: str, tracking_uri: str) -> dict[str, float | str]:
    """The run's median save stall, its median delay from stall end to commit, its restart cost."""
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
    return {"run_id": rid, "save_stall_seconds": stall, "commit_delay_seconds": commit, "steps": steps,
            **restart_cost(metrics, steps)}  # fmt: skip
