"""What a resume checks of the data (docs/data.md, "What a resume checks"): the training listing's
file count, names and sizes against the checkpoint's. An ImageFolder whose images were replaced in
place under the same names, or renamed at the same count, is refused on resume (exit 2, naming
data.root, what changed and how to start a new run), on every rank alike; it never resumes silently
on other data. The job runs in this process (helpers.run_job_here)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import run_job_here

from goodput.data.dataset import ImageFolder
from goodput.data.loader import DatasetChangedError
from goodput.data.synthetic import make_dataset
from goodput.errors import IncompatibleCheckpoint, UserError
from goodput.storage.remote import Storage


def _own_data(tmp_path: Path, seed: int = 0) -> Path:
    root = tmp_path / f"data-{seed}"
    make_dataset(str(root), num_classes=3, train_per_class=8, val_per_class=2, image_size=16, seed=seed)
    return root


def _listing(root: Path) -> tuple[list[str], list[int]]:
    files = ImageFolder(Storage(str(root)), "train")
    return files.files, files.sizes


def _run_then_change(tmp_path: Path, change) -> tuple[Path, list[str]]:
    data = _own_data(tmp_path)
    keys = [f"data.root={data}", "mlflow.log_model=none"]
    first, _ = run_job_here(tmp_path, *keys, "trainer.max_steps=4")
    assert first["steps"] == 4
    change(data)
    return data, keys


def _replaced_in_place(data: Path) -> None:
    """Other images (the demo generator with another seed) copied over the old ones, same names."""
    before = _listing(data)
    other = _own_data(data.parent, seed=1)
    for rel in before[0]:
        shutil.copyfile(other / rel, data / rel)
    after = _listing(data)
    assert after[0] == before[0] and after[1] != before[1]  # same names, other sizes


def _renamed(data: Path) -> None:
    """One image renamed (its class folder kept): the same count, another file list."""
    files, _ = _listing(data)
    os.rename(data / files[0], data / files[0].replace(".jpg", "-renamed.jpg"))


@pytest.mark.parametrize(
    "change, said",
    [
        (
            _replaced_in_place,
            "the same 24 training file names, other file sizes: files were replaced in place",
        ),
        (_renamed, "the same number of training files (24), other file names"),
    ],
)
def test_a_resume_on_data_changed_in_place_is_refused_naming_the_root(tmp_path, one_process, change, said):
    data, keys = _run_then_change(tmp_path, change)
    with pytest.raises(IncompatibleCheckpoint) as e:  # the restore's: every rank stops with it
        run_job_here(tmp_path, *keys, "trainer.max_steps=8", run_dir=tmp_path / "again")
    msg = str(e.value)
    assert isinstance(e.value, UserError) and isinstance(e.value.__cause__, DatasetChangedError)  # exit 2
    assert "step-000000004 cannot continue this run" in msg
    assert f"data.root={data} changed since the checkpoint" in msg and said in msg, msg
    assert "run.name=" in msg  # how to train on the new data: a run of its own
