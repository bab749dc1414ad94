"""The hang watchdog's phases (docs/hangs.md): a slow phase is not a hang, a hang inside one is
caught by its bound, and the end of a run (model logging, the summary) is never ended as hung,
whatever the artifact store does. In-process: the watchdog's exit is replaced by a record."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import run_job_here
from mlflow.tracking import MlflowClient

from goodput.resilience.watchdog import Watchdog

# each test times a stall against the watchdog's bounds
pytestmark = pytest.mark.serial


def recording(w: Watchdog) -> list:
    """What `w` would have ended the rank for: (what it was doing, its bound), instead of exiting."""
    fired = []
    w._fire = lambda idle, bound: fired.append((w.what, bound))
    return fired


def test_a_slow_phase_is_not_a_hang_and_a_hang_inside_one_is_caught():
    w = Watchdog(timeout_s=0.4, first_timeout_s=0.4, rank=0, phase_timeout_s=1.2, compile_timeout_s=1.2)
    fired = recording(w)
    w.start()
    try:
        w.beat(4)
        with w.phase("evaluation after step 4", compiles=True):
            time.sleep(2.0)  # a first evaluation's cold compile: over the phase bound, not over + compile
        with w.phase("evaluation after step 8"):
            time.sleep(0.8)  # over the step bound, not over the phase's
        w.beat(9)
        assert fired == []
        with w.phase("checkpoint save of step 12"):
            time.sleep(2.0)  # hung inside a save: caught by the phase's bound
        assert fired == [("checkpoint save of step 12", 1.2)]
    finally:
        w.stop()


def test_after_a_phase_the_step_bound_holds_again():
    w = Watchdog(timeout_s=0.4, first_timeout_s=5.0, rank=0, phase_timeout_s=3.0)
    fired = recording(w)
    w.start()
    try:
        w.beat(1)
        with w.phase("evaluation after step 1"):
            pass
        time.sleep(1.2)  # hung between steps, right after a phase
        assert fired == [("after step 1", 0.4)]
    finally:
        w.stop()


def test_a_phase_is_never_shorter_than_the_step_bound():
    assert Watchdog(timeout_s=5.0, first_timeout_s=1.0, rank=0, phase_timeout_s=1.0).phase_timeout_s == 5.0


@pytest.fixture
def fired(monkeypatch):
    """Every watchdog of the in-process job records what it would have ended the rank for."""
    out: list = []
    monkeypatch.setattr(Watchdog, "_fire", lambda self, *a: out.append(self.what))
    return out


def test_a_slow_first_evaluation_of_a_compiled_run_is_not_a_hang(tmp_path, one_process, fired, monkeypatch):
    """#34: trainer.compile=true trainer.hang_timeout_s=... trainer.eval_every_n_steps=4 ended the
    first evaluation (its cold compile) as a hang, at the same place on every relaunch. Here each
    evaluation takes longer than hang_timeout_s (compiling is a no-op: 20 s of CPU, and not what
    is measured), and the first one is the phase that compiles."""
    import torch

    from goodput.run import loop

    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the cache sets it
    evaluate, phases, bounds = loop.evaluate, [], set()

    def slow_evaluate(*a, **kw):
        time.sleep(3.0)  # hang_timeout_s is 2
        return evaluate(*a, **kw)

    phase = getattr(Watchdog, "phase", None)  # (a watchdog without phases: every stall is a hang)

    def watched(self, what, compiles=False):
        phases.append((what, compiles))
        bounds.add((self.first_timeout_s, self.phase_timeout_s, self.compile_timeout_s))
        return phase(self, what, compiles)

    monkeypatch.setattr(loop, "evaluate", slow_evaluate)
    monkeypatch.setattr(Watchdog, "phase", watched, raising=False)
    summary, _ = run_job_here(
        tmp_path, "trainer.compile=true", "trainer.hang_timeout_s=2", "trainer.eval_every_n_steps=4",
        "trainer.max_steps=8",
    )  # fmt: skip
    assert fired == []
    assert summary["steps"] == 8 and summary["val_accuracy"] is not None
    evals = [p for p in phases if p[0].startswith("evaluation")]
    assert evals == [("evaluation after step 4", True), ("evaluation after step 8", False)]
    # the defaults: the first step gets parallel.init_timeout_s + trainer.compile_timeout_s
    assert bounds == {(600.0 + 1800.0, 900.0, 1800.0)}


def test_a_slow_blocking_save_is_not_a_hang(tmp_path, one_process, fired, monkeypatch):
    """A blocking save of step 4 takes 1.5 x trainer.hang_timeout_s (a slow store): longer than a
    step may stall, shorter than trainer.phase_timeout_s. It is a phase of its own, not a hang; so
    are every save and the wait for the last upload, each named in the watchdog's phases."""
    from goodput.checkpoint.manager import CheckpointManager

    real_save, phase, phases = CheckpointManager._save, Watchdog.phase, []

    def slow_save(self, step, app, extra):
        if step == 4:
            time.sleep(3.0)  # hang_timeout_s is 2
        return real_save(self, step, app, extra)

    def watched(self, what, compiles=False):
        phases.append(what)
        return phase(self, what, compiles)

    monkeypatch.setattr(CheckpointManager, "_save", slow_save)
    monkeypatch.setattr(Watchdog, "phase", watched)
    summary, _ = run_job_here(tmp_path, "trainer.hang_timeout_s=2", "trainer.phase_timeout_s=10")
    assert fired == []
    assert summary["steps"] == 12
    saves = [p for p in phases if p.startswith("checkpoint save")]
    assert saves == [f"checkpoint save of step {s}" for s in (4, 8, 12)]
    assert "waiting for the last checkpoint upload" in phases[phases.index(saves[-1]) :]


