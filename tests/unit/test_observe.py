"""Seeing the step (docs/observability.md): FLOP counts, MFU, stragglers, the profiler trace, and
MLflow's system metrics."""

from __future__ import annotations

import copy
import json
import logging
import time

import pytest
import torch
from helpers import run_job_here
from mlflow.tracking import MlflowClient
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from goodput.run.observe import MFU, StragglerWatch, flops_per_sample, rank_stats
from goodput.tracking import Tracker, start_run

CPU = torch.device("cpu")


def test_flops_per_sample_match_a_hand_count():
    # Linear(10, 5): forward 2*10*5 = 100 per sample; backward only the weight's gradient (the input
    # needs none): another 100. The bias add is not a matmul and is not counted.
    assert flops_per_sample(torch.nn.Linear(10, 5), (10,)) == 200
    # Conv2d(3, 4, 3) on 8x8 -> 4x6x6: forward 2 * (4*6*6) * (3*3*3) = 7776, its weight gradient
    # the same (no input gradient); Linear(144, 5): forward 1440, input and weight gradients 1440 each.
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5))
    assert flops_per_sample(m, (3, 8, 8)) == 2 * 7776 + 3 * 1440


class Allocations(TorchDispatchMode):
    """Every tensor an op makes while it is on: its device and bytes."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made.append((t.device.type, t.numel() * t.element_size()))
        return out


def _count_on_a_copy(model, shape) -> float:
    """How perf/mfu counted before #34: a deep copy of the model, run forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    m = copy.deepcopy(model).train()
    with FlopCounterMode(display=False) as fc:
        torch.nn.functional.cross_entropy(
            m(torch.zeros((2, *shape))), torch.zeros(2, dtype=torch.long)
        ).backward()
    return fc.get_total_flops() / 2


@pytest.mark.parametrize("name", ["small_cnn", "resnet18"])
def test_flops_are_counted_on_meta_as_on_a_copy_allocating_nothing(name):
    """#34: under FSDP perf/mfu copied the unsharded model and ran it (+927 MiB for a 384 MiB model).
    The count on the meta device is the copy's; no op makes a tensor on a real device (the copy's
    parameters would be), and the model's weights, buffers, gradients and the RNG are untouched."""
    import torchvision

    from goodput.model import SmallCNN

    shape = (3, 32, 32)
    model = SmallCNN(num_classes=10) if name == "small_cnn" else torchvision.models.resnet18(num_classes=10)
    want = _count_on_a_copy(model, shape)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with Allocations() as alloc:
        got = flops_per_sample(model, shape)
    assert got == want and got > 0
    real = [(device, n) for device, n in alloc.made if device != "meta"]
    assert real == [], f"{len(real)} tensors on a real device, {sum(n for _, n in real)} bytes"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_mfu_needs_a_known_peak():
    m = torch.nn.Linear(10, 5)
    perf = {"perf/images_per_second": 1e9}
    got = MFU(m, (10,), CPU, "32", 0.5, world=2)(perf)  # 200 FLOPs x 1e9/s over 2 x 0.5e12
    assert got == {"perf/mfu": pytest.approx(200 * 1e9 / (2 * 0.5e12))}
    assert MFU(m, (10,), CPU, "32", None, world=2)(perf) == {}  # CPU: no table entry, no metric


class ReadsItsData(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * float(x.sum() > 0)  # a value, which a meta tensor has not


def test_a_model_that_cannot_run_on_meta_gets_no_mfu_and_trains_on(caplog):
    with caplog.at_level(logging.WARNING, logger="goodput.run.observe"):
        mfu = MFU(ReadsItsData(10, 5), (10,), CPU, "32", 0.5, world=1)
    assert mfu({"perf/images_per_second": 1e9}) == {}
    assert "perf/mfu is off" in caplog.text


def test_straggler_watch_names_the_rank_after_consecutive_windows(caplog):
    w = StragglerWatch(factor=1.5, windows=2, rank=0)
    fast = rank_stats(torch.tensor([0.10, 0.11, 0.10, 0.12], dtype=torch.float64))
    slow = rank_stats(torch.tensor([0.10, 0.10, 0.31, 0.11], dtype=torch.float64))
    assert slow["perf/slowest_rank"] == 2 and slow["perf/step_seconds_median"] == 0.10  # the lower median
    with caplog.at_level(logging.WARNING, logger="goodput.run.observe"):
        for step, perf in enumerate([slow, fast, slow, slow, slow, fast, slow], 1):
            w.check(perf, step)
    # one slow window alone is noise; the streak at windows 3-5 warns once, at its second window
    assert w.warned == [(2, 4)]
    assert "straggler: rank 2" in caplog.text
    # two ranks: the slowest against the other one (the mean of both can never be exceeded twice)
    two = rank_stats(torch.tensor([0.1, 0.3], dtype=torch.float64))
    assert two["perf/step_seconds_median"] == 0.1 and two["perf/slowest_rank"] == 1


def _system_steps(client, run_id):
    hist = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    return sorted(m.step for m in hist)


def test_system_metrics_continue_the_run_across_restarts(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = start_run(uri, "obs", "r", {}, None)
    client = MlflowClient(uri)
    for attempt in range(2):  # a worker, then its restart (the first closed the run FAILED)
        t = Tracker(uri, run_id, enabled=True, system_metrics_interval_s=0.1)
        time.sleep(0.6)
        t.close("FAILED" if attempt == 0 else "FINISHED")
        steps = _system_steps(client, run_id)
        assert steps, f"attempt {attempt}: no system/ metrics"
        if attempt == 0:
            first = steps
    assert len(steps) > len(first) and steps == sorted(set(steps))  # appended, no step twice
    keys = client.get_run(run_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(keys)


def test_profiler_trace_mfu_and_system_metrics_reach_mlflow(tmp_path, one_process):
    summary, c = run_job_here(
        tmp_path, "trainer.profile_start_step=3", "trainer.profile_steps=2", "trainer.peak_tflops=1.0",
        "mlflow.system_metrics_interval_s=0.2",
    )  # fmt: skip
    trace = json.loads((tmp_path / "run" / "profiler" / "trace-rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"ProfilerStep#3", "ProfilerStep#4"} <= names and "ProfilerStep#5" not in names
    step3 = next(e for e in trace["traceEvents"] if e.get("name") == "ProfilerStep#3")
    inside = [e for e in trace["traceEvents"] if e.get("name", "").startswith("aten::convolution")
              and step3["ts"] <= e["ts"] <= step3["ts"] + step3["dur"]]  # fmt: skip
    assert inside, "no convolution inside the profiled step"

    client = MlflowClient(c.mlflow.tracking_uri)
    run_id = summary["mlflow_run_id"]
    assert [a.path for a in client.list_artifacts(run_id, "profiler")] == ["profiler/trace-rank0.json"]
    metrics = client.get_run(run_id).data.metrics
    mfu = client.get_metric_history(run_id, "perf/mfu")
    assert mfu and all(0 < m.value < 1 for m in mfu)
    assert {"perf/step_seconds_max", "perf/step_seconds_median", "perf/slowest_rank"} <= set(metrics)
    assert any(k.startswith("system/") for k in metrics)
