"""Schema of the `checkpoint` config group (read by CheckpointManager and the backends)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from goodput.storage.remote import check_url

# torch.distributed.elastic's agent stops the surviving workers of a failed group with SIGTERM and
# SIGKILLs them this long after (LocalElasticAgent._stop_workers -> _shutdown(timeout=30)).
AGENT_STOP_GRACE_S = 30.0
RESCUE_MARGIN_S = 5.0  # of that grace, what the rescue leaves for its record, the MLflow run's end, the exit


@dataclass
class CheckpointConfig:
    """Schema of the `checkpoint` group (read by goodput.checkpoint.CheckpointManager and the backend)."""

    backend: Any = MISSING
    """How a rank writes its state: a `_target_` node, built with hydra.utils.instantiate, one
    option file each: `torch_save` (goodput.checkpoint.backends.TorchSave: rank 0 gathers and
    writes one file; simplest, slow for big models), `dcp_sync` (DCPSync: every rank writes its
    shard; the loop waits for write + upload), `dcp_async` (DCPAsync: every rank writes its shard
    in the background; the loop waits only for the copy; its `async_type` is `thread` or `process`)."""

    dir: str = "${paths.checkpoint_dir}/${run.name}"
    """Where committed checkpoints live: a path or fsspec URL, shared by all nodes."""

    staging_dir: str = "${paths.staging_dir}/${run.name}"
    """Node-local fast disk where each save is written before it is uploaded to `dir`."""

    every_n_steps: int | None = 50
    """Save every N steps (null = off). Each save costs the loop its blocking part (dcp_async: the copy
    to host memory; sync backends: write + upload); a crash loses on average half an interval of work.
    The best interval is about sqrt(2 x save cost x MTBF): `python -m goodput.calculator optimal-interval`."""

    every_n_minutes: float | None = None
    """Also (or instead) save when this much wall time passed since the last save; null = off.
    Steps of varying length make a time interval the steadier bound on lost work."""

    keep_last: int = 2
    """Committed checkpoints kept (the newest is never deleted). More = older fallbacks if the
    newest proves unreadable, at the cost of storage."""

    keep_best_by: str | None = None
    """Also keep the commit of the best evaluation of this metric (`val/accuracy`, `val/loss`,
    `val/top5`; null = off): a new best is checkpointed at once, retention never removes it while
    it is the best (on top of keep_last), and its COMMIT.json carries the metric. The best so far is
    part of the saved state, so restarts and resharding keep the same choice."""

    keep_best_mode: str | None = None
    """`max` or `min`: which way is better for keep_best_by; null = from the name (min for a loss)."""

    on_error: str = "raise"
    """A save that fails: `raise` stops the run; `continue` logs it and trains on (the previous
    commit stays the newest, so a crash would lose more)."""

    commit_timeout_s: float = 600.0
    """Rank 0 waits this long for every rank's upload (its manifest) before giving up on the
    commit; the previous commit stays the newest. It bounds the save, not the interval: with
    every_n_minutes set it must be shorter than that interval (a commit still waiting when the
    next save is due stalls the loop). Under a sync backend the wait is in the loop, where
    trainer.hang_timeout_s, if shorter, ends a rank first; dcp_async waits on a background thread."""

    rescue: bool = True
    """When a rank fails (a peer dies, a collective times out, its own step raises, the watchdog ends
    it), the ranks that survive write the last finished step without any collective, so a failure
    with a surviving replica loses at most the step in flight (goodput.checkpoint.rescue; the
    cases: docs/checkpointing.md "Rescue checkpoints"). false = a failure costs the work since the
    last commit. Per step it costs a copy of the model's buffers (BatchNorm statistics)."""

    rescue_timeout_s: float = 15.0
    """A rescue not committed within this many seconds stays uncommitted (never loaded) and the
    relaunch uses the newest regular commit. It must end before the elastic agent's SIGKILL, which
    follows its SIGTERM to the survivors by AGENT_STOP_GRACE_S (30 s, torch's own); a rank stuck
    in a collective starts its rescue only when trainer.signal_grace_seconds have passed, so the
    two together must fit (checked at compose time)."""

    def __post_init__(self):
        e = []
        if not (isinstance(self.backend, dict) and "_target_" in self.backend):
            e.append(f"checkpoint.backend must be a node with a _target_ (a class), got {self.backend!r}")
        for key in ("every_n_steps", "every_n_minutes"):
            v = getattr(self, key)
            if v is not None and v <= 0:
                e.append(f"checkpoint.{key} must be > 0 or null, got {v}")
        if self.keep_last < 1:
            e.append(
                "checkpoint.keep_last must be >= 1 (the newest commit is never deleted), "
                f"got {self.keep_last}"
            )
        if self.keep_best_mode not in (None, "max", "min"):
            e.append(f"checkpoint.keep_best_mode must be max|min|null, got {self.keep_best_mode!r}")
        if self.on_error not in ("raise", "continue"):
            e.append(f"checkpoint.on_error must be raise|continue, got {self.on_error!r}")
        if not 0 < self.rescue_timeout_s <= AGENT_STOP_GRACE_S - RESCUE_MARGIN_S:
            e.append(
                f"checkpoint.rescue_timeout_s must be in (0, {AGENT_STOP_GRACE_S - RESCUE_MARGIN_S:g}] "
                f"(the elastic agent kills the survivors {AGENT_STOP_GRACE_S:g} s after asking them to stop; "
                f"{RESCUE_MARGIN_S:g} s are left for the exit), got {self.rescue_timeout_s:g}"
            )
        if self.commit_timeout_s <= 0:
            e.append(f"checkpoint.commit_timeout_s must be > 0, got {self.commit_timeout_s}")
        elif self.every_n_minutes and self.commit_timeout_s >= 60 * self.every_n_minutes:
            e.append(
                f"checkpoint.commit_timeout_s={self.commit_timeout_s:g} must be shorter than the interval "
                f"checkpoint.every_n_minutes={self.every_n_minutes:g} ({60 * self.every_n_minutes:g} s)"
            )
        try:
            check_url(str(self.dir), "checkpoint.dir")
        except ValueError as err:
            e.append(str(err))
        if e:
            raise ValueError("\n  - ".join(e))
