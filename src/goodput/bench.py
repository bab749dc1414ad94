"""Shared helpers for scripts/bench_*.py: machine record, medians, markdown tables, JSON and PNG output.

The benchmarks run on whatever machine is at hand, often a shared and noisy one: every figure is a
median of repeats, and comparisons are ratios of rows measured side by side in the same run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from goodput.parallel import LAUNCHER_ENV, free_port  # noqa: F401  (free_port: re-exported for the bench scripts)


def machine_info() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        model = platform.processor()
    try:
        import torchvision

        tv = torchvision.__version__
    except ImportError:
        tv = None
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "torchvision": tv,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def machine_line(m: dict) -> str:
    return (
        f"{m['cpu_count']} CPU ({m['cpu_model'] or 'unknown'}), GPU: {m['gpu'] or 'none'}, "
        f"torch {m['torch']}, python {m['python']}, {m['date']}"
    )


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds per call of fn, `repeats` times."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def fmt(v, digits: int = 3) -> str:
    if isinstance(v, float):
        if v != v:  # NaN
            return "-"
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    cells = [[str(h) for h in headers]] + [[fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def target(name: str, measured: float, limit: float, ok: bool, detail: str = "") -> dict:
    """A target is evaluated on the measured figure and reported either way: never tuned away."""
    return {"name": name, "measured": measured, "limit": limit, "pass": bool(ok), "detail": detail}


def target_line(t: dict) -> str:
    return f"{'PASS' if t['pass'] else 'MISS'}  {t['name']}: {t['detail']}"


def write_json(path: str | Path, obj: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def bar_chart(
    path: str | Path, title: str, panels: Sequence[tuple[str, Sequence[str], Sequence[float]]]
) -> None:
    """One horizontal bar panel per (ylabel, labels, values), stacked vertically, written as PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    n = len(panels)
    height = sum(0.35 * len(p[1]) + 1.0 for p in panels)
    fig, axes = plt.subplots(n, 1, figsize=(8, max(3.0, height)), squeeze=False)
    for ax, (xlabel, labels, values) in zip(axes[:, 0], panels):
        ys = list(range(len(labels)))
        ax.barh(ys, values, color="#4c72b0")
        ax.set_yticks(ys, labels)
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        for y, v in zip(ys, values):
            ax.text(v, y, f" {fmt(float(v))}", va="center", fontsize=8)
        ax.margins(x=0.15)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def clean_dist_env() -> None:
    """A 1-rank run must not see a launcher's variables (init_distributed would wait for peers)."""
    for k in LAUNCHER_ENV:
        os.environ.pop(k, None)


_T0 = time.perf_counter()


def log(msg: str) -> None:
    """Progress on stderr with seconds since start, so a slow phase is easy to spot."""
    print(f"[{time.perf_counter() - _T0:5.0f}s] {msg}", file=sys.stderr, flush=True)
