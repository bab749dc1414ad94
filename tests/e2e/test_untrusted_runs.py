"""Untrusted input through real processes: the entry point refuses a CSV row outside the data root
naming it, with nothing written outside; `inspect_checkpoint.py --verify` names a deeply nested
commit record and a FIFO without crashing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DEEP, REPO, run_train
from helpers import manifest_dataset as _manifest_dataset
from helpers import two_steps as _two_steps

from goodput.checkpoint.layout import COMMIT
from goodput.data.dataset import ImageFolder
from goodput.storage.remote import Storage


def test_inspect_verify_names_a_deeply_nested_commit_and_a_fifo_without_crashing(tmp_path, dist1):  # noqa: F811
    mgr, app, remote = _two_steps(tmp_path, dist1)
    (remote / "step-000000002" / COMMIT).write_bytes(DEEP)
    step1 = remote / "step-000000001"
    victim = next(n for n in json.loads((step1 / COMMIT).read_text())["files"] if n != ".metadata")
    os.unlink(step1 / victim)
    os.mkfifo(step1 / victim)
    p = subprocess.run(
        [sys.executable, "scripts/inspect_checkpoint.py", "--verify", str(remote)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "step-000000002/COMMIT.json" in p.stdout and f"step-000000001/{victim}" in p.stdout, p.stdout


@pytest.mark.slow
def test_the_entry_point_refuses_a_csv_row_outside_the_root_naming_it(folder, tmp_path):
    data, outside = tmp_path / "data", tmp_path / "outside"
    outside.mkdir()
    rows = _manifest_dataset(folder, data)
    shutil.copytree(Path(folder) / "val", data / "val")
    val = ImageFolder(Storage(folder), "val")
    (data / "val.csv").write_text("".join(f"{f},{val.classes[k]}\n" for f, k in zip(val.files, val.labels)))
    mirror = data / str(outside).lstrip("/") / "evil.pth"  # what the old listing "found" for the row
    mirror.parent.mkdir(parents=True)
    mirror.write_bytes((data / "pics" / "0.jpg").read_bytes())
    rows.insert(2, f"{outside}/evil.pth,circle")
    (data / "train.csv").write_text("\n".join(rows) + "\n")
    p, s = run_train(
        tmp_path / "run", f"data.root={data}", "data.dataset._target_=goodput.data.dataset.CsvManifest",
        "trainer.global_batch_size=4",
        expect_rc=None,
    )  # fmt: skip
    assert p.returncode != 0 and s is None
    assert f"train.csv line 3: path '{outside}/evil.pth' is absolute; refused" in p.stdout + p.stderr
    assert list(outside.iterdir()) == []
