"""Run identity and honest run states on the entry point, in the order a newcomer meets them: the
default job, the README's "Use the model" commands on `outputs/checkpoints/<experiment>`, then the
own-data command (a new run, not "nothing to do"; the short name now ambiguous), the same command
again (complete), an explicit run.name with a changed key (exit 2 naming it); an unfinished run and
the same command with another lr (a new run from step 0); runs that fail before their loop end
FAILED in MLflow with the error."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys

import pytest
from helpers import REPO, entry_env, run_train
from mlflow.tracking import MlflowClient

from goodput.data.synthetic import make_dataset

pytestmark = pytest.mark.slow


def runs(root) -> list:
    """The training runs (not scripts/evaluate.py's runs, nested under them)."""
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    got = client.search_runs([client.get_experiment_by_name("goodput").experiment_id])
    return [r for r in got if "goodput.evaluates" not in r.data.tags]


def script(cwd, name: str, *argv: str) -> subprocess.CompletedProcess:
    """scripts/<name> on the command line, from `cwd` (the README's relative paths)."""
    cmd = [sys.executable, str(REPO / "scripts" / name), *argv]
    return subprocess.run(cmd, cwd=cwd, env=entry_env(), capture_output=True, text=True, timeout=300)


def test_the_readme_order_trains_a_new_run_for_own_data_and_another_model(tmp_path):
    root, flowers = tmp_path / "out", tmp_path / "flowers"
    _, first = run_train(root)  # `make train`'s job (the smoke preset, for time)
    p, _ = run_train(root, "checkpoint=torch_save", "data=remote")  # the README's baselines, without run.name
    said = p.stdout + p.stderr
    assert "is complete" in said and "give it a run.name of its own, or use -m (one run per job)" in said
    # README "Use the model", as written: the experiment's name, not the run's (smoke-<digest>)
    short, ran = "out/checkpoints/smoke", first["checkpoint_dir"]
    p = script(tmp_path, "evaluate.py", short)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines()[0] == (
        f"evaluate.py: {short}: no such directory; using out/checkpoints/{os.path.basename(ran)}, "
        "the one run named smoke-<digest>"
    )
    assert p.stdout.startswith(f"{ran}/step-000000012 (model weights, step 12)"), p.stdout
    accuracy = float(next(x for x in p.stdout.splitlines() if "val/accuracy" in x).split()[1])
    assert accuracy == pytest.approx(first["val_accuracy"])
    assert f"in sqlite:///{root}/mlflow.db" in p.stdout  # logged in the run's own store
    val = os.path.join(first["config"]["data"]["root"], "val")
    image = os.path.join(val, "disc", sorted(os.listdir(os.path.join(val, "disc")))[0])
    p = script(tmp_path, "predict.py", short, image)
    assert p.returncode == 0, p.stderr
    header, row = list(csv.reader(io.StringIO(p.stdout)))
    assert header[:2] == ["path", "class"] and row[0] == image and row[1] in os.listdir(val)
    make_dataset(str(flowers), num_classes=3, train_per_class=8, val_per_class=2, image_size=16)
    own = (f"data.root={flowers}", "model=resnet18")  # README: "Your own data"
    p, s = run_train(root, *own)
    out = p.stdout + p.stderr
    assert "nothing to do" not in out and "a new run" in out
    assert s["steps"] == 12 and s["resumed_from_steps"] == []  # trained, from scratch
    assert s["checkpoint_dir"] != first["checkpoint_dir"] and s["mlflow_run_id"] != first["mlflow_run_id"]
    assert {r.info.run_id: r.info.status for r in runs(root)} == {
        first["mlflow_run_id"]: "FINISHED",
        s["mlflow_run_id"]: "FINISHED",
    }
    # two smoke-<digest> runs now: the short name is refused, naming both, newest first
    p = script(tmp_path, "evaluate.py", short, "--no-mlflow")
    both = ", ".join(f"out/checkpoints/{os.path.basename(r['checkpoint_dir'])}" for r in (s, first))
    assert (
        p.returncode == 2
        and p.stdout == ""
        and p.stderr
        == (
            f"evaluate.py: {short}: no such directory, and 2 runs are named smoke-<digest> (newest first): "
            f"{both}; name one\n"
        )
    )
    p, _ = run_train(root, *own)  # the same command again
    assert "is complete: it reached step 12" in p.stdout + p.stderr and len(runs(root)) == 2
    # an explicit name that exists, with another identity key: refused before any work, both values
    name = first["checkpoint_dir"].rsplit("/", 1)[-1]
    p, _ = run_train(root, f"run.name={name}", "model.width=16", expect_rc=2)
    assert "model.width (the run: 32, this launch: 16)" in p.stdout + p.stderr
    assert "Traceback" not in p.stderr and len(runs(root)) == 2


def test_an_unfinished_run_and_the_same_command_with_another_lr_is_a_new_run(tmp_path):
    """Issue 29's worst case: the earlier run stopped at step 6 of 12 (its newest commit: step 4),
    and a command that trains something else continued its weights, with a warning only (another
    seed was refused by the sample-order check; another lr, optimizer or dataset of the same shapes
    was not). The drill's fault.* key is not in the second command: not an identity key, it would
    stop that run too."""
    root = tmp_path / "out"
    # dcp_sync: the step-4 commit is whole before the kill (an async one may still be in flight)
    stopped, _ = run_train(root, "fault.kill_at_step=6", "checkpoint=dcp_sync", expect_rc=-9)
    p, s = run_train(root, "optim.optimizer.lr=0.05", "checkpoint=dcp_sync")
    ckpts = sorted(os.listdir(root / "checkpoints"))
    assert len(ckpts) == 2 and os.path.basename(s["checkpoint_dir"]) in ckpts
    (old,) = [n for n in ckpts if n != os.path.basename(s["checkpoint_dir"])]
    assert f"run '{old}'" in stopped.stdout + stopped.stderr  # the stopped run, by its own name
    assert f"run '{os.path.basename(s['checkpoint_dir'])}': a new run" in p.stdout + p.stderr
    assert s["resumed_from_steps"] == [] and s["steps"] == 12 and s["restarts"] == 0
    assert os.listdir(root / "checkpoints" / old / "step-000000004")  # untouched: its step-4 commit


@pytest.mark.parametrize("case", ["model_raises", "too_small"])
def test_a_run_that_fails_before_its_loop_ends_failed_with_the_error(tmp_path, case):
    """Both fail in the worker's build (the model's constructor; the loader), after the MLflow run
    was opened. (A target that is not there is refused before any work: test_messages_runs.)"""
    if case == "model_raises":
        overrides, says = ("model.width=3",), "width must be a multiple of 8 (GroupNorm's 8 groups), got 3"
    else:
        tiny = tmp_path / "tiny"
        make_dataset(str(tiny), num_classes=2, train_per_class=3, val_per_class=1, image_size=16)
        overrides, says = (f"data.root={tiny}",), "fewer than one global batch"
    p, _ = run_train(tmp_path / "out", *overrides, expect_rc=None)
    assert p.returncode != 0
    (run,) = runs(tmp_path / "out")
    assert run.info.status == "FAILED" and says in run.data.tags["error"], run.data.tags
    assert "\n" not in run.data.tags["error"]
