"""Preemption as schedulers send it: a signal to the whole process group (SLURM's scancel, timeout(1),
a terminal's Ctrl-C) while DataLoader workers and prefetch threads run. The job finishes the step,
commits a checkpoint and exits 0; the relaunch ends with the uninterrupted run's model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import dump_stacks, run_train, start_train, train_cmd
from mlflow.tracking import MlflowClient

from goodput.checkpoint.layout import local_commits
from goodput.tracking import LEFT_TAG

pytestmark = pytest.mark.slow

# Workers and prefetch threads running, and enough steps that the signal lands mid-run.
EXTRA = ("data.num_workers=2", "trainer.max_steps=40")


def committed_steps(root: Path) -> list[int]:
    return sorted(step for d, _, _ in os.walk(root / "checkpoints") for step, _ in local_commits(d))


def interrupt(root: Path, sig: signal.Signals, *overrides: str, timeout: float = 240, group: bool = True):
    """Start the real entry point in its own session, wait for the first committed checkpoint
    (training is under way), send `sig` to the whole process group (or to the process started,
    alone); returns (rc, output)."""
    log = root / "interrupted.log"
    with open(log, "w") as out:
        p = start_train(train_cmd(root, *overrides), out)
        deadline = time.monotonic() + timeout
        while not committed_steps(root):
            assert p.poll() is None, log.read_text()[-4000:]
            if time.monotonic() > deadline:
                pytest.fail(f"no checkpoint committed in {timeout} s; its stacks:\n{dump_stacks(p, log)}")
            time.sleep(0.05)
        (os.killpg if group else os.kill)(p.pid, sig)
        try:
            rc = p.wait(timeout=timeout)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return rc, log.read_text()


def check_preempted_then_resumed(root: Path, sig: signal.Signals, ref: dict, *overrides: str, group=True):
    rc, out = interrupt(root, sig, *overrides, group=group)
    assert rc == 0, out[-6000:]
    assert f"received {sig.name}: checkpointed step" in out, out[-6000:]
    assert "killed by signal" not in out, out[-6000:]
    stopped = committed_steps(root)[-1]
    assert 0 < stopped < 40, f"stopped at {stopped}: the signal did not land mid-run"
    summary = json.loads(sorted(root.glob("runs/**/summary.json"), key=os.path.getmtime)[-1].read_text())
    assert summary["preempted"] == sig.name and summary["steps"] == stopped and not summary["finished"]
    # Not "done": the last line says where it stopped and how to go on; MLflow says KILLED (stopped,
    # resumable) and has no model of these weights, whatever mlflow.log_model says.
    # (the job's last line: under the elastic agent, multiprocessing's resource tracker may still print
    # its own KeyError tracebacks as the process exits)
    last = [line for line in out.splitlines() if " goodput: " in line][-1]
    assert f"stopped by {sig.name} at step {stopped} of 40" in last, out[-3000:]
    assert "To continue, run the same command again: python " in last and "done:" not in out
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "KILLED" and "model.uri" not in run.data.tags
    assert summary["mlflow_model_uri"] is None
    _, s = run_train(root, *overrides)
    assert s["resumed_from_steps"] == [stopped] and s["steps"] == 40
    assert s["model_sha256"] == ref["model_sha256"]
    assert s["sample_order_sha256"] == ref["sample_order_sha256"]
    run = client.get_run(s["mlflow_run_id"])
    assert s["mlflow_run_id"] == summary["mlflow_run_id"] and run.info.status == "FINISHED"
    if "mlflow.log_model=final" in overrides:  # finished now: the final model is the step-40 one
        assert s["mlflow_model_uri"] and run.data.tags["model.checkpoint_step"] == "40"


# Each preemption signal has a drill: SIGTERM and SIGINT (Ctrl-C) here, SIGTERM and SIGUSR2 to a
# ddp job's group, SIGUSR1 to the agent's process alone, SIGUSR2 from submitit. One handler takes
# all four in a worker (resilience.signals.PREEMPT_SIGNALS): a per-signal repeat adds no branch.
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_process_group_signal_single(tmp_path, smoke_reference, sig):
    ref = smoke_reference("dcp_sync", *EXTRA)
    model = ["mlflow.log_model=final"] if sig == signal.SIGINT else []  # Ctrl-C: no "final" model yet
    check_preempted_then_resumed(tmp_path, sig, ref, "checkpoint=dcp_sync", *EXTRA, *model)


def test_a_ddp_notice_before_the_workers_listen_stops_them_before_their_first_step(tmp_path):
    """The agent got SIGTERM as it started its workers (forked from a forkserver still importing,
    or ignoring signals as forked): forwarded to nobody, the notice was lost and the job trained
    to the end. The agent notes it; the workers stop before their first step, KILLED, exit 0."""
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        p = start_train(train_cmd(tmp_path, "parallel=ddp"), out)
        try:
            deadline = time.monotonic() + 240
            while not list(tmp_path.glob("runs/**/elastic")):  # the agent is starting its workers
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.02)
            os.killpg(p.pid, signal.SIGTERM)
            rc = p.wait(timeout=240)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    out = log.read_text()
    assert rc == 0, out[-4000:]
    summary = json.loads(next(tmp_path.glob("runs/**/summary.json")).read_text())
    assert summary["steps"] < 12 and not summary["finished"] and summary["preempted"] == "SIGTERM", out[
        -3000:
    ]
    assert (
        MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(summary["mlflow_run_id"]).info.status
        == "KILLED"
    )


@pytest.fixture(scope="module")
def ddp_reference_40(tmp_path_factory):
    _, s = run_train(tmp_path_factory.mktemp("ddp-ref-40"), "parallel=ddp", "checkpoint=dcp_sync", *EXTRA)
    return s


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2], ids=lambda s: s.name)
def test_process_group_signal_ddp_under_the_elastic_agent(tmp_path, ddp_reference_40, sig):
    check_preempted_then_resumed(
        tmp_path, sig, ddp_reference_40, "parallel=ddp", "checkpoint=dcp_sync", *EXTRA
    )


def test_signal_to_the_agents_process_alone_is_forwarded_to_the_workers(tmp_path, ddp_reference_40):
    """`kill -USR1 <job pid>`: only the elastic agent's process gets it; it must not tear the
    workers down, but pass the notice on, so they checkpoint and exit 0."""
    overrides = ("parallel=ddp", "checkpoint=dcp_sync", *EXTRA)
    check_preempted_then_resumed(tmp_path, signal.SIGUSR1, ddp_reference_40, *overrides, group=False)


def test_process_group_signal_spares_the_async_checkpoint_daemon(tmp_path, smoke_reference):
    """checkpoint.backend.async_type=process: DCP's spawned daemon is in the process group too; a
    daemon killed by the signal would fail the final save ("Connection reset by peer"), one that ignored its
    parent's SIGTERM would hang the exit (multiprocessing terminates daemonic children)."""
    extra = ("checkpoint.backend.async_type=process", *EXTRA)
    ref = smoke_reference("dcp_async", *extra)
    check_preempted_then_resumed(tmp_path, signal.SIGTERM, ref, "checkpoint=dcp_async", *extra)


