"""The Optuna sweeper's study rules, in-process on a SQLite study (the runs: e2e/test_search_runs.py).

Which study a launch continues (the same command: the same study; another search space, objective
or command: another study, or a refusal under an explicit study_name), what a relaunch does with
the trials a killed search left RUNNING, what n_trials counts, and the sampler's seed on relaunch."""

from __future__ import annotations

import logging

import optuna
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from optuna.trial import TrialState

from hydra_plugins.goodput_optuna_sweeper import _study

SPACE = ["optim.optimizer.lr=tag(log, interval(0.01, 0.5))", "trainer.micro_batch_size=choice(2,4)"]


def space(*overrides: str) -> dict:
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return {o.get_key_element(): _study.distribution(o) for o in parsed}


def search(overrides=SPACE, fixed=("experiment=smoke",), metric="val/accuracy", run="smoke") -> dict:
    return _study.definition(space(*overrides), list(fixed), metric, "maximize", run)


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    """One SQLite file for the module (Optuna's schema takes seconds to create); a study per test."""
    return _study.storage_url(f"sqlite:///{tmp_path_factory.mktemp('search')}/db/optuna.db")


def test_the_same_command_names_the_same_study_and_a_changed_one_another():
    name = _study.default_name(search())
    assert name.startswith("smoke/search-")
    assert _study.default_name(search(fixed=("experiment=smoke",))) == name
    assert _study.default_name(search(overrides=list(reversed(SPACE)))) == name  # order is no difference
    changed = [
        search(overrides=[SPACE[0], "trainer.micro_batch_size=choice(2,4,8)"]),
        search(overrides=SPACE[:1]),
        search(fixed=("experiment=smoke", "trainer.max_steps=8")),
        search(metric="val/loss"),
        search(run="demo"),
    ]
    assert len({_study.default_name(d) for d in changed} | {name}) == len(changed) + 1


def test_a_study_name_that_holds_another_search_is_refused_naming_what_differs(storage):
    _study.open_study("mine", storage, "maximize", search(), explicit=True)
    assert _study.open_study("mine", storage, "maximize", search(), explicit=True).study_name == "mine"
    other = search(overrides=[SPACE[0], "trainer.micro_batch_size=choice(2,4,8)"])
    with pytest.raises(
        _study.SearchRefused, match=r"study_name=mine.*trainer\.micro_batch_size.*choices=\(2, 4, 8\)"
    ):
        _study.open_study("mine", storage, "maximize", other, explicit=True)


def test_a_new_study_of_a_run_that_searched_before_says_why_it_is_new(storage, caplog):
    first, second = search(), search(fixed=("experiment=smoke", "trainer.max_steps=8"))
    _study.open_study(_study.default_name(first), storage, "maximize", first, explicit=False)
    with caplog.at_level(logging.INFO, logger="hydra_plugins.goodput_optuna_sweeper"):
        _study.open_study(_study.default_name(second), storage, "maximize", second, explicit=False)
    assert f"not {_study.default_name(first)}" in caplog.text
    assert "override trainer.max_steps=8 only in this command" in caplog.text


def test_a_trial_a_killed_search_left_running_is_failed_and_queued_again_under_its_run(storage):
    s = space(*SPACE)
    study = _study.open_study("killed", storage, "maximize", search(), explicit=True)
    done = study.ask(s)
    done.set_user_attr(_study.RUN_NAME, "s/trial-000")
    study.tell(done, 0.5)
    cut = study.ask(s)  # the process dies here: the trial stays RUNNING in the storage
    cut.set_user_attr(_study.RUN_NAME, "s/trial-001")

    again = optuna.load_study(study_name="killed", storage=storage)  # the relaunch
    _study.recover(again)
    states = {t.number: t.state for t in again.trials}
    assert states == {0: TrialState.COMPLETE, 1: TrialState.FAIL, 2: TrialState.WAITING}
    assert [t.number for t in _study.counted(again)] == [0]  # the cut-off trial does not count
    resumed = again.ask(s)
    assert resumed.params == cut.params and resumed.number == 2
    assert resumed.user_attrs[_study.RUN_NAME] == "s/trial-001"  # its run: checkpoints and MLflow run
    assert resumed.user_attrs[_study.RESUMES] == 1
    again.tell(resumed, 0.7)
    assert [t.number for t in _study.counted(again)] == [0, 2] and again.best_value == 0.7


def test_a_relaunch_does_not_draw_the_first_launch_points_again(storage):
    """TPE's start-up trials come from its seed: a relaunch seeded alike asked the old points again."""
    s = space(*SPACE)
    cfg = OmegaConf.create({"_target_": "optuna.samplers.TPESampler", "seed": 123})
    first = _study.open_study("seeded", storage, "maximize", search(), explicit=True)
    first.sampler = _study.sampler(cfg, 0)
    points = []
    for _ in range(2):
        t = first.ask(s)
        points.append(t.params)
        first.tell(t, 0.5)
    relaunch = optuna.load_study(study_name="seeded", storage=storage)
    relaunch.sampler = _study.sampler(cfg, len(relaunch.trials))
    assert relaunch.ask(s).params not in points
    same_seed = optuna.load_study(study_name="seeded", storage=storage, sampler=_study.sampler(cfg, 0))
    assert same_seed.ask(s).params == points[0]  # what the seed alone did


