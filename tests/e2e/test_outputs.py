"""What a run leaves behind: the best checkpoint, early stopping, the exported and the logged model."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from helpers import REPO, check_config_change, ckpt_dir, compose_train, make_app, manager, run_train
from hydra import compose, initialize_config_dir

from goodput.checkpoint.layout import COMMIT, CommitError, parse_commit
from goodput.model import model_sha256
from goodput.monitor import Best, EarlyStopping
from goodput.run.job import AlreadyDone, prepare


def test_best_commit_survives_retention_and_restore(tmp_path, dist1):  # noqa: F811
    mgr = manager(tmp_path, "dcp_sync", dist1, keep_last=1, keep_best_by="val/accuracy")
    app, *_ = make_app(1)
    app.register("best", mgr.best)
    saved = []
    for step, acc in [(1, 0.2), (2, 0.5), (3, 0.4), (4, 0.3)]:
        mgr.observe({"val/accuracy": acc, "val/loss": 1.0}, step)
        if mgr.maybe_save(step, app, last=step == 4) is not None:  # no interval: a new best saves
            saved.append(step)
    mgr.wait()
    assert saved == [1, 2, 4]
    assert [r["step"] for r in mgr.committed()] == [4, 2]  # keep_last=1, plus the best
    rec2 = mgr.committed()[1]
    assert rec2["metric"] == {"val/accuracy": 0.5}
    assert rec2["best"] == {"by": "val/accuracy", "mode": "max", "step": 2, "value": 0.5}
    assert mgr.committed()[0]["best"]["step"] == 2
    expected = model_sha256(app.model)

    # a restart: the best so far comes back with the state, and the old best goes once it is beaten
    mgr2 = manager(tmp_path, "dcp_sync", dist1, keep_last=1, keep_best_by="val/accuracy")
    app2, *_ = make_app(2)
    app2.register("best", mgr2.best)
    rec, _ = mgr2.restore(app2, mgr2.committed())
    assert rec["step"] == 4 and model_sha256(app2.model) == expected
    assert (mgr2.best.step, mgr2.best.value) == (2, 0.5)
    mgr2.observe({"val/accuracy": 0.45}, 5)  # not better: no save
    assert mgr2.maybe_save(5, app2) is None
    mgr2.observe({"val/accuracy": 0.6}, 6)
    assert mgr2.maybe_save(6, app2) is not None
    mgr2.wait()
    assert [r["step"] for r in mgr2.committed()] == [6]
    mgr.close()
    mgr2.close()


@pytest.mark.parametrize("backend", ["torch_save", "dcp_sync"])
def test_keep_best_turned_on_later_resumes_the_older_checkpoint(tmp_path, dist1, backend):  # noqa: F811
    """A checkpoint made with keep_best_by off still loads once it is on (the best starts fresh);
    without the optional part the restore failed and the run would have started over."""
    mgr = manager(tmp_path, backend, dist1)
    app, *_ = make_app(1)
    mgr.save(3, app)
    mgr.wait()
    assert mgr.committed()[0]["parts"] == ["counter", "scheduler"]
    mgr2 = manager(tmp_path, backend, dist1, keep_best_by="val/loss")
    app2, *_ = make_app(2)
    app2.register("best", mgr2.best, missing="the best so far starts over")
    rec, skipped = mgr2.restore(app2, mgr2.committed())
    assert rec is not None and rec["step"] == 3 and skipped == []
    assert model_sha256(app2.model) == model_sha256(app.model) and mgr2.best.step is None
    mgr2.observe({"val/loss": 0.5}, 4)
    mgr2.save(4, app2)
    mgr2.wait()
    mgr3 = manager(tmp_path, backend, dist1, keep_best_by="val/loss")
    app3, *_ = make_app(3)
    app3.register("best", mgr3.best, missing="the best so far starts over")
    assert mgr3.restore(app3, mgr3.committed())[0]["step"] == 4 and (mgr3.best.step, mgr3.best.value) == (
        4,
        0.5,
    )
    for m in (mgr, mgr2, mgr3):
        m.close()


def test_min_mode_and_bad_best_records(tmp_path):
    b = Best("val/loss", None)
    assert b.mode == "min"
    assert [b.observe({"val/loss": v}, s) for s, v in enumerate([2.0, 1.5, 1.7, float("nan"), 1.2])] == [
        True, True, False, False, True,
    ]  # fmt: skip
    assert (b.step, b.value) == (4, 1.2)
    with pytest.raises(KeyError, match="val/loss"):
        b.observe({"val/accuracy": 1.0}, 5)
    rec = {"step": 3, "format": "dcp", "world_size": 1, "checksum": "xxh3_128", "files": {"a": {}}}
    good = {"by": "val/loss", "mode": "min", "step": 3, "value": 0.5}
    ok = {
        **rec,
        "files": {"a": {"bytes": 1, "xxh3_128": "0" * 32}},
        "best": good,
        "metric": {"val/loss": 0.5},
    }
    assert parse_commit(json.dumps(ok).encode(), "step-000000003")["best"] == good
    for bad in ({"best": {"step": "3"}}, {"best": 3}, {"stop_reason": 1}, {"best": {**good, "value": "0.5"}},
                {"best": {**good, "by": None}}, {"best": {"step": 3}}, {"metric": "val/loss"},
                {"metric": {"val/loss": [1]}}, {"parts": "best"}):  # fmt: skip
        with pytest.raises(CommitError, match="best|stop_reason|metric|parts"):
            parse_commit(json.dumps({**rec, **bad}).encode(), "step-000000003")


def test_early_stopping_counts_evaluations_and_resumes_mid_count():
    seq = [1.0, 0.8, 0.79, 0.81, 0.7, 0.75, 0.72, 0.74]  # val/loss per evaluation

    def run(es, values, first=0):
        for i, v in enumerate(values, first):
            if es.update({"val/loss": v}, i):
                return i
        return None

    # min_delta 0.02: 0.79 is no real improvement, 0.7 is; then three without one
    assert run(EarlyStopping(3, "val/loss", 0.02, None), seq) == 7
    assert run(EarlyStopping(2, "val/loss", 0.0, None), seq) == 6
    assert run(EarlyStopping(None, "val/loss", 0.0, None), seq) is None
    a = EarlyStopping(3, "val/loss", 0.02, None)
    assert run(a, seq[:5]) is None
    b = EarlyStopping(3, "val/loss", 0.02, None)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # through the checkpoint's JSON
    assert run(b, seq[5:], first=5) == 7


CLASSES = ["disc", "ring", "square", "triangle"]


def _spec(c):
    """The model record of a 4-class run of config `c` (what build.Trainer records from the data)."""
    from goodput.checkpoint.spec import ModelSpec

    return ModelSpec.of(c, CLASSES, 16)


def _mlflow_run(tmp_path, experiment: str, artifact_location: str, *overrides) -> tuple:
    """A checked config that logs the final model (SmallCNN of width 8) to a fresh MLflow run, and the run."""
    from omegaconf import OmegaConf

    from goodput.config import validate
    from goodput.tracking import start_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = start_run(uri, experiment, "r", {}, None, artifact_location)
    c = OmegaConf.to_container(compose_train([
        f"paths.root={tmp_path}", "experiment=smoke", "model.width=8", "mlflow.log_model=final",
        "mlflow.registered_model_name=goodput-test", *overrides,
    ]), resolve=True)  # fmt: skip
    c["mlflow"]["tracking_uri"] = uri
    return validate(c), run_id


def test_logged_model_reloads_with_the_same_outputs_and_a_broken_store_only_warns(tmp_path, dist1, caplog):  # noqa: F811
    import mlflow
    import mlflow.pytorch

    from goodput import publish

    mgr = manager(tmp_path, "dcp_sync", dist1)
    app, *_ = make_app(3)
    mgr.save(5, app)
    mgr.wait()
    x = torch.randn(4, 3, 16, 16)
    c, run_id = _mlflow_run(tmp_path, "ok", str(tmp_path / "artifacts"))
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.MlflowClient(c.mlflow.tracking_uri).log_metric(run_id, "val/accuracy", 0.75, step=5)
    uri = publish.log_model(c, run_id, mgr, x[:2], _spec(c))
    assert uri is not None and uri.startswith("models:/")
    # the run's store is not left in the environment for the next job of this process (a sweep's)
    assert os.environ.get("MLFLOW_TRACKING_URI") == before
    mlflow.set_tracking_uri(c.mlflow.tracking_uri)
    loaded = mlflow.pytorch.load_model(uri)
    app.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), app.model(x))  # a batch of 4: the batch dimension stayed free
    info = mlflow.get_logged_model(uri.rsplit("/", 1)[-1])
    assert info.tags["model_sha256"] == model_sha256(app.model) and info.tags["checkpoint_step"] == "5"
    # a torch module (the torch.export program's .eval() raised NotImplementedError), with its record
    assert isinstance(loaded, torch.nn.Module) and loaded.train() is loaded and loaded.training
    assert loaded.eval() is loaded and not loaded.training and loaded.to("cpu", torch.float64) is loaded
    want = app.model.state_dict()
    got = loaded.to(torch.float32).state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    node = {"_target_": "goodput.recipe.models.SmallCNN", "width": 8}
    record = {"node": node, "classes": CLASSES, "image_size": 16, "mean": [0.5] * 3, "std": [0.25] * 3,
              "task": c.task, "resize_size": None}  # fmt: skip
    assert loaded.goodput == record
    assert mlflow.models.get_model_info(uri).metadata == {"goodput": record}
    version = mlflow.MlflowClient().get_registered_model("goodput-test").latest_versions[0]
    assert version.run_id == run_id and mlflow.pytorch.load_model(f"models:/goodput-test/{version.version}")
    # what MLflow's own log_model gives the model's page: its versions, the metrics at its step, who
    listed = [{"name": "goodput-test", "version": version.version}]
    assert json.loads(info.tags["mlflow.modelVersions"]) == listed
    assert [(m.key, m.value, m.step) for m in info.metrics] == [("val/accuracy", 0.75, 5)]
    assert "mlflow.user" in info.tags and str(info.status) == "READY"

    (tmp_path / "not-a-dir").write_text("")  # an artifact store that cannot be written
    c, run_id = _mlflow_run(tmp_path, "broken", str(tmp_path / "not-a-dir" / "artifacts"))
    with caplog.at_level(logging.WARNING, logger="goodput.publish"):
        assert publish.log_model(c, run_id, mgr, x[:2], _spec(c)) is None
    assert "could not log the model of step 5 to MLflow" in caplog.text
    mgr.close()


def test_an_upload_abandoned_past_its_bound_finishes_in_its_own_runs_store(tmp_path, dist1, monkeypatch):  # noqa: F811
    """The model's upload outlives log_model's bound (a slow artifact store); meanwhile the process
    points MLflow at another store, as the next job of a -m sweep does. What the abandoned upload
    still writes (the model's status, the run's tags, the registered version) goes to its own run's
    store, and nothing to the other one (MLflow's fluent API resolves the process-global URI anew
    at each call: the rest of the upload landed in the next job's store, or made ./mlflow.db)."""
    import threading

    import mlflow
    from mlflow import MlflowClient

    from goodput import publish

    mgr = manager(tmp_path, "dcp_sync", dist1)
    app, *_ = make_app(3)
    mgr.save(5, app)
    mgr.wait()
    c, run_id = _mlflow_run(tmp_path, "slow", str(tmp_path / "artifacts"))
    uploading, release = threading.Event(), threading.Event()
    upload = MlflowClient.log_model_artifacts

    def slow_upload(self, *args, **kwargs):
        uploading.set()
        assert release.wait(60)
        return upload(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_model_artifacts", slow_upload)
    assert publish.log_model(c, run_id, mgr, torch.randn(2, 3, 16, 16), _spec(c), timeout_s=0.5) is None
    assert uploading.wait(60)  # given up before the upload ends
    other = tmp_path / "next-job"
    other.mkdir()
    monkeypatch.chdir(other)  # where MLflow's default store (./mlflow.db) would be made
    mlflow.set_tracking_uri(f"sqlite:///{other}/mlflow.db")
    release.set()
    for th in [t for t in threading.enumerate() if t.name.startswith("mlflow: logging the model")]:
        th.join(60)
        assert not th.is_alive()
    assert os.listdir(other) == []  # the other store was never even opened
    client = MlflowClient(c.mlflow.tracking_uri)
    tags = client.get_run(run_id).data.tags
    assert tags["model.checkpoint_step"] == "5" and tags["model.uri"].startswith("models:/")
    model = client.get_logged_model(tags["model.uri"].rsplit("/", 1)[-1])
    assert str(model.status) == "READY" and model.source_run_id == run_id
    assert client.get_registered_model("goodput-test").latest_versions[0].run_id == run_id
    mgr.close()


@pytest.mark.slow
def test_best_early_stopping_and_the_logged_model_through_the_entry_point(tmp_path):
    """One config, run uninterrupted and killed + relaunched: both stop early at the same step with
    the same best checkpoint, kept by retention; a relaunch of the stopped run says it is complete."""
    cfg = ["trainer.max_steps=60", "trainer.eval_every_n_steps=2", "checkpoint.every_n_steps=4",
           "checkpoint.keep_last=1", "checkpoint.keep_best_by=val/accuracy", "checkpoint=dcp_sync",
           "trainer.early_stopping_patience=3", "trainer.early_stopping_by=val/loss",
           "trainer.early_stopping_min_delta=0.005", "mlflow.log_model=best"]  # fmt: skip
    _, ref = run_train(tmp_path / "ref", *cfg)
    assert ref["stop_reason"] == "early_stopping" and 0 < ref["steps"] < 60, ref["steps"]
    assert ref["best_step"] is not None and ref["best_value"] is not None
    ck = ckpt_dir(tmp_path / "ref")
    kept = sorted(n for n in os.listdir(ck) if n.startswith("step-"))
    with open(ck / kept[-1] / COMMIT) as f:
        newest = json.load(f)
    assert newest["stop_reason"] == "early_stopping" and newest["step"] == ref["steps"]
    assert f"step-{ref['best_step']:09d}" in kept  # retention (keep_last=1) kept the best
    with open(ck / f"step-{ref['best_step']:09d}" / COMMIT) as f:
        assert json.load(f)["metric"] == {"val/accuracy": ref["best_value"]}

    # the best commit's weights, logged as an MLflow model: loads back with the same outputs
    import mlflow
    import mlflow.pytorch

    from goodput.checkpoint.export import model_state
    from goodput.model import SmallCNN
    from goodput.storage.remote import Storage

    best = SmallCNN(num_classes=10, width=32).eval()
    with open(ck / f"step-{ref['best_step']:09d}" / COMMIT) as f:
        rec = parse_commit(f.read().encode(), f"step-{ref['best_step']:09d}")
    best.load_state_dict(model_state(Storage(str(ck)), rec))
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'ref'}/mlflow.db")
    logged = mlflow.pytorch.load_model(ref["mlflow_model_uri"])
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(logged(x), best(x))
    tags = mlflow.get_logged_model(ref["mlflow_model_uri"].rsplit("/", 1)[-1]).tags
    assert tags["checkpoint_step"] == str(ref["best_step"]) and tags["model_sha256"] == model_sha256(best)

    # what each evaluation logged, and the final evaluation's files
    client = mlflow.MlflowClient()
    history = client.get_metric_history(ref["mlflow_run_id"], "val/top5")
    assert [m.step for m in history] == list(range(2, ref["steps"] + 1, 2))  # every evaluation
    metrics = client.get_run(ref["mlflow_run_id"]).data.metrics
    assert {"val/loss", "val/accuracy", "val/top5", "val/class/disc"} <= set(metrics)
    assert metrics["val/top5"] == ref["val"]["val/top5"] >= ref["val"]["val/accuracy"]
    arts = {a.path for a in client.list_artifacts(ref["mlflow_run_id"], "evaluation")}
    assert arts == {"evaluation/confusion_matrix.png", "evaluation/per_class.csv"}

    kill_at = ref["steps"] - 3  # after at least one commit, before the stop
    fast = "mlflow.log_model=none"  # the logged model is checked above
    run_train(tmp_path / "kill", *cfg, fast, f"fault.kill_at_step={kill_at}", expect_rc=-9)
    _, s = run_train(tmp_path / "kill", *cfg, fast, f"fault.kill_at_step={kill_at}")
    assert s["restarts"] == 1 and s["resumed_from_steps"]
    for k in ("steps", "stop_reason", "best_step", "best_value", "model_sha256", "val"):
        assert s[k] == ref[k], k

    # the relaunch of the stopped run (in this process: the job's first phase is where it decides)
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        again = compose("train", overrides=["experiment=smoke", f"paths.root={tmp_path / 'kill'}", *cfg])
    with pytest.raises(
        AlreadyDone, match=f"is complete: it stopped at step {ref['steps']} \\(early_stopping"
    ):
        prepare(again, str(tmp_path / "again"))


def test_mlflow_ui_opens_the_runs_table_of_the_training_experiment(tmp_path, monkeypatch, capsys):
    """MLflow 3.17's UI shows an experiment in its GenAI view unless the URL says
    workflowType=machine_learning (seen in a headless Chromium: docs/mlflow-runs-table.png); the
    experiment is also tagged as a training one (what the UI reads with its workflow switch off)."""
    import runpy
    import sys

    from mlflow.tracking import MlflowClient

    from goodput.tracking import KIND_TAG, KIND_TRAINING, start_run

    store = tmp_path / "mlflow.db"
    start_run(f"sqlite:///{store}", "goodput", "r", {}, None, str(tmp_path / "a"))
    exp = MlflowClient(f"sqlite:///{store}").get_experiment_by_name("goodput")
    assert exp.tags[KIND_TAG] == KIND_TRAINING
    monkeypatch.setattr(sys, "argv", ["mlflow_ui.py", "--store", str(store), "--print-url"])
    runpy.run_path(str(REPO / "scripts" / "mlflow_ui.py"), run_name="__main__")
    want = f"http://127.0.0.1:5000/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
    assert want in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["torch_save", "dcp_sync"])
