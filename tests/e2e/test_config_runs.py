"""The config on the entry point: a custom model and LR scheduler by `_target_` in a real run."""

from __future__ import annotations

from helpers import run_train


def test_own_model_and_scheduler_on_the_entry_point(tmp_path, smoke_reference):
    """docs/config.md's examples: any model and any LR scheduler are a `_target_` node."""
    _, s = run_train(tmp_path, "model=resnet18", "optim/schedule=step", "optim.schedule.step_size=4")
    assert s["steps"] == 12 and s["last_committed_step"] == 12
    assert s["model_sha256"] != smoke_reference("dcp_sync")["model_sha256"]