def test_a_sqlite_study_under_a_remote_paths_root_is_refused_naming_the_key():
    with pytest.raises(_study.SearchRefused, match="hydra.sweeper.storage"):
        _study.storage_url("sqlite:///s3://bucket/runs/optuna.db")
    assert _study.storage_url(None) is None  # storage=null: Optuna's in-memory study


class Job:
    """What Hydra's launcher hands back for a job (hydra.core.utils.JobReturn): its config, its
    return value, or the exception it raised (return_value raises it again)."""

    def __init__(self, value=None, error: Exception | None = None, max_steps: int = 12):
        self.cfg = OmegaConf.create({"trainer": {"max_steps": max_steps}})
        self._value, self._error = value, error

    @property
    def return_value(self):
        if self._error is not None:
            raise self._error
        return self._value


def test_a_job_s_result_is_a_trial_s_outcome():
    from hydra.errors import CompactHydraException

    from hydra_plugins.goodput_optuna_sweeper.sweeper import outcome

    done = {"steps": 12, "preempted": None, "stop_reason": None, "val": {"val/accuracy": 0.25}}
    assert outcome(Job(done), "val/accuracy")[:2] == ("complete", 0.25)
    late = {**done, "preempted": "SIGTERM"}  # the signal came at the last step: finished anyway
    assert outcome(Job(late), "val/accuracy")[:2] == ("complete", 0.25)
    stopped = outcome(Job({**done, "steps": 8, "preempted": "SIGINT"}), "val/accuracy")
    assert stopped[:3] == ("interrupted", None, "was stopped by SIGINT at step 8")  # not a finished trial
    early = {**done, "steps": 8, "preempted": "SIGINT", "stop_reason": "early_stopping"}
    assert outcome(Job(early), "val/accuracy")[0] == "complete"  # early stopping finished it
    refusal = CompactHydraException("job 1 (x=3): invalid config:\n  - x=3")  # scripts/train.py's
    refused = outcome(Job(error=refusal), "val/accuracy")
    assert refused[:3] == ("failed", None, "job 1 (x=3): invalid config: - x=3")  # one line
    assert outcome(Job(error=RuntimeError("boom")), "val/accuracy")[2] == "RuntimeError: boom"
    assert outcome(Job(None), "val/accuracy")[0] == "failed"  # scripts/train.py: already complete
    assert outcome(Job(done), "val/loss")[:3] == ("failed", None, "its summary has no val/loss")


def test_a_second_search_of_a_running_study_is_refused(tmp_path):
    """One process per search: its RUNNING trials are a live search's, not leftovers to fail."""
    import json
    import socket
    import subprocess
    import time

    from goodput.resilience.lock import RunLocked
    from hydra_plugins.goodput_optuna_sweeper.sweeper import OptunaSweeper

    s = OptunaSweeper(metric="val/accuracy")
    s.config = OmegaConf.create({
        "paths": {"checkpoint_dir": str(tmp_path / "checkpoints")},
        "storage": {"_target_": "goodput.storage.Storage", "_partial_": True},
        "run": {"lock_stale_seconds": 120},
    })  # fmt: skip
    s._lock("smoke/search-1").release()  # free: taken and given back
    other = subprocess.Popen(["sleep", "60"])  # a live process holds it
    try:
        rec = {"host": socket.gethostname(), "pid": other.pid, "token": "x", "started": time.time()}
        (tmp_path / "checkpoints/smoke/search-1/LOCK.json").write_text(json.dumps(rec))
        with pytest.raises(RunLocked, match=f"pid {other.pid}"):
            s._lock("smoke/search-1")
    finally:
        other.kill()
        other.wait()
    s._lock("smoke/search-1").release()  # a dead holder's lock is taken over at once


class Launcher:
    """Hydra's launcher, scripted: each launch() returns the next batch of results, and keeps the
    overrides it was handed."""

    def __init__(self, *results):
        self.results, self.batches = list(results), []

    def launch(self, batch, initial_job_idx):
        self.batches.append(batch)
        return self.results.pop(0)


class NoParent:
    run_id = None

    def trial(self, *a):
        pass

    def failed(self, *a):
        pass


def sweeper(n_trials: int, launcher: Launcher):
    from hydra_plugins.goodput_optuna_sweeper.sweeper import OptunaSweeper

    s = OptunaSweeper(metric="val/accuracy", n_trials=n_trials)
    s.launcher, s.validate_batch_is_legal = launcher, lambda batch: None
    return s


