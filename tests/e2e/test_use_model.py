"""Using a trained model through the entry points: scripts/evaluate.py on a 2-rank DCP checkpoint and
on a torch_save one, the test split, scripts/predict.py from its three sources, and run.init_from.

Two training runs serve the module (module fixtures): a 2-rank DDP `dcp_sync` run with an EMA that
it evaluates (on data with a test split), and a one-process `torch_save` run that logs its model to
MLflow (on the demo data, which has none). The scripts run in this process through their `main`,
except where the exit status and the one line are the claim."""

from __future__ import annotations

import csv
import io
import json
import os
import runpy
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from helpers import REPO, entry_env, run_train

from goodput.checkpoint.export import model_state
from goodput.checkpoint.layout import COMMIT, local_commits, parse_commit
from goodput.data.synthetic import make_dataset
from goodput.model import SmallCNN, model_sha256
from goodput.storage.remote import Storage

pytestmark = pytest.mark.slow


def script(name: str, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of scripts/<name>'s main(argv), in this process."""
    main = runpy.run_path(str(REPO / "scripts" / name))["main"]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def newest_commit(ckpt_dir: str) -> dict:
    step, path = local_commits(ckpt_dir)[-1]
    with open(os.path.join(path, COMMIT), "rb") as f:
        return parse_commit(f.read(), os.path.basename(path))


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """6 classes, 20 train / 5 val / 3 test images each."""
    root = str(tmp_path_factory.mktemp("shapes"))
    make_dataset(root, num_classes=6, train_per_class=20, val_per_class=5, image_size=16, test_per_class=3)
    return root


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, shapes):
    root = tmp_path_factory.mktemp("ddp")
    _, s = run_train(
        root, f"data.root={shapes}", "parallel=ddp", "checkpoint=dcp_sync", "trainer.ema_decay=0.8",
        "trainer.eval_on=ema", timeout=600,
    )  # fmt: skip
    return root, s


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    _, s = run_train(root, "checkpoint=torch_save", "mlflow.log_model=final")
    return root, s


def test_evaluate_a_2_rank_dcp_checkpoint_gives_the_runs_own_final_evaluation(ddp_run, monkeypatch):
    import mlflow

    root, s = ddp_run
    ck = s["checkpoint_dir"]
    rec = newest_commit(ck)
    assert (rec["backend"], rec["world_size"], rec["step"]) == ("dcp_sync", 2, 12)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{root}/mlflow.db"  # the run's own store: found from the checkpoint dir
    rc, out, err = script("evaluate.py", ck, "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got["weights"] == "ema" and got["step"] == 12  # what the run evaluated (trainer.eval_on)
    assert set(got) >= set(s["val"])
    for k, v in s["val"].items():
        assert got[k] == pytest.approx(v, rel=1e-5) if k == "val/loss" else got[k] == v, k
    # the weights it evaluated are the EMA's of that commit, by their digest
    ema = SmallCNN(num_classes=6, width=32)
    ema.load_state_dict(model_state(Storage(ck), rec, "ema"))
    assert got["model_sha256"] == model_sha256(ema) != s["model_sha256"]
    # and it is an MLflow run nested under the training run, with the same figures and the report
    client = mlflow.MlflowClient(uri)
    run = client.get_run(got["mlflow_run_id"])
    trained = client.get_run(s["mlflow_run_id"])
    assert run.data.tags["goodput.evaluates"] == s["mlflow_run_id"] == run.data.tags["mlflow.parentRunId"]
    assert run.info.experiment_id == trained.info.experiment_id and run.info.status == "FINISHED"
    assert run.data.tags["goodput.checkpoint"] == f"{ck}/step-000000012"
    assert (run.data.tags["goodput.checkpoint_step"], run.data.tags["goodput.weights"]) == ("12", "ema")
    assert {k: run.data.metrics[k] for k in s["val"]} == {k: got[k] for k in s["val"]}
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")}
    assert arts == {"evaluation/confusion_matrix.png", "evaluation/per_class.csv"}

    rc, out, err = script("evaluate.py", ck, "--weights", "model", "--json", "--no-mlflow")
    assert rc == 0, err
    assert json.loads(out)["model_sha256"] == s["model_sha256"]  # the trained weights this time


def test_the_test_split_is_evaluated_when_the_data_has_one(ddp_run, shapes):
    """18 test images (not the 30 of val/), and its accuracy is the share of them that
    predict.py, reading each file on its own, puts in their own folder's class."""
    root, s = ddp_run
    ck = s["checkpoint_dir"]
    rc, out, err = script("evaluate.py", ck, "--split", "test", "--json", "--no-mlflow")
    assert rc == 0, err
    got = json.loads(out)
    assert got["split"] == "test" and got["samples"] == 18 and "val/accuracy" not in got
    rc, out, err = script("predict.py", ck, os.path.join(shapes, "test"), "--weights", "ema")
    assert rc == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 18
    right = sum(r["class"] == os.path.basename(os.path.dirname(r["path"])) for r in rows)
    assert got["test/accuracy"] == right / 18


def test_evaluate_a_torch_save_checkpoint_and_a_split_the_data_lacks(single_run):
    root, s = single_run
    ck = s["checkpoint_dir"]
    rc, out, err = script("evaluate.py", ck, "--json", "--no-mlflow")
    assert rc == 0, err
    got = json.loads(out)
    assert newest_commit(ck)["backend"] == "torch_save" and got["model_sha256"] == s["model_sha256"]
    for k, v in s["val"].items():
        assert got[k] == pytest.approx(v, rel=1e-5) if k == "val/loss" else got[k] == v, k
    # the command line: one line naming the split, exit 2 (the demo data has no test/)
    p = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "evaluate.py"), ck, "--split", "test", "--no-mlflow"],
        cwd=REPO, env=entry_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().count("\n") == 0 and "has no test split" in p.stderr, p.stderr
    rc, _, err = script("evaluate.py", ck, "--step", "5", "--no-mlflow")
    assert rc == 2 and "step-000000005: not a committed checkpoint (committed steps: [12, 8])" in err


