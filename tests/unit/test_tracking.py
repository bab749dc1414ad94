"""MLflow: the run's metadata (dataset, source) and metric logging that never waits for the store."""

from __future__ import annotations

import sqlite3
import subprocess
import threading
import time

from helpers import REPO
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


def _blocked_store(t: Tracker, release: threading.Event):
    """Make the tracker's store block every write until `release` is set; returns the list of
    completed writes (metric counts) and an event set once a write is under way."""
    real, writes, entered = t.client.log_batch, [], threading.Event()
    deadline = time.monotonic() + 10  # a synchronous log() would sit here 10 s, then fail the test

    def log_batch(run_id, metrics=(), **kw):
        entered.set()
        release.wait(max(0.0, deadline - time.monotonic()))
        real(run_id, metrics=metrics, **kw)
        writes.append(len(metrics))

    t.client.log_batch = log_batch
    return writes, entered


def test_logging_never_waits_for_the_store_and_close_delivers_everything(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = start_run(uri, "e", "r", {}, None, str(tmp_path / "art"))
    t = Tracker(uri, run_id, enabled=True)
    release = threading.Event()
    writes, entered = _blocked_store(t, release)
    t.log({"loss": 0.0}, 0)
    assert entered.wait(10)  # the first write is inside the store, which holds it
    for step in range(1, 100):  # the loop goes on while the store is blocked
        t.log({"loss": float(step), "lr": 0.1}, step)
    assert not release.is_set() and writes == []  # every log() returned, no write has finished
    release.set()
    t.close()
    assert sum(writes) == 1 + 99 * 2
    history = MlflowClient(uri).get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(100)]
    assert len(MlflowClient(uri).get_metric_history(run_id, "lr")) == 99
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"


def test_a_locked_store_is_retried_not_dropped(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = start_run(uri, "e", "r", {}, None, str(tmp_path / "art"))
    t = Tracker(uri, run_id, enabled=True)
    real, failures = t.client.log_batch, [2]

    def log_batch(*a, **kw):  # what parallel jobs on one SQLite file answer now and then
        if failures[0]:
            failures[0] -= 1
            raise sqlite3.OperationalError("database is locked")
        return real(*a, **kw)

    t.client.log_batch = log_batch
    t.log({"loss": 1.5}, 7)
    t.close()
    assert failures == [0]
    assert [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, "loss")] == [(7, 1.5)]


def _tracker_made_within(seconds: float, *args, **kw) -> Tracker | None:
    made: list = []
    th = threading.Thread(target=lambda: made.append(Tracker(*args, **kw)), daemon=True)
    th.start()
    th.join(seconds)
    return made[0] if made else None


def test_a_tracker_does_not_wait_for_its_store_to_open(tmp_path, monkeypatch):
    """A restarted rank 0 builds its Tracker before the checkpoint read, which every rank waits
    for: opening the store (about 0.2 s for SQLite, more for a server) and setting the run RUNNING
    again happen on the tracker's writer thread, and what is logged meanwhile waits in its queue."""
    import goodput.tracking as tracking

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = start_run(uri, "e", "r", {}, None, str(tmp_path / "art"))
    client = MlflowClient(uri)
    client.set_terminated(run_id, "FAILED")  # as the crashed attempt's rank 0 left it
    release, real = threading.Event(), tracking.reopen

    def slow_reopen(c, rid):  # a store that takes its time to answer
        release.wait(20)
        real(c, rid)

    monkeypatch.setattr(tracking, "reopen", slow_reopen)
    t = _tracker_made_within(5, uri, run_id, enabled=True)
    assert t is not None, "the Tracker waited for its store"
    t.log({"loss": 2.5}, 3)
    t.set_tags({"restarts": 1})
    t.log_dataset(str(tmp_path / "data" / "shapes-c4"), "0123456789abcdef")
    assert client.get_run(run_id).info.status == "FAILED"  # nothing reached the store yet
    release.set()
    t.close()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "1"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(3, 2.5)]
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["shapes-c4"]


def test_a_store_that_cannot_be_opened_costs_a_warning_not_the_run(tmp_path, monkeypatch, caplog):
    import goodput.tracking as tracking

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = start_run(uri, "e", "r", {}, None, str(tmp_path / "art"))

    def broken(c, rid):
        raise ConnectionError("tracking server unreachable")

    monkeypatch.setattr(tracking, "reopen", broken)
    t = _tracker_made_within(5, uri, run_id, enabled=True)
    assert t is not None
    t.log({"loss": 1.0}, 1)
    t.set_tags({"restarts": 1})
    t.artifact(__file__)
    t.close("FAILED", RuntimeError("boom"))
    assert "could not be opened (tracking server unreachable)" in caplog.text
    assert "restarts" not in MlflowClient(uri).get_run(run_id).data.tags