def _task_pid(folder: Path, deadline: float) -> int:
    """The submitit task process (python -m submitit.core._submit <folder>) under `folder`."""
    while time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"submitit.core._submit" in cmd and any(str(folder).encode() in c for c in cmd):
                return int(d.name)
        time.sleep(0.2)
    raise AssertionError("no submitit task process found")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the task process through /proc")
def test_submitit_usr2_commits_then_submitit_requeues(tmp_path, smoke_reference):
    """hydra/launcher=submitit_local: submitit installs its own USR2 handler (checkpoint, requeue,
    exit) in the task process. The loop must take USR2, commit, and hand the signal back to
    submitit, which requeues; the requeued task resumes to the uninterrupted run's model.
    The signal is sent the way submitit's local controller sends it (to the task process) once
    training is under way; timeout_min is long so the controller's own timer never fires."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    ref = smoke_reference("dcp_sync", *EXTRA)
    cmd = train_cmd(
        tmp_path, "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=30",
        "checkpoint=dcp_sync", *EXTRA,
    )  # fmt: skip
    with open(tmp_path / "hydra.log", "w") as out:
        p = start_train(cmd, out)
        try:
            deadline = time.monotonic() + 240
            pid = _task_pid(tmp_path, deadline)
            while not committed_steps(tmp_path):
                assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "hydra.log").read_text()
                time.sleep(0.05)
            os.kill(pid, signal.SIGUSR2)
            rc = p.wait(timeout=300)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    logs = "".join(f.read_text() for f in sorted(tmp_path.glob("multirun/**/.submitit/**/*_log.*")))
    assert rc == 0, (tmp_path / "hydra.log").read_text()[-3000:] + logs[-5000:]
    assert "received SIGUSR2: checkpointed step" in logs, logs[-5000:]
    assert "passing SIGUSR2 on to the handler installed before the run" in logs
    assert "Requeued job" in logs  # submitit's own requeue, after our commit
    summaries = [json.loads(f.read_text()) for f in tmp_path.glob("multirun/**/summary.json")]
    final = [s for s in summaries if s["steps"] == 40]
    assert len(final) == 1 and final[0]["resumed_from_steps"]
    assert final[0]["model_sha256"] == ref["model_sha256"]
    assert final[0]["sample_order_sha256"] == ref["sample_order_sha256"]


# The scheduler's notice as the worker calls `where` (the run's end: write_summary; its start-up:
# resume), then the real entry point.
NOTICE_AT = """
import os, runpy, signal, sys
from goodput.run import worker
where, sig = sys.argv.pop(1), getattr(signal, sys.argv.pop(1))
real = getattr(worker, where)
def noticed(*a, **k):
    os.kill(os.getpid(), sig)
    return real(*a, **k)
