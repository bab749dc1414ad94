"""The goodput ledger on synthetic timelines; a drill with two random kills through the entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO

from goodput.resilience.accounting import Attempts, Ledger
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


def test_advise_uses_the_runs_measured_stall(tmp_path):
    from conftest import run_train

    _, s = run_train(tmp_path, "checkpoint=dcp_sync")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [sys.executable, "-m", "goodput.calculator", "advise", "--tracking-uri", uri]
    args = [str(tmp_path / "checkpoints" / "smoke"), "--gpus", "256", "--afr", "0.01", "--trials", "500"]
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
