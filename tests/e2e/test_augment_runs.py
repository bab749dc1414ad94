"""The augment presets on the entry point: a real run finishes, and the option acts (another model)."""

from __future__ import annotations

import pytest
from helpers import run_train


@pytest.mark.parametrize("preset", ["none", "light"])
def test_presets_on_the_entry_point(tmp_path, smoke_reference, preset):
    _, s = run_train(tmp_path, f"augment={preset}", "checkpoint=dcp_sync")
    assert s["steps"] == 12 and s["val_accuracy"] is not None
    assert s["model_sha256"] != smoke_reference("dcp_sync")["model_sha256"]  # the option did act
