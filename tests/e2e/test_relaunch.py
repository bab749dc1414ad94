"""Relaunching always works: whatever a first start creates (MLflow store, demo dataset) is made
aside and moved into place, or repaired on relaunch; SIGKILLs at random moments never need a person."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sqlite3
import subprocess
import time

import pytest
from helpers import ckpt_dir, final_checkpoint_state, run_train, start_train, train_cmd

from goodput.data.synthetic import COMPLETE, make_dataset, read_record
from goodput.tracking import ensure_store, start_run


def test_store_is_created_aside_then_linked(tmp_path):
    db = tmp_path / "mlflow.db"
    run_id = start_run(f"sqlite:///{db}", "exp", "r", {"a": "1"}, None, str(tmp_path / "art"))
    assert run_id and db.exists()
    assert [p.name for p in tmp_path.iterdir() if "creating" in p.name] == []


def test_half_made_store_is_moved_aside_with_a_warning(tmp_path, caplog):
    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:  # what a kill during MLflow's table creation leaves
        con.execute("CREATE TABLE experiments (experiment_id INTEGER PRIMARY KEY, name TEXT)")
        con.execute("CREATE TABLE spans (trace_id TEXT)")
    with caplog.at_level(logging.WARNING):
        run_id = start_run(f"sqlite:///{db}", "exp", "r", {}, None, str(tmp_path / "art"))
    assert run_id
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("mlflow.db.broken-")]
    assert len(aside) == 1
    assert f"MLflow store {db} is half-made" in caplog.text and str(aside[0]) in caplog.text


def test_a_store_with_runs_is_never_moved_aside(tmp_path):
    db = tmp_path / "mlflow.db"
    start_run(f"sqlite:///{db}", "exp", "r", {}, None, str(tmp_path / "art"))
    with sqlite3.connect(db) as con:  # a schema this MLflow does not know (a newer one, say)
        con.execute("UPDATE alembic_version SET version_num = 'f0000000000f'")
    ensure_store(f"sqlite:///{db}")  # left to MLflow, which asks for `mlflow db upgrade`
    assert db.exists() and not [p for p in tmp_path.iterdir() if ".broken-" in p.name]


def test_a_store_whose_writer_was_killed_mid_write_keeps_its_runs(tmp_path):
    """A SIGKILL while the tracking thread writes leaves a hot journal beside the store. A read-only
    look cannot roll it back ("attempt to write a readonly database"): that is no reason to move
    the store aside. Moving it left the journal behind, MLflow played the old store's pages into
    the new file, and the relaunch failed on "database disk image is malformed"."""
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    first = start_run(uri, "exp", "r", {"a": "1"}, None, str(tmp_path / "art"))
    pid = os.fork()
    if pid == 0:  # a writer killed inside its transaction, as SIGKILL finds the tracking thread
        try:
            con = sqlite3.connect(db, isolation_level=None)
            con.execute("PRAGMA cache_size = 1")  # spill pages to the file before the commit
            con.execute("BEGIN")
            con.execute("CREATE TABLE filler (x)")
            con.executemany("INSERT INTO filler VALUES (?)", [("x" * 500,)] * 2000)
            con.execute("UPDATE runs SET name = 'torn'")
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    assert (tmp_path / "mlflow.db-journal").stat().st_size > 0  # the hot journal
    second = start_run(uri, "exp", "r2", {"a": "2"}, None, str(tmp_path / "art"))
    assert not [p.name for p in tmp_path.iterdir() if ".broken-" in p.name]
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        names = dict(con.execute("SELECT run_uuid, name FROM runs"))
    assert names == {first: "r", second: "r2"}  # the torn write rolled back, the first run kept


def test_a_half_made_store_is_moved_aside_with_its_write_ahead_log(tmp_path):
    """A half-made store in WAL mode (another tool's, or a user's setting) keeps its last writes in
    mlflow.db-wal: moved aside with the file, never left for SQLite to replay into the new store."""
    db = tmp_path / "mlflow.db"
    pid = os.fork()
    if pid == 0:  # killed with its writes still in the log (a clean close would checkpoint them)
        try:
            con = sqlite3.connect(db, isolation_level=None)
            con.execute("PRAGMA journal_mode = WAL")
            con.execute("CREATE TABLE experiments (experiment_id INTEGER PRIMARY KEY, name TEXT)")
            con.execute("CREATE TABLE spans (trace_id TEXT)")
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    assert (tmp_path / "mlflow.db-wal").stat().st_size > 0
    run_id = start_run(f"sqlite:///{db}", "exp", "r", {}, None, str(tmp_path / "art"))
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert [r for (r,) in con.execute("SELECT run_uuid FROM runs")] == [run_id]
    (aside,) = [
        p for p in tmp_path.iterdir() if ".broken-" in p.name and not p.name.endswith(("-wal", "-shm"))
    ]
    assert (tmp_path / f"{aside.name}-wal").exists()
    with sqlite3.connect(aside) as con:  # the log travelled with it: its tables are still there
        assert {"experiments", "spans"} <= {n for (n,) in con.execute("SELECT name FROM sqlite_master")}


def test_dataset_is_generated_aside(tmp_path):
    root = tmp_path / "data"
    os.makedirs(f"{root}.partial-999999999")  # a killed generator's leftovers (no such pid)
    n = make_dataset(str(root), num_classes=2, train_per_class=3, val_per_class=1, image_size=16)
    assert n["train"] == 6 and read_record(str(root))["train"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    # into an existing folder holding other things: train/ and val/ replaced, the record last
    other = tmp_path / "other"
    (other / "train" / "stale").mkdir(parents=True)
    (other / "keep.txt").write_text("x")
    make_dataset(str(other), num_classes=2, train_per_class=3, val_per_class=1, image_size=16)
    assert (other / "keep.txt").exists() and not (other / "train" / "stale").exists()
    assert (other / COMPLETE).exists() and len(list((other / "train").rglob("*.jpg"))) == 6


def test_demo_data_is_never_generated_into_a_folder_of_other_files(tmp_path):
    """paths.data_dir pointed at one's own dataset: refused before any work, the files untouched
    (the demo generator replaced train/ and val/ of a folder without its record)."""
    from helpers import compose_train
    from omegaconf import OmegaConf

    from goodput.config import validate
    from goodput.data.synthetic import REPLACING
    from goodput.run.job import DataDirTaken, ensure_data

    mine = tmp_path / "mydata"
    (mine / "train" / "cat").mkdir(parents=True)
    (mine / "train" / "cat" / "1.jpg").write_bytes(b"mine")
    cfg = compose_train([f"paths.root={tmp_path}", f"paths.data_dir={mine}", "experiment=smoke"])
    c = validate(OmegaConf.to_container(cfg, resolve=True))
    with pytest.raises(
        DataDirTaken, match=f"paths.data_dir {mine} holds train but no {COMPLETE}.*data.root={mine}"
    ):
        ensure_data(c)
    assert (mine / "train" / "cat" / "1.jpg").read_bytes() == b"mine" and sorted(os.listdir(mine)) == [
        "train"
    ]
    # a generator killed while replacing an older demo dataset leaves its marker: generated again
    (mine / REPLACING).touch()
    ensure_data(c)
    assert (
        read_record(str(mine))["num_classes"] == c.demo_data.num_classes and not (mine / REPLACING).exists()
    )
    assert not (mine / "train" / "cat").exists()
    # an empty folder (or one holding only dotfiles) is anybody's: generated
    (tmp_path / "empty" / ".DS_Store").parent.mkdir()
    (tmp_path / "empty" / ".DS_Store").write_text("")
    cfg = compose_train(
        [f"paths.root={tmp_path}", f"paths.data_dir={tmp_path / 'empty'}", "experiment=smoke"]
    )
    ensure_data(validate(OmegaConf.to_container(cfg, resolve=True)))
    assert read_record(str(tmp_path / "empty")) is not None


@pytest.mark.parametrize(
    "made, off",
    [
        (dict(num_classes=5), "num_classes 5 (demo_data.* make 4)"),  # make_dataset.py's, elsewhere
        (dict(val_per_class=3), "val 12 (demo_data.* make 8)"),
        (dict(seed=7), "seed 7 (demo_data.* make 0)"),
    ],
)
def test_demo_data_of_other_settings_in_paths_data_dir_is_refused(tmp_path, made, off):
    """paths.data_dir pointed at demo data that demo_data.* do not generate: the run's name (which
    counts data.root as `${paths.data_dir}`, the demo data of demo_data.*) would continue an old run
    on other data; with other classes its checkpoints failed to load and it started over from step 0.
    Refused before any work, the data untouched; data that matches is used as it is."""
    from helpers import compose_train
    from omegaconf import OmegaConf

    from goodput.config import validate
    from goodput.run.job import DataDirTaken, ensure_data

    settings = ["demo_data.num_classes=4", "demo_data.train_per_class=3", "demo_data.val_per_class=2",
                "demo_data.image_size=16", "demo_data.seed=0"]  # fmt: skip
    theirs = tmp_path / "theirs"
    make_dataset(str(theirs), **{**dict(num_classes=4, train_per_class=3, val_per_class=2,
                                        image_size=16, seed=0), **made})  # fmt: skip
    before = {p: p.stat().st_mtime_ns for p in theirs.rglob("*")}
    cfg = compose_train([f"paths.root={tmp_path}", f"paths.data_dir={theirs}", "experiment=smoke", *settings])
    c = validate(OmegaConf.to_container(cfg, resolve=True))
    with pytest.raises(DataDirTaken) as e:
        ensure_data(c)
    said = str(e.value)
    assert said.startswith(f"paths.data_dir {theirs} holds demo data other than") and off in said, said
    assert f"pass data.root={theirs} instead of paths.data_dir;" in said, said
    cfg = compose_train([f"paths.root={tmp_path}", f"data.root={theirs}", "experiment=smoke", *settings])
    ensure_data(validate(OmegaConf.to_container(cfg, resolve=True)))  # the advice, followed: its own data
    assert {p: p.stat().st_mtime_ns for p in theirs.rglob("*")} == before
    mine = tmp_path / "mine"
    make_dataset(str(mine), num_classes=4, train_per_class=3, val_per_class=2, image_size=16, seed=0)
    before = {p: p.stat().st_mtime_ns for p in mine.rglob("*")}
    cfg = compose_train([f"paths.root={tmp_path}", f"paths.data_dir={mine}", "experiment=smoke", *settings])
    ensure_data(validate(OmegaConf.to_container(cfg, resolve=True)))  # its own: used, not generated again
    assert {p: p.stat().st_mtime_ns for p in mine.rglob("*")} == before


def test_the_default_demo_folder_is_named_by_every_demo_data_key(tmp_path):
    """Changing any demo_data key generates new data in a folder of its own (val_per_class and the
    generator's seed were not in the name: the old data was used, or, now, refused)."""
    from helpers import compose_train

    dirs = {
        compose_train([f"paths.root={tmp_path}", "experiment=smoke", *o]).paths.data_dir
        for o in ([], ["demo_data.num_classes=4"], ["demo_data.train_per_class=3"],
                  ["demo_data.val_per_class=3"], ["demo_data.image_size=24"], ["demo_data.seed=1"])
    }  # fmt: skip
    assert len(dirs) == 6, dirs


# -- SIGKILL at random moments of a first start and of later runs -------------------------------
# What an attempt logs as it goes, in order: the last one found says where a kill landed.
STORE = "Creating initial MLflow database tables"
MARKERS = [
    ("demo data not found", "data generation"),
    ("wrote ", "start-up"),
    (STORE, "store creation"),
    ("resumed from", "steps after a restore"),
    ("committed", "steps and saves"),
]


def _runs(root) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("goodput")
    return client.search_runs([exp.experiment_id]) if exp else []


def _phase(log: str) -> str:
    found = [(log.rfind(m), label) for m, label in MARKERS if m in log]
    return max(found)[1] if found else "start-up or restore"


def _kill_at(root, anchor: str | None, delay: float, *overrides: str) -> tuple[int, str]:
    """Start the entry point; `delay` s after `anchor` appears in its output (after the start if
    None), SIGKILL its process group. Returns (exit status, output)."""
    log = root / "attempt.log"
    with open(log, "w") as out:
        p = start_train(train_cmd(root, *overrides), out)
        deadline = time.monotonic() + 300
        while anchor is not None and anchor not in log.read_text() and p.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        try:
            rc = p.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            rc = p.wait()
    return rc, log.read_text()


# Where kills are aimed: (anchor in the output, seconds after it), drawn at random per attempt.
FIRST_START = [(None, (1.0, 8.0)), ("demo data not found", (0.0, 0.6)), (STORE, (0.0, 3.0))]
LATER_RUN = [
    (None, (1.0, 10.0)),
    (STORE, (0.0, 3.0)),
    ("resumed from", (0.0, 1.0)),
    ("committed", (0.0, 1.5)),
]


@pytest.mark.slow
def test_random_kills_from_the_first_start_always_relaunch_to_the_clean_model(tmp_path, smoke_reference):
    """Each trial: a fresh root (no store, no data), SIGKILLs to the process group at seeded random
    moments (start-up, data generation, store creation, restore, steps, saves) of the first start
    and of the relaunches, then a relaunch to the end: every trial ends with the uninterrupted
    run's model, and nobody had to delete anything."""
    extra = ("trainer.max_steps=16", "demo_data.train_per_class=150", "checkpoint.every_n_steps=2")
    ref = smoke_reference("dcp_async", *extra)
    rng = random.Random(7)
    attempts, closed = [], []
    for trial in range(3):
        root = tmp_path / f"t{trial}"
        root.mkdir()
        for k in range(3):
            anchor, (lo, hi) = rng.choice(FIRST_START if k == 0 else LATER_RUN)
            rc, log = _kill_at(root, anchor, rng.uniform(lo, hi), "checkpoint=dcp_async", *extra)
            attempts.append((trial, rc, _phase(log) if rc else "finished"))
            if rc == 0:
                break
        _, s = run_train(root, "checkpoint=dcp_async", *extra)
        model_sha, order_sha = final_checkpoint_state(ckpt_dir(root))
        assert (model_sha, order_sha) == (ref["model_sha256"], ref["sample_order_sha256"]), (trial, attempts)
        if s is not None:
            assert s["model_sha256"] == ref["model_sha256"]
        data = json.loads(next((root / "remote" / "data").glob(f"*/{COMPLETE}")).read_text())
        assert data["train"] == 1500
        # A SIGKILL leaves the MLflow run RUNNING; the relaunch closed each (KILLED, saying so).
        runs = [] if not (root / "mlflow.db").exists() else _runs(root)
        assert [r.info.status for r in runs if r.info.status == "RUNNING"] == [], (trial, attempts)
        closed += [r for r in runs if r.data.tags.get("goodput.left_running")]  # continued ones too
    print("attempts (trial, exit status, killed during):", attempts)
    assert closed  # some kill landed while a run was open
    assert sum(rc == -signal.SIGKILL for _, rc, _ in attempts) >= 5
    assert len({phase for *_, phase in attempts} - {"finished"}) >= 3  # kills landed in several phases