@pytest.fixture
def hung_artifact_store(monkeypatch):
    """MLflow's local artifact repository, every write stuck (until the test ends, at most 60 s).
    Returns the names of the threads that reached it."""
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

    release, reached = threading.Event(), []

    def stuck(self, *a, **kw):
        reached.append(threading.current_thread().name)
        release.wait(60)
        raise OSError("the artifact store did not answer")

    for name in ("log_artifact", "log_artifacts"):
        monkeypatch.setattr(LocalArtifactRepository, name, stuck)
    yield reached
    release.set()


def test_a_hung_artifact_store_at_the_end_still_finishes_the_run(
    tmp_path, one_process, fired, hung_artifact_store, monkeypatch
):
    """#32: the watchdog, still armed while the model was logged, ended a finished run (exit 124): no
    summary.json, the MLflow run left RUNNING, and the relaunch said "nothing to do". The model's
    upload is an artifact write through MLflow's client: mlflow.pytorch.log_model itself spends
    10-30 s of CPU here (torch.export, requirement checks) before it writes anything."""
    from goodput import publish

    def upload_model(c, run_id, *a):
        (tmp_path / "model.pt").write_bytes(b"weights")
        MlflowClient(c.mlflow.tracking_uri).log_artifact(run_id, str(tmp_path / "model.pt"), "model")
        return "models:/m-1"

    monkeypatch.setattr(publish, "_log", upload_model)
    summary, c = run_job_here(
        tmp_path, "mlflow.log_model=final", "mlflow.artifact_timeout_s=2", "trainer.hang_timeout_s=1"
    )
    assert fired == []
    assert any("logging the model" in name for name in hung_artifact_store)  # the store was what hung
    assert any("run's files" in name for name in hung_artifact_store)
    assert any("identity.json" in name for name in hung_artifact_store)  # at the start too, bounded
    assert summary["steps"] == 12 and summary["mlflow_model_uri"] is None
    written = (tmp_path / "run" / "summary.json").read_text()
    assert '"mlflow_model_uri": null' in written
    assert MlflowClient(c.mlflow.tracking_uri).get_run(summary["mlflow_run_id"]).info.status == "FINISHED"
