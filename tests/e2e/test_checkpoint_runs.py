"""Checkpoint drills on the entry point: SIGKILL at a step and during a save, then relaunch
→ bit-identical; the process-type async checkpointer; `inspect_checkpoint.py` lists and exports."""

from __future__ import annotations

import json
import os

import pytest
from helpers import ckpt_dir, run_train

from goodput.checkpoint import BACKENDS
from goodput.model import SmallCNN, model_sha256


# -- kill drills through the real entry point ---------------------------------------------------
# dcp_sync here; torch_save and dcp_async are killed after steps (and at every other point of a
# save) by e2e/test_reliability.py's seeded chaos drill, which ends with the same two checks.
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["dcp_sync"])
def test_kill_at_step_then_relaunch_is_bit_identical(tmp_path, smoke_reference, backend):
    ref = smoke_reference(backend)
    p, _ = run_train(tmp_path, f"checkpoint={backend}", "fault.kill_at_step=10", expect_rc=-9)
    _, s = run_train(tmp_path, f"checkpoint={backend}", "fault.kill_at_step=10")
    assert s["restarts"] == 1
    assert s["resumed_from_steps"] in ([8], [4])  # async: step 8 may not have committed before the kill
    if backend != "dcp_async":
        assert s["resumed_from_steps"] == [8]
    assert s["model_sha256"] == ref["model_sha256"]
    assert s["sample_order_sha256"] == ref["sample_order_sha256"]
    assert s["goodput"]["lost_seconds"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_kill_during_save_keeps_previous_checkpoint(tmp_path, smoke_reference, backend):
    ref = smoke_reference(backend)
    run_train(tmp_path, f"checkpoint={backend}", "fault.kill_during_save=8", expect_rc=-9)
    step8 = ckpt_dir(tmp_path) / "step-000000008"
    assert step8.exists() and not (step8 / "COMMIT.json").exists()  # half-written, not committed
    _, s = run_train(tmp_path, f"checkpoint={backend}", "fault.kill_during_save=8")
    assert s["resumed_from_steps"] == [4]
    assert s["model_sha256"] == ref["model_sha256"]
    assert s["sample_order_sha256"] == ref["sample_order_sha256"]


@pytest.mark.parametrize("backend", ["torch_save", "dcp_async"])
def test_inspect_lists_and_exports(tmp_path, smoke_reference, backend):
    import shutil
    import subprocess
    import sys

    from helpers import REPO
    from safetensors.torch import load_file

    s = smoke_reference(backend)
    ck = tmp_path / "smoke"
    shutil.copytree(s["checkpoint_dir"], ck, symlinks=True)  # the shared run's, copied: one is added
    os.makedirs(ck / "step-000000099")  # an incomplete one
    out = subprocess.run([sys.executable, "scripts/inspect_checkpoint.py", str(ck), "--json"],
                         cwd=REPO, capture_output=True, text=True, check=True)  # fmt: skip
    rows = {r["step"]: r for r in json.loads(out.stdout)}
    assert (
        rows[12]["status"] == "committed" and rows[12]["backend"] == backend and rows[12]["world_size"] == 1
    )
    assert rows[99]["status"] == "incomplete"
    cmd = [
        sys.executable,
        "scripts/inspect_checkpoint.py",
        str(ck),
        "--export",
        str(tmp_path / "m.safetensors"),
    ]
    subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    model = SmallCNN(num_classes=10, width=32)
    model.load_state_dict(load_file(tmp_path / "m.safetensors"))  # tensors only: no unpickling
    assert model_sha256(model) == s["model_sha256"]  # the exported weights are the final model, bit for bit


@pytest.mark.slow
def test_process_async_checkpointer_through_the_entry_point(tmp_path, smoke_reference):
    """checkpoint.backend.async_type=process: DCP's daemon process does the write; kill and resume
    still exact."""
    ref = smoke_reference("dcp_async")
    over = ["checkpoint=dcp_async", "checkpoint.backend.async_type=process", "checkpoint.every_n_steps=2"]
    run_train(tmp_path, *over, "fault.kill_at_step=9", expect_rc=-9)
    _, s = run_train(tmp_path, *over, "fault.kill_at_step=9")
    assert s["resumed_from_steps"] and s["resumed_from_steps"][0] in (6, 8)
    assert s["model_sha256"] == ref["model_sha256"]
    commit = json.loads((ckpt_dir(tmp_path) / "step-000000012" / "COMMIT.json").read_text())
    assert commit["backend"] == "dcp_async"
