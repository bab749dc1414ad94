"""Optuna searches on the entry point (`-m hparams_search=optuna`, experiment=smoke): a trial that
fails is a failed trial and the search goes on; a search killed mid-trial continues its study.
The study rules in-process: unit/test_search.py."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import time

import optuna
import pytest
import yaml
from helpers import run_train, start_train, train_cmd
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

SEARCH = ("-m", "hparams_search=optuna")
RUN_NAME, RESUMES, ERROR = "goodput.run_name", "goodput.resumes", "goodput.error"


def study(root) -> optuna.Study:
    storage = f"sqlite:///{root}/optuna.db"
    (name,) = optuna.get_all_study_names(storage)  # one search: one study, also after a relaunch
    return optuna.load_study(study_name=name, storage=storage)


def summaries(pattern: str) -> list[dict]:
    out = []
    for f in sorted(glob.glob(pattern)):
        with open(f) as fh:
            out.append(json.load(fh))
    return out


def mlflow_runs(root) -> tuple:
    """(the search's parent runs, the runs nested under the first)."""
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    (exp,) = [e for e in client.search_experiments() if e.name == "goodput"]
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("goodput.sweep") == "optuna"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    return client, parents, children


@pytest.mark.slow
def test_a_trial_that_fails_validation_is_failed_and_the_search_goes_on(tmp_path):
    """trainer.micro_batch_size=choice(3,4) on a global batch of 16: the trial that draws 3 fails its
    config check (it exited the whole sweep with code 2, its trial left RUNNING). Now: FAIL in Optuna
    with the reason, a FAILED MLflow run under the parent with its parameters, and the other trials
    run, each nested under the parent, the best their best."""
    p, _ = run_train(
        tmp_path,
        *SEARCH,
        "hydra.sweeper.n_trials=3",
        "trainer.max_steps=4",
        "trainer.micro_batch_size=choice(3,4)",
    )
    trials = study(tmp_path).trials
    micro = [t.params["trainer.micro_batch_size"] for t in trials]
    assert sorted(set(micro)) == [3, 4], f"the seeded sampler drew {micro}: pick a seed that draws both"
    assert [t.state for t in trials] == [TrialState.FAIL if m == 3 else TrialState.COMPLETE for m in micro]
    (bad,) = [t for t in trials if t.state == TrialState.FAIL]
    assert "trainer.micro_batch_size=3 must divide" in bad.user_attrs[ERROR]

    done = summaries(f"{tmp_path}/multirun/*/*/summary.json")
    ok = [t for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(t.value for t in ok) == sorted(s["val"]["val/accuracy"] for s in done)
    with open(glob.glob(f"{tmp_path}/multirun/*/optimization_results.yaml")[0]) as f:
        best = yaml.safe_load(f)
    assert (
        best["trials"] == 3 and best["complete"] == len(ok) and best["best_value"] == max(t.value for t in ok)
    )

    client, (parent,), children = mlflow_runs(tmp_path)
    assert parent.info.status == "FINISHED" and len(children) == 3
    by_trial = {int(r.data.tags["goodput.optuna_trial"]): r for r in children}
    failed = by_trial[bad.number]
    assert (
        failed.info.status == "FAILED" and "trainer.micro_batch_size=3" in failed.data.tags["goodput.error"]
    )
    assert failed.data.params["trainer.micro_batch_size"] == "3"
    assert {by_trial[t.number].info.run_id for t in ok} == {s["mlflow_run_id"] for s in done}
    assert all(by_trial[t.number].info.status == "FINISHED" for t in ok)
    values = {int(m.step): m.value for m in client.get_metric_history(parent.info.run_id, "trial_value")}
    assert values == {t.number: t.value for t in ok}


def cut_trial(root, max_steps: int) -> tuple[str, int] | None:
    """(run name, newest committed step) of a trial that has committed a checkpoint short of the
    end and written no summary yet, once an earlier trial has finished; None before."""
    jobs = {
        int(os.path.basename(os.path.dirname(f)).split("_")[0])
        for f in glob.glob(f"{root}/multirun/*/*/summary.json")
    }
    if 0 not in jobs:
        return None
    for commit in glob.glob(f"{root}/checkpoints/**/trial-[0-9][0-9][0-9]*/**/COMMIT.json", recursive=True):
        trial = re.search(r"/trial-(\d+)[^/]*/", commit)
        step = int(re.search(r"step-(\d+)", commit)[1])
        if trial and int(trial[1]) not in jobs and step < max_steps:
            return re.search(r"checkpoints/(.+/trial-\d+)", commit)[1], step
    return None


@pytest.mark.slow
def test_a_search_killed_mid_trial_continues_its_study(tmp_path):
    """SIGKILL of the whole search (its process group) while a trial trains, after an earlier trial
    finished; then the same command. The study is continued (one study, one MLflow parent run): the
    finished trials keep their numbers and values and are not run again, the cut-off trial is
    FAIL and continued by a trial with its parameters, from its checkpoint, and the search finishes
    n_trials counted trials with the best over all of them."""
    with open(tmp_path / "first.log", "w") as log:
        p = start_train(train_cmd(tmp_path, *SEARCH, "hydra.sweeper.n_trials=3"), log)
        try:
            deadline, cut = time.monotonic() + 900, None
            while cut is None and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
                cut = cut_trial(tmp_path, 12)
            assert cut is not None, (
                f"never saw a trial mid-run (rc {p.poll()}): {(tmp_path / 'first.log').read_text()[-3000:]}"
            )
            os.killpg(p.pid, signal.SIGKILL)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    run_name, step = cut
    before = {t.number: t for t in study(tmp_path).trials}
    (killed,) = [t for t in before.values() if t.user_attrs.get(RUN_NAME) == run_name]
    assert killed.state == TrialState.RUNNING
    finished = {n: t for n, t in before.items() if t.state == TrialState.COMPLETE}
    assert 0 in finished

    run_train(tmp_path, *SEARCH, "hydra.sweeper.n_trials=3", timeout=900)
    after = {t.number: t for t in study(tmp_path).trials}
    for n, t in finished.items():  # kept as they were
        assert (after[n].state, after[n].value, after[n].params) == (t.state, t.value, t.params)
    assert after[killed.number].state == TrialState.FAIL
    (resumed,) = [t for t in after.values() if t.user_attrs.get(RESUMES) == killed.number]
    assert resumed.state == TrialState.COMPLETE and resumed.params == killed.params
    assert resumed.user_attrs[RUN_NAME] == run_name
    counted = [t for n, t in after.items() if n != killed.number and t.state != TrialState.RUNNING]
    assert len(counted) == 3 and all(t.state == TrialState.COMPLETE for t in counted)

    sweeps = sorted(glob.glob(f"{tmp_path}/multirun/*/"))
    assert len(sweeps) == 2
    rerun = summaries(f"{sweeps[1]}*/summary.json")
    assert len(rerun) == 3 - len(finished)  # only the cut-off trial and the new ones ran
    names = {n: t.user_attrs[RUN_NAME] for n, t in finished.items()}
    assert not [s for s in rerun for name in names.values() if f"/{name}/" in s["checkpoint_dir"] + "/"]
    (cont,) = [s for s in rerun if f"/{run_name}/" in s["checkpoint_dir"] + "/"]
    assert cont["resumed_from_steps"] and step <= cont["resumed_from_steps"][0] < 12  # from its checkpoint

    with open(f"{sweeps[1]}optimization_results.yaml") as f:
        best = yaml.safe_load(f)
    assert best["trials"] == 3 and best["best_value"] == max(t.value for t in counted)
    client, parents, _ = mlflow_runs(tmp_path)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"  # continued, not a second one
    values = {int(m.step): m.value for m in client.get_metric_history(parents[0].info.run_id, "trial_value")}
    assert values == {t.number: t.value for t in counted}
