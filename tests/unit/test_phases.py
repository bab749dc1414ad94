"""The hang watchdog's phases (docs/hangs.md): a slow phase is not a hang, a hang inside one is
caught by its bound, and the end of a run (model logging, the summary) is never ended as hung,
whatever the artifact store does. In-process: the watchdog's exit is replaced by a record."""

from __future__ import annotations

import json
import threading
import time

import pytest
from helpers import SilentStore, compose_train, run_job_here
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
def silent_store():
    """A store on loopback that accepts connections and never answers (helpers.SilentStore)."""
    store = SilentStore()
    yield store
    store.close()


def test_an_artifact_store_that_never_answers_costs_the_end_its_bound_and_the_relaunch_logs_it(
    tmp_path, one_process, fired, silent_store, monkeypatch, caplog
):
    """#48: an artifact store that accepted connections and never answered cost a 12-step run more
    than 15 minutes: identity.json blocked the first step, then the model and each file of the end
    waited their own bound (mlflow.artifact_timeout_s) in turn. Now training never waits for an
    upload, and after the final commit the model, the files and the run's state get one bound
    (mlflow.end_timeout_s); past it a warning names what is missing, the job returns its summary
    (exit 0), and the next launch writes the run's end. #32 too: the watchdog (hang_timeout_s=1)
    never ends the run while the end waits. The tracking store is SQLite; the experiment's
    artifacts go to the silent store over HTTP."""
    from goodput.run.build import Trainer

    when, real = {}, Trainer.step_done

    def step_done(self, step):
        when.setdefault("first step", time.monotonic())
        when["last step"] = time.monotonic()  # then the final evaluation and commit: under a second
        real(self, step)

    monkeypatch.setattr(Trainer, "step_done", step_done)
    args = (
        "mlflow.log_model=final", f"mlflow.artifact_location={silent_store.url}/artifacts",
        "mlflow.artifact_timeout_s=60", "mlflow.end_timeout_s=6", "trainer.hang_timeout_s=1",
    )  # fmt: skip
    started = time.monotonic()
    summary, c = run_job_here(tmp_path, *args)
    done = time.monotonic()
    assert silent_store.held  # the store was reached, and never answered
    assert when["first step"] - started < 30  # identity.json's upload (60 s) never held it
    assert done - when["last step"] < 6 + 10  # the end's one bound, plus a busy machine's slack
    assert fired == []
    assert summary["steps"] == 12 and summary["finished"] and summary["mlflow_model_uri"] is None
    assert '"mlflow_model_uri": null' in (tmp_path / "run" / "summary.json").read_text()
    (warning,) = [r.getMessage() for r in caplog.records if "not logged within" in r.getMessage()]
    for name in ("identity.json", "the model", "summary.json", "evaluation/per_class.csv"):
        assert name in warning, warning
    assert "mlflow.end_timeout_s=6 s" in warning and "the next launch of the same command logs" in warning
    client = MlflowClient(c.mlflow.tracking_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status != "FINISHED"  # the relaunch writes the end
    if "the run's state KILLED" not in warning:  # (on a busy machine SQLite may miss the state's share)
        assert run.info.status == "KILLED"
        assert "not logged within mlflow.end_timeout_s=6 s: " in run.data.tags["error"]

    silent_store.answer()  # the store is back
    caplog.clear()
    again, _ = run_job_here(tmp_path, *args, run_dir=tmp_path / "run2")
    assert "reached step 12, but its end was not written" in caplog.text
    assert not [r for r in caplog.records if "not logged within" in r.getMessage()]
    assert again["mlflow_run_id"] == summary["mlflow_run_id"] and again["resumed_from_steps"] == [12]
    assert again["mlflow_model_uri"]
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and "error" not in run.data.tags
    logged = {path.rsplit("/artifacts/", 1)[-1]: body for path, body in silent_store.put.items()}
    assert {"identity.json", "summary.json", "evaluation/per_class.csv", "data/model.pth"} <= set(logged)
    assert json.loads(logged["identity.json"])["digest"] == run.data.tags["goodput.identity"]


def test_a_tracking_store_that_never_answers_at_the_start_ends_the_launch_in_its_bound(
    tmp_path, one_process, silent_store
):
    """Before the first step the job closes a killed job's runs, reads the run's status and creates
    or continues the run: against a tracking server that never answers, each MLflow call waited
    120 s, 8 times, while the job held its accelerators. Now they get mlflow.start_timeout_s
    together, then the launch ends with one line (a UserError: exit 2), the run lock released."""
    from goodput.run import job
    from goodput.tracking import StoreTimeout

    cfg = compose_train([
        "experiment=smoke", f"paths.root={tmp_path}", f"mlflow.tracking_uri={silent_store.url}",
        "mlflow.start_timeout_s=2",
    ])  # fmt: skip
    out: list = []

    def launch():
        try:
            job.prepare(cfg, str(tmp_path / "run"))
        except BaseException as e:
            out.append(e)

    started = time.monotonic()
    th = threading.Thread(target=launch, daemon=True)
    th.start()
    th.join(60)  # (the MLflow client alone would wait 16 minutes)
    assert out and time.monotonic() - started < 2 + 20, "the start waited for the tracking store"
    assert isinstance(out[0], StoreTimeout), out[0]
    said = f"MLflow: the tracking store {silent_store.url} did not answer within mlflow.start_timeout_s=2 s"
    assert str(out[0]).startswith(said) and "nothing was trained" in str(out[0]), out[0]
    assert silent_store.held
    assert not list(tmp_path.glob("checkpoints/*/LOCK.json"))  # released
