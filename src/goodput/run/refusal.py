"""A refusal in an elastic worker ends the job: one line, exit 2, no restart.

A goodput.errors.UserError says that the config, the data or the store is wrong (a manifest row or a
shard index entry outside its root, a malformed record...): a restart would meet it again, up to
parallel.max_restarts times. In one process it reaches scripts/train.py, which prints it as one line
and exits 2. A worker that the elastic agent started can hand nothing up but its exit code, so:

- the worker (`report`, called by goodput.run.worker.fail_fast) leaves the refusal in
  `<run dir>/elastic/refusal.json` (the first rank to refuse; written whole) and exits REFUSED (2)
  without a traceback;
- the agent's process (`NoRestartOnRefusal`, around elastic_launch) then restarts nobody: the agent's
  next restart, or its final ChildFailedError, becomes `Refused` (a UserError with the worker's
  message), which scripts/train.py prints as one line, exit 2. torch's own report of that worker's
  exit (a traceback of the process context) is filtered out, so the message is the one line.

Under an external launcher (torchrun) the worker does the same, and torchrun restarts the workers
as its own --max-restarts says (each refuses again).
Any UserError takes this path; nothing here knows which one.
"""

from __future__ import annotations

import json
import logging
import os
import secrets

from goodput.errors import UserError
from goodput.untrusted import RecordError, field, parse_record

log = logging.getLogger(__name__)

REFUSED = 2  # a worker's exit status for a refusal (scripts/train.py's, too)
FILE = "elastic/refusal.json"
_TORCH_REPORT = "torch.distributed.elastic.multiprocessing.api"  # logs each failed worker's exit


class Refused(UserError):
    """A worker's refusal, raised in the agent's process: its message is the worker's, in full."""


def report(e: UserError, run_dir: str, rank: int) -> None:
    """In a worker: record the refusal for the agent's process (the first rank's stays)."""
    path = os.path.join(run_dir, FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{secrets.token_hex(6)}.tmp"
    with open(tmp, "w") as f:
        json.dump({"rank": rank, "type": type(e).__name__, "message": str(e)}, f)
    try:
        os.link(tmp, path)  # whole or not at all; another rank's refusal, already there, stays
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def refused(run_dir: str) -> Refused | None:
    """The refusal a worker of this launch recorded, or None."""
    path = os.path.join(run_dir, FILE)
    try:
        with open(path, "rb") as f:
            rec = parse_record(f.read(), path)
        return Refused(field(rec, "message", str, path))
    except (OSError, RecordError):
        return None


class NoRestartOnRefusal:
    """Around elastic_launch in the agent's process (see the module's docstring)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __enter__(self):
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

        try:  # a run dir reused by a relaunch: an old refusal is not this launch's
            os.unlink(os.path.join(self.run_dir, FILE))
        except FileNotFoundError:
            pass
        self._agent, self._restart = SimpleElasticAgent, SimpleElasticAgent._restart_workers
        guard = self

        def restart_unless_refused(agent, worker_group):
            if (e := refused(guard.run_dir)) is not None:
                raise e  # the agent stops the other workers and returns; train.py prints it
            return guard._restart(agent, worker_group)

        SimpleElasticAgent._restart_workers = restart_unless_refused
        logging.getLogger(_TORCH_REPORT).addFilter(self._quiet)
        return self

    def _quiet(self, record: logging.LogRecord) -> bool:
        return refused(self.run_dir) is None

    def __exit__(self, kind, exc, tb):
        self._agent._restart_workers = self._restart
        logging.getLogger(_TORCH_REPORT).removeFilter(self._quiet)
        if isinstance(exc, Exception) and not isinstance(exc, Refused) and (e := refused(self.run_dir)):
            raise e from None  # no restarts left: the agent's ChildFailedError, said as the refusal
        return False
