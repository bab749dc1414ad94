"""Run identity and honest run states on the entry point, in the order a newcomer meets them: the
default job, then the README's own-data command (a new run, not "nothing to do"), the same command
again (complete), an explicit run.name with a changed key (exit 2 naming it); runs that fail before
their loop end FAILED in MLflow with the error."""

from __future__ import annotations

import pytest
from helpers import run_train
from mlflow.tracking import MlflowClient

from goodput.data.synthetic import make_dataset

pytestmark = pytest.mark.slow


def runs(root) -> list:
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    return client.search_runs([client.get_experiment_by_name("goodput").experiment_id])


def test_the_readme_order_trains_a_new_run_for_own_data_and_another_model(tmp_path):
    root, flowers = tmp_path / "out", tmp_path / "flowers"
    _, first = run_train(root)  # `make train`'s job (the smoke preset, for time)
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
    p, _ = run_train(root, *own)  # the same command again
    assert "is complete: it reached step 12" in p.stdout + p.stderr and len(runs(root)) == 2
    # an explicit name that exists, with another identity key: refused before any work, both values
    name = first["checkpoint_dir"].rsplit("/", 1)[-1]
    p, _ = run_train(root, f"run.name={name}", "model.width=16", expect_rc=2)
    assert "model.width (the run: 32, this launch: 16)" in p.stdout + p.stderr
    assert "Traceback" not in p.stderr and len(runs(root)) == 2


@pytest.mark.parametrize("case", ["bad_target", "too_small"])
def test_a_run_that_fails_before_its_loop_ends_failed_with_the_error(tmp_path, case):
    """Both fail in the worker's build (instantiate; the loader), after the MLflow run was opened."""
    if case == "bad_target":
        overrides, says = ("model._target_=goodput.model.NoSuchModel",), "goodput.model.NoSuchModel"
    else:
        tiny = tmp_path / "tiny"
        make_dataset(str(tiny), num_classes=2, train_per_class=3, val_per_class=1, image_size=16)
        overrides, says = (f"data.root={tiny}",), "fewer than one global batch"
    p, _ = run_train(tmp_path / "out", *overrides, expect_rc=None)
    assert p.returncode != 0
    (run,) = runs(tmp_path / "out")
    assert run.info.status == "FAILED" and says in run.data.tags["error"], run.data.tags
    assert "\n" not in run.data.tags["error"]
