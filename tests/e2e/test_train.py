"""The real entry point on the smoke experiment: summary, determinism, MLflow, sweeps, resume rules."""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import REPO, ckpt_dir, latest_summary, run_train
from mlflow.tracking import MlflowClient

SUMMARY_KEYS = {
    "steps", "final_loss", "val_accuracy", "model_sha256", "sample_order_sha256",
    "restarts", "resumed_from_steps", "goodput", "mlflow_run_id",
}  # fmt: skip


def test_smoke_run_writes_summary_and_mlflow(tmp_path):
    p, s = run_train(tmp_path)
    assert set(s) >= SUMMARY_KEYS
    assert s["steps"] == 12 and s["restarts"] == 0 and s["resumed_from_steps"] == []
    assert len(s["model_sha256"]) == 64 and len(s["sample_order_sha256"]) == 64
    assert s["final_loss"] == s["final_loss"] and s["final_loss"] > 0  # not NaN
    assert 0.0 <= s["val_accuracy"] <= 1.0
    g = s["goodput"]
    assert (
        0 < g["goodput"] < 1 and g["productive_seconds"] > 0 and g["wall_seconds"] >= g["productive_seconds"]
    )
    assert "demo data not found: generating it" in p.stderr + p.stdout
    assert "mlflow.db" in p.stderr + p.stdout  # says where the store is

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(s["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["trainer.max_steps"] == "12" and params["choice.checkpoint"] == "dcp_async"
    assert params["choice.data"] == "cached" and params["choice.experiment"] == "smoke"
    for key in ("train/loss", "train/lr", "perf/step_seconds", "perf/fetch_seconds", "perf/images_per_second",
                "val/accuracy", "ckpt/blocking_seconds", "ckpt/total_seconds", "ckpt/bytes",
                "goodput/goodput", "data/cache_hits", "data/cache_misses"):  # fmt: skip
        assert key in run.data.metrics, key
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 6  # every 2 steps
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "summary.json" in arts and "hydra" in arts


def test_same_seed_same_result_other_seed_differs(tmp_path, smoke_reference):
    a = smoke_reference("dcp_sync")
    _, b = run_train(tmp_path / "b", "checkpoint=dcp_sync")
    _, c = run_train(tmp_path / "c", "checkpoint=dcp_sync", "seed=7")
    assert a["model_sha256"] == b["model_sha256"]
    assert a["sample_order_sha256"] == b["sample_order_sha256"]
    assert c["model_sha256"] != a["model_sha256"]
    assert c["sample_order_sha256"] != a["sample_order_sha256"]


def test_multirun_sweep_makes_two_runs(tmp_path):
    """The README's headline sweep is over a key that is not an identity key (both jobs train the
    same thing, so the same digest): each job still gets its own run, by its overrides' suffix."""
    p, _ = run_train(tmp_path, "-m", "checkpoint=dcp_sync,torch_save")
    summaries = glob.glob(f"{tmp_path}/multirun/**/summary.json", recursive=True)
    assert len(summaries) == 2
    ids = {json.loads(Path(f).read_text())["mlflow_run_id"] for f in summaries}
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("goodput").experiment_id])
    assert {r.info.run_id for r in runs} == ids and len(ids) == 2
    # each sweep job has its own checkpoints: the second job must not resume the first one's
    jobs = sorted(os.listdir(ckpt_dir(tmp_path)))
    assert jobs == ["checkpoint=dcp_sync", "checkpoint=torch_save"]
    assert {r.info.run_name for r in runs} == {f"{ckpt_dir(tmp_path).name}/{j}" for j in jobs}
    # The jobs run one after the other in one process: the second one's clock starts at its own
    # start, not at the process's (which would charge it the whole first job). The first job's
    # wall time also holds the imports and the demo data it generated.
    job = {("torch_save" in f): json.loads(Path(f).read_text())["goodput"] for f in summaries}
    assert job[True]["wall_seconds"] < job[False]["wall_seconds"]


@pytest.mark.slow
def test_a_refused_job_fails_alone_in_a_sweep(tmp_path):
    """-m with a job whose config is refused: that job fails (its sys.exit(2) used to end the whole
    sweep, the jobs after it never ran), the others run, and the sweep exits 1 at the end with the
    refusal in one line, naming the job (Hydra's rule for a failed job)."""
    p, _ = run_train(tmp_path, "-m", "trainer.micro_batch_size=3,4", "trainer.max_steps=2", expect_rc=1)
    out = p.stdout + p.stderr
    assert "job 0 (trainer.micro_batch_size=3): invalid config:" in out and "Traceback" not in out
    (ran,) = glob.glob(f"{tmp_path}/multirun/*/1_trainer.micro_batch_size=4/summary.json")
    assert json.loads(Path(ran).read_text())["steps"] == 2


def test_relaunch_of_finished_run_says_so_and_exits_0(tmp_path, smoke_reference):
    finished = Path(smoke_reference("dcp_sync")["checkpoint_dir"]).parents[1]  # its paths.root
    shutil.copytree(finished, tmp_path, symlinks=True, dirs_exist_ok=True)
    p, _ = run_train(tmp_path, "checkpoint=dcp_sync")
    assert "is complete: it reached step 12" in p.stderr + p.stdout


def test_resume_none_refuses_to_overwrite_unless_asked(tmp_path):
    run_train(tmp_path, "trainer.max_steps=4")
    p, _ = run_train(tmp_path, "run.resume=none", expect_rc=2)
    assert "already has checkpoints" in p.stderr + p.stdout and "run.overwrite=true" in p.stderr + p.stdout
    # a sweep job's run lives in its sweep's run dir (run.name/<overrides>): it is another run's
    job = ckpt_dir(tmp_path) / "checkpoint=dcp_sync"
    (job / "attempts").mkdir(parents=True)
    (job / "attempts" / "0000.json").write_text("{}")
    (job / "step-000000004").mkdir()
    p, s = run_train(tmp_path, "run.resume=none", "run.overwrite=true")
    assert s["resumed_from_steps"] == [] and s["steps"] == 12
    assert (job / "attempts" / "0000.json").exists() and (job / "step-000000004").is_dir()
    assert "keeping" in p.stderr + p.stdout and "checkpoint=dcp_sync, another run's" in p.stderr + p.stdout


