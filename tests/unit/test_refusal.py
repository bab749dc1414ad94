"""A refusal (goodput.errors.UserError) in an elastic worker ends the job as one line, exit 2: the
worker records it and exits 2 without a traceback, and the agent's process restarts nobody and
raises it (goodput.run.refusal). The runs on the entry point: e2e/test_untrusted_runs.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

from goodput.errors import UserError
from goodput.run import refusal
from goodput.run.refusal import NoRestartOnRefusal, Refused


class ChildFailed(RuntimeError):
    """What elastic_launch raises when the agent gives up (ChildFailedError needs real failures)."""


MESSAGE = "/data/train.csv line 3: path '/etc/evil.pth' is absolute; refused"


def test_a_worker_refusal_exits_2_with_its_record_and_no_traceback(tmp_path):
    """worker.fail_fast, as an elastic worker calls it on a DataRootError (a UserError)."""
    code = (
        "import sys; from goodput.data.dataset import DataRootError\n"
        "from goodput.run.worker import fail_fast\n"
        f"fail_fast(DataRootError({MESSAGE!r}), None, sys.argv[1], 1)"
    )
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env)
    assert p.returncode == refusal.REFUSED == 2 and "Traceback" not in p.stderr, p.stderr
    rec = json.loads((tmp_path / refusal.FILE).read_text())
    assert rec == {"rank": 1, "type": "DataRootError", "message": MESSAGE}


def test_the_first_refusal_stays(tmp_path):
    refusal.report(UserError(MESSAGE), str(tmp_path), 0)
    refusal.report(UserError("another"), str(tmp_path), 1)
    assert str(refusal.refused(str(tmp_path))) == MESSAGE
    assert [p.name for p in (tmp_path / "elastic").iterdir()] == ["refusal.json"]  # no temp files left


def test_the_agent_restarts_nobody_after_a_refusal_and_raises_it(tmp_path):
    run_dir, restarted = str(tmp_path), []
    original = SimpleElasticAgent._restart_workers
    SimpleElasticAgent._restart_workers = lambda agent, group: restarted.append(group)
    try:
        refusal.report(UserError("left by an earlier launch in this run dir"), run_dir, 0)
        with NoRestartOnRefusal(run_dir):  # a stale refusal is not this launch's
            SimpleElasticAgent._restart_workers(None, "a crash")
            refusal.report(UserError(MESSAGE), run_dir, 0)
            with pytest.raises(Refused, match="line 3: path '/etc/evil.pth' is absolute"):
                SimpleElasticAgent._restart_workers(None, "the refusal")
        assert restarted == ["a crash"]
        with pytest.raises(Refused, match="line 3"), NoRestartOnRefusal(run_dir):  # no restarts left
            refusal.report(UserError(MESSAGE), run_dir, 0)
            raise ChildFailed("worker FAILED")
        with pytest.raises(ChildFailed), NoRestartOnRefusal(run_dir):  # a crash stays a crash
            raise ChildFailed("worker FAILED")
    finally:
        SimpleElasticAgent._restart_workers = original
    assert SimpleElasticAgent._restart_workers is original  # put back on exit
    assert isinstance(Refused(MESSAGE), UserError)  # scripts/train.py: one line, exit 2
