"""A compiled run on the entry point, killed and relaunched, reads its compile cache and ends with
the uninterrupted model."""

from __future__ import annotations

import sys

import pytest
from helpers import run_train


@pytest.mark.slow
@pytest.mark.serial  # the warm first step against the cold one
def test_a_compiled_run_killed_and_relaunched_reads_its_cache(tmp_path):
    """Kill at step 6 (commit at 4), relaunch: the uninterrupted compiled model, and the second
    start compiled from its cache (inductor hits, no misses, artifacts loaded) in a fraction of the
    first start's compile. The reference shares the compile cache (warm: a compile is ~30 s here)."""
    cache = f"trainer.compile_cache_dir={tmp_path / 'compile_cache'}"
    # global batch 8: the 40 val images make 5 equal batches, one inference graph to compile
    args = ("trainer.compile=true", cache, "checkpoint=dcp_sync", "trainer.global_batch_size=8")
    p, _ = run_train(tmp_path / "a", *args, "fault.kill_at_step=6", expect_rc=-9, timeout=600)
    _, s = run_train(tmp_path / "a", *args, "fault.kill_at_step=6", timeout=600)
    _, ref = run_train(tmp_path / "ref", *args, timeout=600)
    assert s["resumed_from_steps"] == [4] and s["model_sha256"] == ref["model_sha256"]
    cold, warm = s["compile"]
    assert cold["attempt"] == 0 and cold["cache_artifacts_loaded"] == 0
    assert cold["fxgraph_cache_miss"] > 0 and cold["fxgraph_cache_hit"] == 0
    assert warm["attempt"] == 1 and warm["cache_artifacts_loaded"] > 0 and warm["cache_source"] == "local"
    assert warm["fxgraph_cache_miss"] == 0 and warm["fxgraph_cache_hit"] > 0
    assert warm["first_step_seconds"] < 0.5 * cold["first_step_seconds"], (cold, warm)
    assert s["recovery"]["per_restart"][0]["compile_seconds"] == warm["first_step_seconds"]
    g = s["goodput"]
    assert g["compile_seconds"] >= cold["first_step_seconds"] > g["productive_seconds"]
    print(f"cold {cold['first_step_seconds']}, warm {warm['first_step_seconds']}", file=sys.stderr)