def test_resume_from_explicit_path_supersedes_the_newer_lineage(tmp_path, smoke_reference):
    # commits 4, 8 and 12 (the same schedule as the reference: smoke's cosine decays over max_steps)
    run_train(tmp_path, "checkpoint=dcp_sync", "checkpoint.keep_last=3")
    ck = ckpt_dir(tmp_path)
    p, s = run_train(
        tmp_path, "checkpoint=dcp_sync", "checkpoint.keep_last=3", f"run.resume={ck}/step-000000004"
    )
    assert s["resumed_from_steps"] == [4]
    assert s["model_sha256"] == smoke_reference("dcp_sync")["model_sha256"]
    # the old step 8 was moved aside, not left to win the next auto-resume or to starve retention
    names = sorted(os.listdir(ck))
    assert any(n.startswith("step-000000008.superseded-") for n in names)
    assert "step-000000012" in names and "step-000000008" in names  # this lineage's own commits
    p, _ = run_train(
        tmp_path, "checkpoint=dcp_sync", f"run.resume={tmp_path}/elsewhere/step-000000004", expect_rc=2
    )
    assert "not a step dir of checkpoint.dir" in p.stdout + p.stderr


def test_changed_dataset_stops_the_resume_with_a_clear_error(tmp_path):
    run_train(tmp_path, "checkpoint=dcp_sync", "trainer.max_steps=4")
    victim = sorted((tmp_path / "remote" / "data").rglob("train/*/*.jpg"))[0]
    victim.unlink()
    p, s = run_train(tmp_path, "checkpoint=dcp_sync", expect_rc=2)
    out = p.stdout + p.stderr
    assert "changed since the checkpoint" in out and "had 200 training files, now 199" in out
    assert "starting from scratch" not in out
    assert s["steps"] == 4  # the newest summary is still the first run's: nothing trained


def test_a_class_added_to_the_data_stops_the_resume_instead_of_starting_over(tmp_path):
    """Own data that gained a class keeps the run's name (data.root is the same path): its head no
    longer fit, every commit failed DCP's plan alike, the commits were moved aside and the run
    trained from step 0 under its old name. Now every rank stops with both class lists, exit 2."""
    from goodput.data.synthetic import make_dataset

    data = tmp_path / "mine"
    make_dataset(str(data), num_classes=3, train_per_class=8, val_per_class=2, image_size=16)
    run_train(tmp_path, f"data.root={data}", "trainer.max_steps=4")
    before = sorted(os.listdir(ckpt_dir(tmp_path)))
    for split in ("train", "val"):
        shutil.copytree(data / split / "disc", data / split / "zebra")
    p, s = run_train(tmp_path, f"data.root={data}", "trainer.max_steps=8", expect_rc=2)
    out = p.stdout + p.stderr
    assert "cannot continue this run: its model was trained on the classes 3 (disc, square, triangle), " \
        "the data has 4 (disc, square, triangle, zebra)" in out, out[-3000:]  # fmt: skip
    assert "starting from scratch" not in out and "Traceback" not in out, out[-3000:]
    assert sorted(os.listdir(ckpt_dir(tmp_path))) == before  # nothing moved aside, nothing written
    assert s["steps"] == 4


# Through the entry point: exit 2, one line, nothing made. The other refusals of validate() go the
# same way; unit/test_config.py checks their messages from the same overrides in-process.
@pytest.mark.parametrize(
    "override, message",
    [
        ("data.root=/nonexistent/data", "/nonexistent/data has no train/ folder"),  # not validate's
        # #34: both failed after the demo data was made (the optimizer's traceback, the build's check)
        ("optim.optimizer.lr=-0.1 checkpoint.keep_best_by=val/top5 demo_data.num_classes=3",
         "optim.optimizer.lr=-0.1: Invalid learning rate | checkpoint.keep_best_by=val/top5 is not a metric"),
        ("parallel=hsdp parallel.nproc_per_node=4 parallel.oversubscribe=true parallel.shard_size=3",
         "parallel.shard_size=3 does not divide the world size 4"),
    ],
)  # fmt: skip
def test_bad_config_fails_before_work(tmp_path, override, message):
    p, s = run_train(tmp_path, *override.split(), expect_rc=2)
    for part in message.split(" | "):
        assert part in p.stderr + p.stdout
    assert "Traceback" not in p.stderr + p.stdout
    assert s is None and not (tmp_path / "checkpoints").exists()
    assert not (tmp_path / "remote").exists()  # no demo data made


def test_unknown_option_is_hydras_error(tmp_path):
    p, _ = run_train(tmp_path, "checkpoint=nope", expect_rc=1)
    assert "Could not find 'checkpoint/nope'" in p.stderr and "torch_save" in p.stderr


def test_make_dataset_script(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "scripts/make_dataset.py",
            "--root",
            str(tmp_path / "d"),
            "--num-classes",
            "3",
            "--train-per-class",
            "4",
            "--val-per-class",
            "2",
            "--image-size",
            "16",
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "12 train" in out.stdout
    assert (
        len(glob.glob(f"{tmp_path}/d/train/*/*.jpg")) == 12
        and len(glob.glob(f"{tmp_path}/d/val/*/*.jpg")) == 6
    )
    assert latest_summary(tmp_path) is None
