"""Where restart time goes: the phase record, the agent's timestamps, the listing cache, and a
2-rank job killed twice through the entry point (one restart round per failure, totals bounded by
the test's own clock)."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from types import SimpleNamespace

import pytest
from helpers import ckpt_dir, run_train

from goodput.data.dataset import DataRootError, ImageFolder
from goodput.resilience.recovery import PHASES, AgentPhases, Recovery, agent_phases, failure_time, summarize
from goodput.storage.remote import Storage


def test_record_durations_add_up_to_the_gap_from_the_failure():
    r = Recovery()
    r.marks = {"process_started": 103.0, "imports_done": 103.1, "pg_ready": 103.3, "first_step": 104.5}
    agent = {"detected": 100.4, "workers_gone": 100.9, "rendezvous_done": 101.0, "round": 2}
    rec = r.record(100.0, "fault_marker", agent)
    assert list(rec["at"]) == ["failure", "detected", "workers_gone", "rendezvous_done", "process_started",
                               "imports_done", "pg_ready", "first_step"]  # fmt: skip
    assert rec["seconds"]["detected"] == pytest.approx(0.4)
    assert rec["seconds"]["process_started"] == pytest.approx(2.0)  # from the agent's rendezvous
    assert rec["total_seconds"] == pytest.approx(4.5)


def test_summary_medians_p90_and_extra_rounds():
    recs = [
        {"seconds": {"imports_done": float(i)}, "total_seconds": float(i), "rounds": 1} for i in range(1, 11)
    ]
    recs[3]["rounds"] = 2  # one restart burnt a round on its own
    s = summarize(recs)
    assert s["restarts"] == 10 and s["median_seconds"] == {"imports_done": 5.5}
    assert (
        s["total_median_seconds"] == 5.5 and s["total_p90_seconds"] == 9.0 and s["total_max_seconds"] == 10.0
    )
    assert s["extra_rounds"] == 1
    assert summarize([]) == {"restarts": 0}


def test_failure_time_from_the_kill_marker_else_the_last_heartbeat():
    prev = {"start": 50.0, "last_seen": 70.0}
    markers = {"old.fired": {"time": 40.0}, "new.fired": {"time": 71.5}, "legacy.fired": {}}
    assert failure_time(markers, prev) == (71.5, "fault_marker")
    assert failure_time({"old.fired": {"time": 40.0}}, prev) == (70.0, "last_heartbeat")  # an outside kill
    assert failure_time(markers, None) == (None, "none")


def test_agent_phases_from_the_elastic_agents_metrics(tmp_path):
    h = AgentPhases(str(tmp_path))

    def emit(name, ms):
        h.emit(SimpleNamespace(name=f"LocalElasticAgent.{name}.duration.ms", value=ms))

    emit("_rendezvous", 5)  # the first start: no stop
    emit("_start_workers", 3)
    h.emit(SimpleNamespace(name="LocalElasticAgent._stop_workers.success", value=1))  # ignored
    emit("_stop_workers", 400)
    emit("_rendezvous", 5)
    emit("_start_workers", 3)
    first, second = agent_phases(str(tmp_path), 0), agent_phases(str(tmp_path), 1)
    assert "detected" not in first and first["round"] == 0
    assert second["workers_gone"] - second["detected"] == pytest.approx(0.4)
    assert (
        second["detected"] <= second["workers_gone"] <= second["rendezvous_done"] <= second["workers_started"]
    )
    assert agent_phases(str(tmp_path), 7) == {} and agent_phases(str(tmp_path / "none"), 1) == {}


def _dataset(root):
    for cls in ("a", "b"):
        os.makedirs(root / "train" / cls)
        for i in range(3):
            (root / "train" / cls / f"{i}.jpg").write_bytes(b"x")


def test_listing_is_reused_only_by_restarts_of_the_same_elastic_job(tmp_path, monkeypatch):
    _dataset(tmp_path / "data")
    store, cache = Storage(str(tmp_path / "data")), str(tmp_path / "cache")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = ImageFolder(store, "train", cache)  # lists the remote and keeps the listing
    assert os.listdir(os.path.join(cache, "listings"))

    def no_remote(*a, **k):
        raise AssertionError("the remote was listed")

    monkeypatch.setattr(store, "find", no_remote)
    monkeypatch.setattr(store, "ls", no_remote)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = ImageFolder(store, "train", cache)  # an elastic restart: no remote listing
    assert (again.files, again.labels, again.classes, again.sizes, again.fingerprint) == (
        first.files, first.labels, first.classes, first.sizes, first.fingerprint
    )  # fmt: skip
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")  # another job lists the remote again
    with pytest.raises(AssertionError, match="the remote was listed"):
        ImageFolder(store, "train", cache)
    monkeypatch.undo()
    with pytest.raises(DataRootError, match="no files under"):  # errors unchanged
        ImageFolder(Storage(str(tmp_path / "empty")), "train", cache)


@pytest.mark.slow
@pytest.mark.serial  # phase durations against fixed bounds (imports < 1 s)
def test_two_kills_two_rounds_and_phases_within_the_tests_own_clock(tmp_path):
    """The phases are differences of the trainer's own timestamps, so their sum is their total by
    construction: not checked. What can fail: the total is bounded by this test's own monotonic
    clock (the run's wall time as seen from outside), and the kill times match the markers."""
    t0 = time.monotonic()
    p, s = run_train(
        tmp_path, "parallel=ddp", "checkpoint=dcp_async", "parallel.max_restarts=3", "fault.rank=1",
        "fault.kill_at_step=6", "fault.kill_during_save=8",
    )  # fmt: skip
    outside = time.monotonic() - t0
    assert s["restarts"] == 2 and s["steps"] == 12
    # A killed rank, and a survivor that left by os._exit, left no named semaphore of theirs for the
    # job's resource tracker to clean up (it warns of each at the end: tqdm's lock did)
    assert "leaked semaphore" not in p.stderr + p.stdout
    r = s["recovery"]
    assert r["restarts"] == 2 and r["extra_rounds"] == 0
    markers = {f: json.loads((ckpt_dir(tmp_path) / "faults" / f).read_text())
               for f in os.listdir(ckpt_dir(tmp_path) / "faults")}  # fmt: skip
    kills = sorted(m["time"] for m in markers.values())
    for n, rec in enumerate(r["per_restart"], start=1):
        assert rec["attempt"] == n and rec["round"] == n and rec["rounds"] == 1  # one round per failure
        assert rec["failure_source"] == "fault_marker" and rec["at"]["failure"] == pytest.approx(kills[n - 1])
        assert list(rec["at"]) == list(PHASES)  # every phase seen, in order
        assert all(v >= -0.02 for v in rec["seconds"].values()), rec  # /proc start times: 10 ms ticks
        # forked from the preloaded forkserver: no interpreter start, no torch import (spawn: 8-11 s here)
        assert rec["seconds"]["imports_done"] < 1.0
        # the survivors exit at once (fail_fast; DataLoader workers die with their rank): 4.7 s before
        assert rec["seconds"]["detected"] + rec["seconds"]["workers_gone"] < 2.5
    assert r["total_median_seconds"] <= r["total_max_seconds"]
    # Both recoveries fit inside the run as this process timed it: a failure time from the wrong
    # clock or the wrong attempt, or a phase counted twice, would not.
    assert 0 < sum(rec["total_seconds"] for rec in r["per_restart"]) < outside
    db = sqlite3.connect(tmp_path / "mlflow.db")
    steps = db.execute("select step from metrics where key='recovery/total_seconds' order by step").fetchall()
    assert [x[0] for x in steps] == [1, 2]
