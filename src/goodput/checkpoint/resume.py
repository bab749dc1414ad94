"""Resume: which checkpoint a start should load, and loading it on every rank. One call from a worker.

`run.resume` is `auto` (the newest commit of this run), `none` (start fresh), or a committed step
dir of this run's `checkpoint.dir`. An elastic restart always continues from the newest commit:
re-applying `none` or an explicit step would throw the progress since then away.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from goodput.checkpoint.manager import CheckpointManager
from goodput.checkpoint.state import AppState
from goodput.resilience.accounting import restart_round

log = logging.getLogger(__name__)


def effective_spec(configured: str) -> str:
    if restart_round() > 0:
        return "auto"
    return str(configured)


def _candidates(mgr: CheckpointManager, spec: str) -> list[dict]:
    """Rank 0 decides what to try; every rank gets the same list (or the same error)."""
    out = [None, None]
    if mgr.rank == 0:
        try:
            if spec == "auto":
                mgr.clean_incomplete()
                out[0] = mgr.committed()
            elif spec == "none":
                out[0] = []
            else:
                out[0] = [mgr.commits.resolve(spec)]
        except Exception as e:
            out[1] = f"{type(e).__name__}: {e}"
    if mgr.world > 1:
        dist.broadcast_object_list(out, src=0)
    if out[1] is not None:
        raise RuntimeError(f"could not list checkpoints: {out[1]}")
    return out[0]


def resume(mgr: CheckpointManager, app: AppState, configured: str) -> tuple[dict | None, bool]:
    """Load what `run.resume` asks for, collectively. Returns (commit record or None, touched):
    `touched` means a failed load may have written into the live state, which must be rebuilt."""
    spec = effective_spec(configured)
    rec, skipped = mgr.restore(app, _candidates(mgr, spec))
    for s in skipped:
        log.warning("could not load checkpoint %s; falling back to the previous one", s)
    if spec not in ("auto", "none") and rec is None:
        raise RuntimeError(f"run.resume={configured} could not be loaded: {skipped}")
    if mgr.rank == 0 and spec != "none":
        mgr.supersede_after(rec["step"] if rec else -1)
    if rec:
        log.info("resumed from %s (step %d)", mgr.storage.url(rec["dir"]), rec["step"])
    elif skipped:
        log.warning("no committed checkpoint could be loaded: starting from scratch")
    return rec, bool(skipped) and rec is None
