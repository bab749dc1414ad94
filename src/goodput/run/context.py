"""What a launch *is*, apart from what it is configured to do.

goodput.run.job.prepare makes one per job and passes it beside the config to every rank; nothing
here is a config key, so nothing here can be overridden, hashed into the config hash or logged
as an MLflow param (the identity is derived from the config, goodput.identity).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class RunContext:
    run_dir: str
    """This launch's Hydra run directory: summary.json, goodput.png, the elastic agent's logs."""

    job_start: float
    """When this launch began (the job process's start, imports included): the goodput ledger's
    wall clock counts from it."""

    config_hash: str
    """A hash of the whole resolved config, recorded in every commit (goodput.config.config_hash)."""

    mlflow_run_id: str | None = None
    """The MLflow run this launch logs to (global rank 0 opens it; None on the other ranks until
    the worker receives rank 0's)."""

    identity: dict = field(default_factory=dict)
    """What this launch trains: {"digest", "keys": {identity key: value}} (goodput.identity.record),
    recorded in every commit and compared with the commit a relaunch continues."""

    code: dict = field(default_factory=dict)
    """The code that trains it: {"digest", "files", "git"} (goodput.provenance.code_record), recorded
    in every commit and compared with the commit a relaunch continues."""

    lock_token: str | None = None
    """The token of the run lock this job holds (goodput.resilience.lock; None: not locked here):
    every commit first checks that the lock still names it."""

    def with_rank0(self, mlflow_run_id: str | None, run_dir: str, lock_token: str | None) -> RunContext:
        """Under an external launcher every rank prepared its own: the job's are rank 0's."""
        return replace(self, mlflow_run_id=mlflow_run_id, run_dir=run_dir, lock_token=lock_token)