def test_eval_on_ema_exports_and_logs_the_ema_weights(tmp_path, dist1, backend):  # noqa: F811
    """trainer.eval_on=ema evaluates the EMA: the exported and the logged model must be the EMA too."""
    import mlflow
    import mlflow.pytorch

    from goodput import publish
    from goodput.checkpoint.export import ExportError, model_state
    from goodput.run.step import make_ema

    mgr = manager(tmp_path, backend, dist1)
    app, *_ = make_app(3)
    ema = make_ema(app.model, 0.5)
    with torch.no_grad():  # the EMA a few updates behind: its weights differ from the model's
        for p in app.model.parameters():
            p.add_(1.0)
    ema.update_parameters(app.model)  # the first update copies
    with torch.no_grad():
        for p in app.model.parameters():
            p.add_(1.0)
    ema.update_parameters(app.model)
    app.register_module("ema", ema)
    mgr.save(5, app)
    mgr.wait()
    rec = mgr.committed()[0]
    got = model_state(mgr.storage, rec, "ema")
    want = ema.module.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert model_sha256(ema.module) != model_sha256(app.model)

    if backend == "dcp_sync":  # (logging to MLflow takes seconds: one backend is enough for it)
        x = torch.randn(4, 3, 16, 16)
        c, run_id = _mlflow_run(
            tmp_path, "ema", str(tmp_path / "artifacts"), "trainer.ema_decay=0.5", "trainer.eval_on=ema"
        )
        uri = publish.log_model(c, run_id, mgr, x[:2], _spec(c))
        assert uri is not None
        mlflow.set_tracking_uri(c.mlflow.tracking_uri)
        loaded = mlflow.pytorch.load_model(uri)
        ema.module.eval()
        with torch.no_grad():
            assert torch.equal(loaded(x), ema.module(x))
        tags = mlflow.get_logged_model(uri.rsplit("/", 1)[-1]).tags
        assert tags["model_sha256"] == model_sha256(ema.module) and tags["eval_on"] == "ema"

    mgr2 = manager(tmp_path / "no-ema", backend, dist1)  # a run without the EMA: said, not a KeyError
    mgr2.save(1, make_app(4)[0])
    mgr2.wait()
    with pytest.raises(ExportError, match="trainer.ema_decay"):
        model_state(mgr2.storage, mgr2.committed()[0], "ema")
    mgr.close()
    mgr2.close()


