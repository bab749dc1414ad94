"""The straggler drill on the entry point: 2 DDP ranks, one slowed, and the watch names it."""

from __future__ import annotations

import pytest
from helpers import run_train
from mlflow.tracking import MlflowClient


@pytest.mark.slow
@pytest.mark.serial  # step times: a busy neighbour would make the other rank slow too
def test_straggler_drill_names_the_slow_rank(tmp_path):
    """2-rank DDP: rank 1 sleeps 0.3 s per step: the warning names it. The same job without the
    drill warns of none: tests/e2e/test_parallel.py's ddp_reference asserts it (a run the suite has)."""
    drill = ["fault.slow_rank=1", "fault.slow_seconds=0.3", "trainer.straggler_windows=2"]
    p, s = run_train(tmp_path, "parallel=ddp", "checkpoint=torch_save", *drill)
    log = p.stdout + p.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = s["mlflow_run_id"]
    slowest = [m.value for m in client.get_metric_history(run_id, "perf/slowest_rank")]
    assert slowest == [1.0] * 6  # 12 steps, a window every 2
    assert "straggler: rank 1 is slower" in log and "straggler: rank 0" not in log
    assert "perf/mfu" not in client.get_run(run_id).data.metrics  # CPU, no trainer.peak_tflops
