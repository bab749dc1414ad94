"""The run layer through real processes: a dataset class by `_target_` on the entry point, the
process start-up clock in a fresh interpreter, a script importing the installed package."""

from __future__ import annotations

import ast
import subprocess
import sys
import time

import pytest
from helpers import REPO, entry_env, run_train
from helpers import flatten_to_manifest as _flatten_to_manifest

from goodput.data.synthetic import make_dataset
from goodput.resilience.accounting import process_start

IMPORTED = time.time()  # this test module is imported long after the pytest process started


def test_scripts_import_the_installed_package_without_path_edits():
    """No script edits sys.path (nothing in scripts/ shadows the package any more); the one that did
    runs from a fresh interpreter outside the repo (`--help` imports everything it needs)."""
    import subprocess
    import sys

    for script in sorted((REPO / "scripts").glob("*.py")):
        tree = ast.parse(script.read_text())
        edits = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path"
                 and isinstance(n.value, ast.Name) and n.value.id == "sys"]  # fmt: skip
        assert not edits, f"{script.name} touches sys.path at lines {edits}"
    script = str(REPO / "scripts" / "pack_shards.py")
    p = subprocess.run([sys.executable, script, "--help"], cwd="/", capture_output=True)
    assert p.returncode == 0 and b"--src" in p.stdout, p.stderr.decode()[-500:]


# -- the ledger's start-up -----------------------------------------------------------------------
def test_process_start_includes_the_imports():
    """Against an independent clock: a fresh interpreter reads time.time() as its first statement,
    then imports goodput. The process started before that first statement (interpreter start-up),
    and not long before it. (psutil's create_time is no reference: it adds /proc/stat's boot time,
    which the kernel truncates to whole seconds, so it is up to 1 s late.)"""
    assert process_start() < IMPORTED  # before this module (and torch, hydra, mlflow) was imported
    code = (
        "import time; first = time.time()\n"
        "from goodput.resilience.accounting import process_start\n"
        "print(first - process_start())"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=entry_env())
    before_first_statement = float(p.stdout.strip() or "nan")
    assert 0 <= before_first_statement < 1.0, p.stderr[-500:]


def test_process_start_stays_put_when_the_wall_clock_steps_and_a_fork_has_its_own(monkeypatch):
    """The start is a difference of the wall clock and the uptime clock: worked out again after the
    wall clock stepped (NTP, a paused VM), it moved by the step (the earlier test failed in CI with
    the start 43 s after this module's import). A child forked later (the forkserver's workers)
    still gets its own start, not its parent's."""
    import os

    before, real = process_start(), time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0)  # the wall clock steps an hour ahead
    assert process_start() == before
    monkeypatch.undo()
    r, w = os.pipe()
    forked = time.time()
    pid = os.fork()
    if pid == 0:  # the child: its start, then out without pytest's teardown
        os.write(w, repr(process_start()).encode())
        os._exit(0)
    os.close(w)
    child = float(os.read(r, 64))
    os.waitpid(pid, 0)
    assert forked - 0.02 <= child <= time.time() + 0.02  # the kernel counts in 10 ms ticks


# -- a dataset class by _target_ -------------------------------------------------------------------
@pytest.mark.slow
def test_a_dataset_class_by_target_on_the_entry_point(tmp_path, smoke_reference):
    """docs/config.md's example: the smoke data laid out flat with CSV manifests trains the same model,
    bit for bit, as the ImageFolder it came from (sample i is the same image)."""
    make_dataset(str(tmp_path / "folder"), 10, 20, 4, 16, 0)  # the smoke experiment's demo data
    _flatten_to_manifest(tmp_path / "folder", tmp_path / "csv")
    _, s = run_train(
        tmp_path / "run",
        f"data.root={tmp_path / 'csv'}",
        "data.dataset._target_=goodput.data.dataset.CsvManifest",
        "checkpoint=dcp_sync",
    )
    assert s["model_sha256"] == smoke_reference("dcp_sync")["model_sha256"]