def test_a_monitored_top_k_that_evaluation_never_logs_fails_at_config_time():
    """keep_best_by / early_stopping_by = val/top<k> must be the top-k evaluation logs; else the run
    trained up to its first evaluation and died there on a KeyError."""

    from omegaconf import OmegaConf

    from goodput.config import monitors_logged, validate
    from goodput.recipe.task import Classification

    c = OmegaConf.to_container(compose_train(["paths.root=/x", "experiment=smoke"]), resolve=True)
    logs = "is not a metric every evaluation logs: task Classification logs val/loss, val/accuracy, val/top5"
    for change, message in [
        ({"checkpoint": {"keep_best_by": "val/top3"}}, f"checkpoint.keep_best_by=val/top3 {logs}"),
        # (trainer.eval_top_k reaches the task through its interpolation: task.top_k here, resolved)
        ({"checkpoint": {"keep_best_by": "val/top3"}, "task": {**c["task"], "top_k": 3}}, None),
        ({"checkpoint": {"keep_best_by": "val/top5"}}, None),
        ({"checkpoint": {"keep_best_by": "val/macro_f1"}}, f"checkpoint.keep_best_by=val/macro_f1 {logs}"),
        ({"trainer": {"early_stopping_patience": 2, "early_stopping_by": "val/top2",
                      "eval_every_n_steps": 5}}, f"trainer.early_stopping_by=val/top2 {logs}"),
        ({"trainer": {"early_stopping_by": "val/top2"}}, None),  # early stopping off: not watched
    ]:  # fmt: skip
        check_config_change(c, change, message)
    assert compose_train(["paths.root=/x", "trainer.eval_top_k=3"]).task.top_k == 3
    # once the data is listed (build.Trainer): 4 classes log no top-k unless eval_top_k asks for one
    c["checkpoint"]["keep_best_by"] = "val/top5"
    typed = validate(c)
    task = Classification(torch.nn.CrossEntropyLoss())
    assert (
        "logs val/loss, val/accuracy with 4 classes"
        in monitors_logged(task, typed.trainer, typed.checkpoint, 4)[0]
    )
    assert monitors_logged(task, typed.trainer, typed.checkpoint, 10) == []


