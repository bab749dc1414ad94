"""Untrusted input through real processes: the entry point refuses a CSV row or a shard index entry
outside the data root in one line naming it, exit 2, with nothing written outside, in one process and
under the elastic agent (no restarts); malformed run records are moved aside and the run trains on;
`inspect_checkpoint.py --verify` names a deeply nested commit record and a FIFO without crashing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import DEEP, REPO, ckpt_dir, run_train
from helpers import manifest_dataset as _manifest_dataset
from helpers import two_steps as _two_steps

from goodput.checkpoint.layout import COMMIT
from goodput.data.dataset import ImageFolder
from goodput.data.shards import INDEX, pack
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


def _csv_outside(folder, tmp_path) -> tuple[list[str], str]:
    """A CSV-manifest dataset whose train.csv line 3 names a file outside data.root (the attacker's
    bytes are where the old listing "found" the row)."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    outside.mkdir()
    rows = _manifest_dataset(folder, data)
    shutil.copytree(Path(folder) / "val", data / "val")
    val = ImageFolder(Storage(folder), "val")
    (data / "val.csv").write_text("".join(f"{f},{val.classes[k]}\n" for f, k in zip(val.files, val.labels)))
    mirror = data / str(outside).lstrip("/") / "evil.pth"
    mirror.parent.mkdir(parents=True)
    mirror.write_bytes((data / "pics" / "0.jpg").read_bytes())
    rows.insert(2, f"{outside}/evil.pth,circle")
    (data / "train.csv").write_text("\n".join(rows) + "\n")
    args = [f"data.root={data}", "data.dataset._target_=goodput.data.dataset.CsvManifest"]
    return args, f"train.csv line 3: path '{outside}/evil.pth' is absolute; refused"


def _index_outside(folder, tmp_path) -> tuple[list[str], str]:
    """A packed dataset whose index.json names its second train shard `../evil.tar`."""
    packed = tmp_path / "packed"
    pack(Storage(folder), Storage(str(packed)), shard_bytes=3000)
    index = json.loads((packed / INDEX).read_text())
    index["splits"]["train"]["shards"][1]["name"] = "../evil.tar"
    (packed / INDEX).write_text(json.dumps(index))
    (tmp_path / "outside").mkdir()
    return [
        f"data.root={packed}",
        "data=shards",
    ], "index.json splits.train.shards[1]: path '../evil.tar' climbs out"


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["single", "ddp"])
@pytest.mark.parametrize("dataset", [_csv_outside, _index_outside], ids=["csv", "shard-index"])
def test_a_path_outside_the_root_is_refused_in_one_line_exit_2(folder, tmp_path, dataset, parallel):
    """The refusal names the file and the entry, once, with no traceback, and the run exits 2 (a
    clean refusal), in one process and under the elastic agent, where the refusal happens in a
    worker: the agent restarts nobody (parallel.max_restarts=2 would have made 3 attempts of it)."""
    args, message = dataset(folder, tmp_path)
    if parallel == "ddp":
        args += ["parallel=ddp", "parallel.nproc_per_node=2", "parallel.max_restarts=2"]
    p, s = run_train(tmp_path / "run", *args, "trainer.global_batch_size=4", expect_rc=None)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and s is None, out[-3000:]
    assert len([line for line in out.splitlines() if message in line]) == 1, out[-3000:]  # one line
    assert "Traceback" not in out, out[-3000:]
    assert list((tmp_path / "outside").iterdir()) == []
    attempts = list((tmp_path / "run" / "runs").glob("**/elastic/*/attempt_*"))
    assert len(attempts) == (1 if parallel == "ddp" else 0), attempts


@pytest.mark.slow
def test_malformed_run_records_are_moved_aside_and_the_run_trains_to_its_summary(tmp_path, smoke_reference):
    """A hang record with a missing key (every start crashed on it) and an attempt record whose
    `compile` is not a mapping (the run trained, then crashed writing the summary), planted in a
    finished run that is then continued: both are moved aside, named in a warning, and the run trains
    on and writes its summary."""
    finished = Path(smoke_reference("dcp_sync")["checkpoint_dir"]).parents[1]  # its paths.root
    shutil.copytree(finished, tmp_path, symlinks=True, dirs_exist_ok=True)
    ck = ckpt_dir(tmp_path)
    (ck / "faults").mkdir(exist_ok=True)
    # detected after the commit the relaunch restores: the hang counts, so its `attempt` is read
    (ck / "faults" / "hung-attempt0-rank0.fired").write_text(
        json.dumps({"detected": time.time(), "hung_seconds": 2})
    )
    first = json.loads((ck / "attempts" / "0000.json").read_text())
    (ck / "attempts" / "0001.json").write_text(json.dumps({**first, "attempt": 1, "compile": [1.5]}))
    p, s = run_train(tmp_path, "checkpoint=dcp_sync", "trainer.max_steps=16")
    assert s["steps"] == 16 and s["resumed_from_steps"] == [12] and s["compile"] == []
    out = p.stdout + p.stderr
    for rel in ("faults/hung-attempt0-rank0.fired", "attempts/0001.json"):
        assert [
            f
            for f in os.listdir(ck / os.path.dirname(rel))
            if f.startswith(f"{os.path.basename(rel)}.malformed-")
        ]
        assert f"{rel}" in out and "moving it to" in out
