"""Seeing the step: stragglers across ranks, a torch.profiler trace, MFU (docs/observability.md).

Everything here runs at a log window or once at start, never per step (the profiler only while
trainer.profile_* asks for it), so the loop's speed is what it was without it.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def gather_ranks(values: list[float], world: int) -> torch.Tensor:
    """One all_gather: row r holds rank r's `values` (float64; through the device under NCCL,
    which takes no CPU tensors)."""
    t = torch.tensor(values, dtype=torch.float64)
    if world == 1:
        return t[None]
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else t.device
    out = [torch.empty_like(t, device=device) for _ in range(world)]
    dist.all_gather(out, t.to(device))
    return torch.stack(out).cpu()


def rank_stats(step_s: torch.Tensor) -> dict:
    """Max, median and the slowest rank of per-rank step seconds. The median is the lower one for
    an even count (torch's): with 2 ranks the slowest is compared to the other rank, not to the
    mean of both (which it can never exceed twice)."""
    slowest = int(torch.argmax(step_s).item())
    return {
        "perf/step_seconds_max": step_s[slowest].item(),
        "perf/step_seconds_median": step_s.median().item(),
        "perf/slowest_rank": float(slowest),
    }


class StragglerWatch:
    """Warns when the slowest rank's step time exceeds `factor` x the median for `windows` log
    windows in a row (one window over the factor is noise: a checkpoint, a GC pause). Every rank
    sees the same gathered numbers; only rank 0 warns."""

    def __init__(self, factor: float, windows: int, rank: int):
        self.factor, self.windows, self.rank = factor, windows, rank
        self.suspect, self.count = None, 0
        self.warned: list[tuple[int, int]] = []  # (rank, step) of each warning

    def check(self, perf: dict, step: int) -> None:
        slow, mx, med = (
            int(perf["perf/slowest_rank"]),
            perf["perf/step_seconds_max"],
            perf["perf/step_seconds_median"],
        )
        if med > 0 and mx > self.factor * med:
            self.count = self.count + 1 if slow == self.suspect else 1
            self.suspect = slow
        else:
            self.suspect, self.count = None, 0
        if self.count == self.windows:  # once per streak; a new streak warns again
            self.warned.append((slow, step))
            if self.rank == 0:
                log.warning(
                    "straggler: rank %d is slower than %.2fx the median step time for %d log windows "
                    "(step %d: %.4fs vs median %.4fs)",
                    slow, self.factor, self.windows, step, mx, med,
                )  # fmt: skip


# -- MFU --------------------------------------------------------------------------------------
# Dense peak TFLOP/s per device (no sparsity), from the vendors' data sheets. Order matters: the
# first substring of the device name that matches wins (PCIe before the SXM default).
PEAK_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("H200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
)
PRECISION_KIND = {"32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}


def peak_flops(device: torch.device, precision: str, peak_tflops: float | None) -> float | None:
    """FLOP/s of one device: trainer.peak_tflops, else the table for a known GPU, else None."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS:
        if key in name:
            return peaks[PRECISION_KIND[str(precision)]] * 1e12
    return None


def flops_per_sample(model: torch.nn.Module, sample_shape: tuple) -> float:
    """FLOPs of one forward and backward per sample, counted by torch.utils.flop_counter on the meta
    device: meta stand-ins of the model's parameters and buffers (torch.func.functional_call) and
    of a batch of 2. Shapes are all a count needs, so nothing of the model's size is allocated
    (a copy of the unsharded model would be: under FSDP, the memory FSDP is there to save) and the
    real weights, gradients, buffers and the RNG stay untouched."""
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    def meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)

    state = {n: meta(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    x = torch.zeros((2, *sample_shape), device="meta")
    with FlopCounterMode(display=False) as fc:  # (the loss's own FLOPs are the logits': negligible)
        functional_call(model, state, (x,)).float().sum().backward()
    return fc.get_total_flops() / 2


class MFU:
    """perf/mfu = FLOPs per sample x images/s / (peak FLOP/s x ranks); off when the peak is unknown
    (or the model cannot run on the meta device)."""

    def __init__(self, model, sample_shape, device, precision, peak_tflops, world):
        self.peak = peak_flops(device, precision, peak_tflops)
        self.flops = None
        if self.peak is not None:
            try:
                self.flops = flops_per_sample(model, sample_shape)
            except Exception as e:  # an op without a meta kernel: no metric, never a failed run
                log.warning("perf/mfu is off: counting the model's FLOPs on the meta device failed: %r", e)
                self.peak = None
        if self.flops is not None:
            log.info(
                "MFU: %.4g FLOPs per sample (forward+backward), peak %.4g FLOP/s x %d",
                self.flops,
                self.peak,
                world,
            )
        self.world = world

    def __call__(self, perf: dict) -> dict:
        if self.peak is None:
            return {}
        return {"perf/mfu": self.flops * perf["perf/images_per_second"] / (self.peak * self.world)}


# -- profiler ---------------------------------------------------------------------------------
class StepProfiler:
    """torch.profiler over steps [start, start + n) (numbered as the metrics are: the step that
    ends at metric step k is step k), a Chrome trace per rank (`trace-rank<r>.json`) and, on
    CUDA, a memory snapshot (`memory-rank<r>.pickle`, for pytorch.org/memory_viz), in
    `<out_dir>/profiler/`; rank 0's go to MLflow under `profiler/`."""

    def __init__(self, start: int | None, n: int, out_dir: str, rank: int, device, tracker):
        self.start, self.n, self.rank, self.device, self.tracker = start, n, rank, device, tracker
        self.dir = os.path.join(out_dir, "profiler")
        self.prof, self._mark = None, None
        self.done = start is None

    def at(self, step: int) -> None:
        """At the top of the loop, `step` steps done: start before step `start`, stop after the last."""
        if self.done:
            return
        if self.prof is None and step + 1 > self.start:  # resumed past it: not this attempt's
            self.done = True
            return
        if self.prof is None and step + 1 == self.start:
            self._begin(step)
        elif self.prof is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
            if step + 1 >= self.start + self.n:
                self.stop()
                return
        if self.prof is not None:  # the trace's label of the step now starting (metric step k)
            self._mark = torch.profiler.record_function(f"ProfilerStep#{step + 1}")
            self._mark.__enter__()

    def _begin(self, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        if self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.prof = profile(activities=acts, record_shapes=True, with_stack=False)
        self.prof.start()
        log.info("profiler: recording steps %d..%d", self.start, self.start + self.n - 1)

    def stop(self) -> None:
        """Write the trace (also at the loop's end if it stops inside the profiled steps)."""
        if self.prof is None:
            return
        prof, self.prof, self.done = self.prof, None, True
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        prof.stop()
        os.makedirs(self.dir, exist_ok=True)
        trace = os.path.join(self.dir, f"trace-rank{self.rank}.json")
        prof.export_chrome_trace(trace)
        files = [trace]
        if self.device.type == "cuda":
            snap = os.path.join(self.dir, f"memory-rank{self.rank}.pickle")
            torch.cuda.memory._dump_snapshot(snap)
            torch.cuda.memory._record_memory_history(enabled=None)
            files.append(snap)
        log.info("profiler: wrote %s", ", ".join(files))
        for f in files:  # the tracker is rank 0's only: other ranks' files stay in the run dir
            self.tracker.artifact(f, "profiler")