setattr(worker, where, noticed)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_notice_during_the_start_up_ends_the_run_killed_before_its_first_step(tmp_path):
    """Before the loop, SIGTERM killed the process: the MLflow run stayed RUNNING until a relaunch."""
    from helpers import REPO, entry_env

    cmd = [sys.executable, "-c", NOTICE_AT, "resume", "SIGTERM", *train_cmd(tmp_path)[1:]]
    p = subprocess.run(cmd, cwd=REPO, env=entry_env(), capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "received SIGTERM during the start-up: stopping before step 1" in out
    summary = json.loads(next(tmp_path.glob("**/summary.json")).read_text())
    assert summary["steps"] == 0 and not summary["finished"] and summary["preempted"] == "SIGTERM"
    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(summary["mlflow_run_id"])
    assert run.info.status == "KILLED"


def test_a_notice_after_the_last_step_does_not_cut_the_end_of_the_run_short(tmp_path):
    """Killed there, the run was complete (its final commit) but had no summary, no logged model
    and stayed RUNNING; every relaunch then said "nothing to do". The end is written first."""
    from helpers import REPO, entry_env

    entry = train_cmd(tmp_path, "mlflow.log_model=final")[1:]
    cmd = [sys.executable, "-c", NOTICE_AT, "write_summary", "SIGTERM", *entry]
    p = subprocess.run(cmd, cwd=REPO, env=entry_env(), capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "received SIGTERM after the last step: wrote the end of the run first" in out
    summary = json.loads(next(tmp_path.glob("**/summary.json")).read_text())
    assert summary["finished"] and summary["steps"] == 12 and summary["mlflow_model_uri"]
    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"


def test_a_run_killed_while_writing_its_end_gets_it_at_the_relaunch(tmp_path):
    """A SIGKILL (or a second signal) after the final commit, while the run's end was written: the
    run was complete, so every relaunch said "nothing to do", and it stayed without its summary's
    evaluation, its logged model and a FINISHED status. The relaunch writes that end, no step run."""
    from helpers import REPO, entry_env

    cmd = [sys.executable, "-c", NOTICE_AT, "write_summary", "SIGKILL", *train_cmd(tmp_path)[1:]]
    p = subprocess.run(cmd, cwd=REPO, env=entry_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, (p.stdout + p.stderr)[-4000:]
    assert not list(tmp_path.glob("**/summary.json"))
    (ckpt,) = tmp_path.glob("checkpoints/*")
    commits = local_commits(ckpt)
    assert commits[-1][0] == 12
    p, s = run_train(tmp_path, "mlflow.log_model=final")
    out = p.stdout + p.stderr
    assert "reached step 12, but its end was not written" in out and "nothing to do" not in out
    assert s["finished"] and s["steps"] == 12 and s["resumed_from_steps"] == [12]
    assert s["val_accuracy"] is not None and s["mlflow_model_uri"]
    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(s["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["model.checkpoint_step"] == "12"
    assert run.data.tags[LEFT_TAG] == "1"  # the same MLflow run, closed once by the relaunch
    assert local_commits(ckpt) == commits  # no new save
    p, _ = run_train(tmp_path)  # written now: complete
    assert "is complete: it reached step 12" in p.stdout + p.stderr


STOP_SCRIPT = """
import os, signal, sys, time
from goodput.resilience.preemption import StopSignal
stop = StopSignal(grace_s=float(sys.argv[1]))
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
assert stop.received == "SIGTERM"
os.kill(os.getpid(), signal.SIGTERM)  # the same notice again (group + forwarded): still running
time.sleep(0.2)
print("still running", flush=True)
if sys.argv[2] == "second":
    os.kill(os.getpid(), signal.SIGINT)  # a second, different signal: out at once
time.sleep(5)  # the step boundary is never reached
print("not reached", flush=True)
"""


@pytest.mark.parametrize(
    "grace, then, rc", [(30, "second", 128 + signal.SIGINT), (0.5, "wait", 128 + signal.SIGTERM)]
)
def test_a_second_signal_or_the_grace_period_exits_promptly(grace, then, rc):
    p = subprocess.run(
        [sys.executable, "-c", STOP_SCRIPT, str(grace), then], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == rc, p.stderr[-3000:]
    assert "still running" in p.stdout and "not reached" not in p.stdout