def test_a_search_whose_lock_another_search_took_over_asks_no_more_trials(storage, tmp_path):
    """Its lock taken over while a trial ran (its heartbeat looked stale to the other search): the
    search stops before it asks for the next trial, with one line naming the other holder."""
    from goodput.resilience.lock import LockLost, RunLock
    from goodput.storage.remote import Storage

    done = {"steps": 12, "preempted": None, "stop_reason": None, "val": {"val/accuracy": 0.5}}
    other = {}

    class TakenOver(Launcher):
        def launch(self, batch, initial_job_idx):
            other["lock"] = RunLock(Storage(str(tmp_path / "checkpoints/smoke/lost")), stale_seconds=0.0)
            other["lock"].record["host"] = "node-b"  # (in this process it would pass for a restarted one)
            other["lock"].acquire()
            return super().launch(batch, initial_job_idx)

    s = sweeper(3, TakenOver([Job(done)], [Job(done)], [Job(done)]))
    s.config = OmegaConf.create({
        "paths": {"checkpoint_dir": str(tmp_path / "checkpoints")},
        "storage": {"_target_": "goodput.storage.Storage", "_partial_": True},
        "run": {"lock_stale_seconds": 120},
    })  # fmt: skip
    mine = s._lock("smoke/lost")
    study = _study.open_study("lost", storage, "maximize", search(), explicit=True)
    with pytest.raises(LockLost, match="took over the run lock of .* on node-b"):
        s._run(study, space(*SPACE), ["experiment=smoke"], NoParent(), "lost")
    assert len(s.launcher.batches) == 1 and len(study.trials) == 1
    mine.release()
    other["lock"].release()


def test_a_stopped_trial_stops_the_search_and_the_relaunch_continues_its_run(storage):
    """A signal stops a trial (it commits a checkpoint, its summary says `preempted`): the search
    stops; the relaunch's first trial has its parameters and its run name, and n_trials, raised on
    the relaunch, counts the finished trials."""
    s = space(*SPACE)
    done = {"steps": 12, "preempted": None, "stop_reason": None, "val": {"val/accuracy": 0.5}}
    stopped = {**done, "steps": 4, "preempted": "SIGINT", "val": {"val/accuracy": 0.1}}
    first = Launcher([Job(done)], [Job(stopped)])
    study = _study.open_study("stopped", storage, "maximize", search(), explicit=True)
    assert sweeper(3, first)._run(study, s, ["experiment=smoke"], NoParent(), "stopped") is True
    assert not first.results  # two trials ran, the third was not asked
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.WAITING]

    again = Launcher([Job(done)], [Job(done)], [Job(done)])
    relaunch = optuna.load_study(study_name="stopped", storage=storage)
    assert sweeper(4, again)._run(relaunch, s, ["experiment=smoke"], NoParent(), "stopped") is False
    assert "run.name='stopped/trial-001'" in again.batches[0][0]  # the stopped trial's run, resumed
    assert [o for o in again.batches[0][0] if o.startswith("optim.")] == [
        o for o in first.batches[1][0] if o.startswith("optim.")
    ]
    assert (
        len(again.batches) == 3 and len(_study.counted(relaunch)) == 4
    )  # 1 + 3 (the stopped one not counted)


def test_a_refusal_ends_the_search_with_one_line_and_exit_2(monkeypatch, caplog):
    s = sweeper(3, Launcher())

    def refused(arguments):
        raise _study.SearchRefused("hydra.sweeper.study_name=x: the stored study searches something else")

    monkeypatch.setattr(s, "_sweep", refused)
    with pytest.raises(SystemExit) as e, caplog.at_level(logging.ERROR):
        s.sweep([])
    assert e.value.code == 2 and "study_name=x: the stored study" in caplog.text


def test_a_failed_trial_is_a_failed_mlflow_run_and_the_parent_run_is_continued(tmp_path):
    from mlflow.tracking import MlflowClient

    from hydra_plugins.goodput_optuna_sweeper._runs import ParentRun

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    config = OmegaConf.create({"mlflow": {"tracking_uri": uri, "experiment": "e", "artifact_location": None}})
    parent = ParentRun(config, "s", {"search": {"lr": "FloatDistribution(...)"}}, None)
    client = MlflowClient(uri)
    exp = client.get_run(parent.run_id).info.experiment_id
    opened = client.create_run(exp, run_name="s/trial-001/lr=0.1", tags={"mlflow.parentRunId": parent.run_id})
    parent.failed(1, "s/trial-001", {"lr": 0.1}, "RuntimeError: boom")  # its job opened a run, left RUNNING
    parent.failed(2, "s/trial-002", {"lr": 0.2}, "invalid config: lr")  # its job failed before opening one
    runs = {
        r.data.tags["goodput.optuna_trial"]: r
        for r in client.search_runs([exp])
        if r.info.run_id != parent.run_id
    }
    assert runs["1"].info.run_id == opened.info.run_id and runs["1"].info.status == "FAILED"
    assert runs["1"].data.tags["goodput.error"] == "RuntimeError: boom"
    made = runs["2"]
    assert (made.info.status, made.info.run_name, made.data.params) == (
        "FAILED",
        "s/trial-002",
        {"lr": "0.2"},
    )
    assert made.data.tags["mlflow.parentRunId"] == parent.run_id
    parent.finish({})
    again = ParentRun(config, "s", {"search": {"lr": "FloatDistribution(...)"}}, parent.run_id)  # a relaunch
    assert again.run_id == parent.run_id and client.get_run(parent.run_id).info.status == "RUNNING"
