"""MLflow run metadata: the dataset (Dataset column) and the source (entry point, git commit)."""

from __future__ import annotations

import subprocess

from conftest import REPO
from mlflow.tracking import MlflowClient

from goodput.tracking import Tracker, source_tags, start_run


def test_run_records_its_source_and_dataset(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tags = source_tags(str(REPO / "scripts" / "train.py"))
    run_id = start_run(uri, "e", "r", {"a": "1"}, None, str(tmp_path / "art"), tags=tags)
    t = Tracker(uri, run_id, enabled=True)
    root = str(tmp_path / "data" / "shapes-c4")
    t.log_dataset(root, "0123456789abcdef")
    t.log_dataset(root, "0123456789abcdef")  # a restarted worker logs it again: still one input
    t.close()
    run = MlflowClient(uri).get_run(run_id)
    inputs = run.inputs.dataset_inputs
    assert len(inputs) == 1
    assert inputs[0].dataset.name == "shapes-c4" and inputs[0].dataset.digest == "0123456789abcdef"
    assert root in inputs[0].dataset.source
    assert run.data.tags["mlflow.source.name"].endswith("scripts/train.py")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:  # a checkout (a source tarball has no commit to record)
        assert run.data.tags["mlflow.source.git.commit"] == head.stdout.strip()


def test_no_commit_outside_a_repository(tmp_path):
    tags = source_tags(str(tmp_path / "train.py"))
    assert tags["mlflow.source.name"] == str(tmp_path / "train.py")
    assert "mlflow.source.git.commit" not in tags
