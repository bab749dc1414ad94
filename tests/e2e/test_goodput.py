"""The goodput ledger on synthetic timelines; a drill with two random kills through the entry point."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import REPO

from goodput.resilience import recovery as recovery_module
from goodput.resilience.accounting import Attempts, Ledger
from goodput.resilience.bookkeeping import Goodput
from goodput.resilience.recovery import Recovery
from goodput.storage.remote import Storage


def test_ledger_rolls_back_with_the_checkpoint():
    led = Ledger()
    led.run_start = 1000.0
    led.add("startup", 5)
    led.add("productive", 50)
    led.add("fetch", 5)
    led.add("checkpoint", 2)
    saved = led.state_dict()  # checkpoint at t=1062
    led.add("productive", 30)  # work after the checkpoint ... then a crash at t=1100
    resumed = Ledger()  # relaunch at t=1130
    resumed.load_state_dict(saved)
    resumed.add("startup", 4)
    resumed.add("productive", 30)  # the 30 s redone
    r = resumed.report(restarts=1, now=1168.0)
    assert r["wall_seconds"] == 168.0
    assert r["productive_seconds"] == 80.0  # only surviving work counts
    # lost = the 30 s done twice + 30 s between crash and relaunch + ... = wall - accounted
    assert r["lost_seconds"] == pytest.approx(168 - (9 + 80 + 5 + 2))
    assert r["goodput"] == pytest.approx(80 / 168)


def test_crash_before_first_checkpoint_loses_everything_done():
    led = Ledger()
    led.run_start = 0.0
    # attempt 1 did 40 s of work, never committed; attempt 2 starts fresh at t=45 with run_start kept
    fresh = Ledger()
    fresh.run_start = led.run_start  # the first launch time survives in the attempt records / job start
    fresh.add("startup", 3)
    fresh.add("productive", 40)
    r = fresh.report(restarts=1, now=90.0)
    assert r["lost_seconds"] == pytest.approx(90 - 43) and r["goodput"] == pytest.approx(40 / 90)


def test_crash_during_save_counts_the_stall_once_the_save_is_lost(tmp_path):
    led = Ledger()
    led.run_start = 0.0
    led.add("productive", 10)
    saved = led.state_dict()  # last commit
    led.add("productive", 10)
    led.add("checkpoint", 3)  # killed while this save uploads: it never committed
    back = Ledger()
    back.load_state_dict(saved)
    r = back.report(restarts=1, now=40.0)
    assert r["checkpoint_seconds"] == 0 and r["lost_seconds"] == 30.0  # the failed save's stall is lost time


def test_attempt_records_count_restarts_and_lost_steps(tmp_path):
    store = Storage(str(tmp_path))
    a0 = Attempts(store)
    assert a0.begin(None) == 0
    a0.beat(17)  # crashed at step 17; last commit was step 10
    a1 = Attempts(store)
    assert a1.begin(10) == 1
    a1.beat(33)  # crashed at 33; last commit 30
    a2 = Attempts(store)
    assert a2.begin(30) == 2
    a2.beat(50)
    assert a2.lost_steps() == (17 - 10) + (33 - 30)


class _Tracker:
    def __init__(self):
        self.tags, self.logged = {}, []

    def set_tags(self, tags):
        self.tags.update(tags)

    def log(self, metrics, step):
        self.logged.append((step, metrics))


def _goodput(store, ledger=None, markers=None, recovery=None, compile_paid=lambda: None):
    faults = SimpleNamespace(fired=lambda: markers or {})
    return Goodput(ledger or Ledger(), store, 0, 1, "no-run-dir", _Tracker(), faults, recovery, compile_paid)


def test_begin_adds_the_start_ups_the_restored_ledger_lacks(tmp_path):
    store = Storage(str(tmp_path))
    now = time.time()
    # Attempt 0's process started 4 s ago; it is ready now, and crashes before its first commit.
    g0 = _goodput(store)
    assert g0.begin(None, now - 4) == 0
    assert g0.attempts.record["startup"] == pytest.approx(4.0, abs=0.5)
    g0.attempts.beat(7)
    # Attempt 1 restores nothing, starts 2 s before now: its ledger holds both start-ups.
    g1 = _goodput(store)
    assert g1.begin(None, now - 2) == 1
    assert g1.ledger.run_start == pytest.approx(now - 4)  # wall time from the first start
    assert g1.ledger.totals["startup"] == pytest.approx(4.0 + 2.0, abs=0.5)
    assert g1.tracker.tags == {"restarts": 1, "restart.1.resumed_from": None}
    saved = g1.ledger.state_dict()  # attempt 1 commits at step 10...
    g1.attempts.record.update(startup=2.0)
    g1.attempts.beat(20)
    # ...and crashes; attempt 2 restores attempt 1's commit: attempt 0's start-up is not added twice,
    # and the hang detected after that commit's save (the restored ledger lacks it) is added.
    hang = {"hung-1.fired": {"attempt": 1, "detected": now + 5, "hung_seconds": 3.0},
            "hung-0.fired": {"attempt": 0, "detected": now - 1, "hung_seconds": 50.0}}  # fmt: skip  # in it
    g2 = _goodput(store, markers=hang)
    g2.ledger.load_state_dict(saved)
    assert g2.begin({"step": 10, "time": now}, time.time() - 1) == 2
    assert g2.ledger.totals["startup"] == pytest.approx(saved["totals"]["startup"] + 1.0, abs=0.5)
    assert g2.ledger.totals["hung"] == 3.0
    assert g2.ledger.run_start == saved["run_start"] and g2.ledger.resumed_from == [10]
    assert g2.summary(25)["goodput"]["lost_steps"] == (7 - 0) + (20 - 10)


def _no_reads(*args):
    raise AssertionError("read from the store")


def test_summary_gathers_every_restarts_record_and_their_medians(tmp_path, monkeypatch):
    """Three attempts, the last two after a kill at a known time: step_done's first call writes the
    restart's phase record (and the compile cost) to the attempt record and MLflow, and summary()
    reads them back from the store, with medians over the restarts."""
    store = Storage(str(tmp_path))
    kills, took = {}, {1: 2.0, 2: 6.0}  # restart -> seconds from the kill to its first step
    t0, last = time.time() + 100, None  # marks later than every attempt's start, as real ones are
    for n in range(3):
        recovery = Recovery()
        g = _goodput(store, markers=dict(kills), recovery=recovery,
                     compile_paid=lambda n=n: {"first_step_seconds": 0.5 * n})  # fmt: skip
        assert g.begin({"step": 10 * n} if n else None, time.time()) == n
        recovery.marks = {"process_started": t0 + 1000 * n, "ready": t0 + 1000 * n + 1}
        if n:  # the kill was 1 s before this process started; the first step is marked `took` after it
            clock = SimpleNamespace(time=lambda n=n: t0 + 1000 * n - 1 + took[n])
            monkeypatch.setattr(recovery_module, "time", clock)
        # The record is made from what `begin` read: the first step reads nothing from the store
        # (rank 0's wait there holds up every rank's second step)
        store.read_bytes = store.ls = g.faults.fired = _no_reads
        assert g.step_done(10 * n + 1) is True and g.step_done(10 * n + 2) is False
        del store.read_bytes, store.ls
        g.attempts.beat(10 * n + 5)
        kills[f"kill-{n}.fired"] = {"time": t0 + 1000 * (n + 1) - 1}
        last = g
    s = last.summary(30)
    assert s["restarts"] == 2 and s["resumed_from_steps"] == [20]
    per = s["recovery"]["per_restart"]
    assert [r["attempt"] for r in per] == [1, 2]
    assert [r["total_seconds"] for r in per] == pytest.approx([2.0, 6.0], abs=1e-3)
    assert [r["failure_source"] for r in per] == ["fault_marker"] * 2
    assert [r["compile_seconds"] for r in per] == [0.5, 1.0]
    assert s["recovery"]["restarts"] == 2
    assert s["recovery"]["total_median_seconds"] == pytest.approx(4.0, abs=1e-3)
    medians = s["recovery"]["median_seconds"]
    assert medians["process_started"] == pytest.approx(1.0, abs=1e-3)  # kill -> process start, both times
    assert medians["first_step"] == pytest.approx(2.0, abs=1e-3)  # ready -> first step: 0 s and 4 s
    assert s["compile"] == [{"attempt": n, "first_step_seconds": 0.5 * n} for n in range(3)]
    step, metrics = last.tracker.logged[0]  # MLflow's recovery/*, at step = the restart's number
    assert step == 2 and metrics["recovery/total_seconds"] == pytest.approx(6.0, abs=1e-3)


@pytest.mark.slow
def test_drill_two_kills(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "scripts/drill.py",
            "--root",
            str(tmp_path),
            "--out",
            str(tmp_path / "bench"),
            "--mtbf",
            "1.0",
            "--kills",
            "2",
            "--seed",
            "3",
            "--cpu",
            "--",
            "experiment=smoke",
            "trainer.max_steps=80",
            "checkpoint=dcp_sync",
            "checkpoint.every_n_steps=5",
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {r["run"]: r for r in json.loads((tmp_path / "bench" / "drill.json").read_text())["rows"]}
    clean, faulty = rows["clean"], rows["faulty"]
    assert clean["restarts"] == 0 and faulty["restarts"] == 2
    assert faulty["lost_steps"] <= 2 * 5  # at most one checkpoint interval per kill
    # restarts now cost ~0.5 s against ~3 s of start-up noise in an 80-step smoke job, so goodput
    # alone does not order the two runs; the restarts' gaps and redone steps are lost time
    assert faulty["lost_s"] > clean["lost_s"]
    assert faulty["same_model"] is True
    assert faulty["wall_vs_clean"] == pytest.approx(clean["wall_s"] / faulty["wall_s"], abs=1e-3)
    # each run's own steady step time, read back from its MLflow metrics, puts the faulty run's
    # steps at the clean run's speed: what is left of the wall difference is the failures'
    assert clean["steady_step_s"] > 0 and faulty["steady_step_s"] > 0
    wall = faulty["wall_s"] - (80 + faulty["lost_steps"]) * (faulty["steady_step_s"] - clean["steady_step_s"])
    assert faulty["steady_vs_clean"] == pytest.approx(clean["wall_s"] / wall, abs=2e-3)
    assert faulty["failure_s"] == pytest.approx((wall - clean["wall_s"]) / 2, abs=0.01)
    cpu = json.loads((tmp_path / "bench" / "drill.json").read_text())["cpu"]["faulty"]  # --cpu
    assert cpu["restarts"] == 2 and cpu["restart_cpu_s"]["ranks"] > 0  # the new rank's start-up
    assert 0 < cpu["sampler_cpu_share"] < 1
    assert "CPU seconds per restart" in out.stdout


def test_advise_uses_the_runs_measured_stall(smoke_reference):
    s = smoke_reference("dcp_sync")  # advise only reads the run's commits and its MLflow store
    root = Path(s["checkpoint_dir"]).parents[1]
    uri = f"sqlite:///{root}/mlflow.db"
    cmd = [sys.executable, "-m", "goodput.calculator", "advise", "--tracking-uri", uri]
    args = [s["checkpoint_dir"], "--gpus", "256", "--afr", "0.01", "--trials", "500"]
    out = subprocess.run([*cmd, *args, "--json"], cwd=REPO, capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    assert r["run_id"] == s["mlflow_run_id"] and r["save_stall_seconds"] > 0
    assert r["mtbf_hours"] == pytest.approx(8760 / 2.56)
    # No restarts in this run: the restart cost is its start-up per attempt, and it says so.
    assert r["restarts"] == 0 and "start-up" in r["restart_source"]
    assert r["restart_seconds"] == pytest.approx(s["goodput"]["startup_seconds"], rel=1e-3)
    assert r["interval_minutes"] == pytest.approx(
        (2 * r["save_stall_seconds"] * r["mtbf_hours"] * 3600) ** 0.5 / 60
    )
    # The simulated spread at that interval, next to the closed forms.
    assert r["goodput_p10"] <= r["goodput_mean"] <= r["goodput_p90"] and r["trials"] == 500
    assert r["closed_form_goodput"] == pytest.approx(r["goodput"], abs=1e-6)
    human = subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True)
    assert human.returncode == 0, human.stderr
    assert "start-up seconds per attempt" in human.stdout and "closed form" in human.stdout
    bad = subprocess.run([*cmd, "0" * 32], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "no MLflow run" in bad.stderr