def test_predict_from_the_checkpoint_the_export_and_the_mlflow_model_agree(single_run, tmp_path, monkeypatch):
    from safetensors import safe_open

    from goodput.checkpoint.spec import ModelSpec
    from goodput.inference import decode

    root, s = single_run
    ck, images = s["checkpoint_dir"], os.path.join(s["config"]["data"]["root"], "val")
    export = str(tmp_path / "model.safetensors")
    monkeypatch.setattr(sys, "argv", ["inspect_checkpoint.py", ck, "--export", export])
    runpy.run_path(str(REPO / "scripts" / "inspect_checkpoint.py"), run_name="__main__")
    with safe_open(export, "pt") as f:
        meta = f.metadata()
    spec = ModelSpec.from_metadata(meta, export)  # class names, size, normalization, the model node
    assert (
        spec.node == {"_target_": "goodput.recipe.models.SmallCNN", "width": 32} and len(spec.classes) == 10
    )
    assert (spec.image_size, spec.mean, spec.std) == (16, [0.5] * 3, [0.25] * 3)

    outputs = {}
    for name, source in [("checkpoint", ck), ("export", export), ("mlflow", s["mlflow_model_uri"])]:
        rc, out, err = script(
            "predict.py", source, images, "--top-k", "3", "--tracking-uri", f"sqlite:///{root}/mlflow.db"
        )
        assert rc == 0, f"{name}: {err}"
        outputs[name] = list(csv.reader(io.StringIO(out)))
    assert outputs["checkpoint"] == outputs["export"] == outputs["mlflow"]
    header, *rows = outputs["checkpoint"]
    assert header == ["path", "class", "probability", "top3"] and len(rows) == 40  # 4 per class
    # the classes are those the checkpoint's weights give, by name
    model = SmallCNN(num_classes=10, width=32).eval()
    model.load_state_dict(model_state(Storage(ck), newest_commit(ck)))
    with torch.no_grad():
        probs = model(torch.stack([spec.transform()(decode(r[0])) for r in rows])).softmax(1)
    assert [r[1] for r in rows] == [spec.classes[i] for i in probs.argmax(1).tolist()]
    assert [r[2] for r in rows] == [f"{p:.6f}" for p in probs.max(1).values.tolist()]
    assert all(r[3].split(";")[0] == f"{r[1]}:{r[2]}" and r[3].count(";") == 2 for r in rows)


def test_init_from_starts_a_new_run_from_the_weights_and_a_relaunch_resumes_its_own(single_run, tmp_path):
    """With lr 0 nothing changes the weights: the new run's model is the source's, bit for bit.
    Killed at step 6, the relaunch resumes its own step 4 and never reads the source again (it is
    gone by then: re-initialising from it would fail)."""
    import shutil

    _, s = single_run
    source = str(tmp_path / "source")
    shutil.copytree(s["checkpoint_dir"], source)
    # a synchronous backend: the step-4 commit is whole before the kill at step 6 (dcp_async's may
    # still be in flight on a loaded machine, and then the relaunch has nothing of its own)
    cfg = [f"run.init_from={source}", "optim.optimizer.lr=0.0", "fault.kill_at_step=6"]
    cfg.append("checkpoint=torch_save")
    first, _ = run_train(tmp_path / "new", *cfg, expect_rc=-9)
    assert f"run.init_from: the model starts from {source}/step-000000012 (step 12)" in first.stderr
    shutil.rmtree(source)
    again, s2 = run_train(tmp_path / "new", *cfg)
    assert "not applied: this run resumed its own checkpoint (step 4)" in again.stderr
    assert s2["resumed_from_steps"] == [4] and s2["steps"] == 12 and s2["restarts"] == 1
    assert s2["model_sha256"] == s["model_sha256"]


def the_error(p, text: str) -> str:
    """The one line of a refused launch's output (the job's log on stdout, or a worker's on stderr)
    that says `text`, with no traceback anywhere."""
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out[-3000:]
    (line,) = [x for x in out.splitlines() if text in x]
    return line


def test_init_from_weights_that_do_not_fit_or_are_not_there_is_one_line_exit_2(single_run, tmp_path):
    _, s = single_run
    p, _ = run_train(tmp_path, f"run.init_from={s['checkpoint_dir']}", "model.width=16", expect_rc=2)
    line = the_error(p, "does not fit this run's model")
    assert "shapes differ (source vs this model): blocks.0.0.weight (32, 3, 3, 3) vs (16, 3, 3, 3)" in line
    assert f"its model record ({s['checkpoint_dir']}/step-000000012) differs: width 32 (this run: 16)" in line
    # a source that is not there: refused by the job before any worker (in this process: the job's
    # first phase is where it decides; scripts/train.py prints a UserError as one line, exit 2)
    from helpers import compose_train

    from goodput.checkpoint.export import SourceError
    from goodput.errors import UserError
    from goodput.run.job import prepare

    cfg = compose_train(
        ["experiment=smoke", f"paths.root={tmp_path / 'b'}", f"run.init_from={tmp_path}/none"]
    )
    with pytest.raises(
        SourceError, match=f"run.init_from={tmp_path}/none: {tmp_path}/none: no such directory"
    ):
        prepare(cfg, str(tmp_path / "b" / "run"))
    assert issubclass(SourceError, UserError)
    assert not (tmp_path / "b" / "mlflow.db").exists()  # refused before the MLflow run was opened