def test_a_search_objective_no_evaluation_logs_fails_before_any_trial():
    """hydra.sweeper.metric names summary.json's `val` entry each trial returns: a typo made every
    trial 'return no metric' and the whole search ran without an objective."""
    from hydra_plugins.goodput_optuna_sweeper.sweeper import OptunaSweeper, objective_error

    for ok in ("val/accuracy", "val/loss", "val/top5", "val/class/circle"):
        assert OptunaSweeper(metric=ok).metric == ok
    for bad in ("accuracy", "train/loss"):
        with pytest.raises(ValueError, match="hydra.sweeper.metric must be"):
            OptunaSweeper(metric=bad)
    classification = compose_train(["paths.root=/x"]).task
    multilabel = compose_train(["paths.root=/x", "task=multilabel"]).task
    for ok in ("val/accuracy", "val/loss", "val/top5", "val/class/circle"):
        assert objective_error(ok, classification) is None
    assert objective_error("val/acc", classification).startswith(
        "hydra.sweeper.metric=val/acc is not a metric"
    )
    assert "val/mAP" in objective_error("val/map", multilabel)
    assert objective_error("val/mAP", multilabel) is None and objective_error("val/mAP", classification)


def test_top_k_end_to_end_where_it_differs_from_top_1(smoke_reference):
    """summary.json's val/top5 and val/accuracy are what the final weights score on val/, counted
    here with torch.topk on the same pipeline, on a run where they differ (top-k computed as top-1,
    or any k, would be caught: `top5 >= accuracy` alone lets that through)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from goodput.checkpoint.commits import Commits
    from goodput.checkpoint.export import model_state
    from goodput.config import validate
    from goodput.data.loader import eval_loader
    from goodput.model import SmallCNN
    from goodput.storage.remote import Storage

    s = smoke_reference("dcp_sync")
    store = Storage(s["checkpoint_dir"])
    model = SmallCNN(num_classes=10, width=32)
    model.load_state_dict(model_state(store, Commits(store).committed()[0]))
    model.eval()
    root = Path(s["checkpoint_dir"]).parents[1]  # paths.root: <root>/checkpoints/<run>
    c = validate(
        OmegaConf.to_container(compose_train(["experiment=smoke", f"paths.root={root}"]), resolve=True)
    )
    hits = {1: 0, 5: 0}
    n = 0
    with torch.no_grad():
        for batch in eval_loader(c.data, Storage(c.data.root), 16, 0, 1, torch.device("cpu"), c.augment):
            keep = batch["label"] >= 0
            logits, y = model(batch["image"][keep]), batch["label"][keep]
            for k in hits:
                hits[k] += int((logits.topk(k, dim=1).indices == y[:, None]).any(dim=1).sum())
            n += len(y)
    assert n == 40 and hits[5] > hits[1]  # a case where top-5 is not top-1
    assert s["val"]["val/accuracy"] == hits[1] / n
    assert s["val"]["val/top5"] == hits[5] / n
