"""Refusals are decided by the commit a launch continues, its bytes verified. A junk step dir far
ahead of the run's commits (sizes right, checksums wrong) with an edited class list or identity
record is skipped with a warning naming it, as any corrupt commit is, and the run continues from its
real commit; the same edit on a commit that verifies is refused, exit 2, naming that step dir.
The job runs in this process (helpers.run_job_here; no process group of the module's own)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
from helpers import run_job_here

from goodput.checkpoint.layout import COMMIT
from goodput.errors import IncompatibleCheckpoint, UserError
from goodput.run.job import IdentityChanged

FIRST = ("trainer.max_steps=4", "mlflow.log_model=none")  # one commit: step 4 (experiment=smoke)
LONGER = ("trainer.max_steps=8", "mlflow.log_model=none")


def _other_classes(rec: dict) -> None:
    rec["model"]["classes"] = [f"not-{c}" for c in rec["model"]["classes"]]


def _other_identity(rec: dict) -> None:
    rec["identity"]["keys"]["model.width"] = 64
    rec["identity"]["digest"] = "0" * 8


EDITS = {"classes": _other_classes, "identity": _other_identity}


def _junk_ahead(ck: Path, edit: str) -> Path:
    """A junk step dir far ahead of the run's commits, as an attacker (or a bad copy) plants it: the
    newest commit copied as step 100, every file's bytes changed at the same size (only the
    checksums tell), and its record's class list or identity record edited."""
    newest = max(p for p in ck.iterdir() if re.fullmatch(r"step-\d{9}", p.name))
    junk = ck / "step-000000100"
    shutil.copytree(newest, junk)
    rec = json.loads((junk / COMMIT).read_text())
    rec["step"] = 100
    EDITS[edit](rec)
    (junk / COMMIT).write_text(json.dumps(rec))
    for name in rec["files"]:
        data = bytearray((junk / name).read_bytes())
        data[-1] ^= 0xFF
        (junk / name).write_bytes(bytes(data))
    return junk


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_junk_step_ahead_with_an_edited_record_is_skipped_not_blamed_on_the_user(
    tmp_path, one_process, caplog, edit
):
    """Were its record believed, every relaunch would exit 2 blaming the data ("the dataset's
    classes changed") or the config ("other identity keys")."""
    first, _ = run_job_here(tmp_path, *FIRST)
    junk = _junk_ahead(Path(first["checkpoint_dir"]), edit)
    caplog.set_level(logging.WARNING)
    s, _ = run_job_here(tmp_path, *LONGER, run_dir=tmp_path / "again")
    assert s["resumed_from_steps"] == [4] and s["steps"] == 8
    assert f"not trusting {junk}" in caplog.text
    assert not junk.exists()  # moved aside: newer than the resumed step, another lineage


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_the_same_edit_on_the_commit_that_verifies_is_refused_naming_its_step_dir(
    tmp_path, one_process, edit
):
    """The commit the run continues says other classes or other identity keys (its record edited,
    its bytes intact: what a genuine change of the data or the config looks like to the relaunch):
    refused, exit 2 (a UserError), the message naming that step dir."""
    first, _ = run_job_here(tmp_path, *FIRST)
    step = Path(first["checkpoint_dir"]) / "step-000000004"
    rec = json.loads((step / COMMIT).read_text())
    EDITS[edit](rec)
    (step / COMMIT).write_text(json.dumps(rec))
    refusal = IdentityChanged if edit == "identity" else IncompatibleCheckpoint
    with pytest.raises(refusal) as e:
        run_job_here(tmp_path, *LONGER, run_dir=tmp_path / "again")
    said = str(e.value)
    assert isinstance(e.value, UserError) and str(step) in said
    assert (
        "model.width (the run: 64, this launch: 32)" in said
        if edit == "identity"
        else "the dataset's classes changed" in said
    )
