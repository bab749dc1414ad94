"""Data-loading benchmark: the project's ResumableLoader on an emulated remote, remote vs cached.

    python scripts/bench_data.py                          # 10 classes x 2000 JPEGs at 64px, 30 steps a row
    python scripts/bench_data.py --latency-ms 30 --bandwidth-mb-s 50 --compute-ms 100

Rows (same num_workers, batch and steps; a fixed sleep per step stands in for the accelerator):
  remote        every read goes to the remote
  cached cold   empty cache dir, sampler-aware prefetch on (the first epoch of a job)
  cached warm   the same steps again over the filled cache (later epochs, or a restart on the node)
  floor         the same files decoded and augmented from memory: no storage at all
Per row: images/s, mean seconds blocked in next(loader) per step, share of the time spent waiting.
Rows are medians of --repeats, interleaved (remote, cold, warm, floor, remote, ...) so drift in a
noisy machine hits all rows alike. Then the cached-cold row is swept over prefetch_steps x
prefetch_threads (one run per cell) to show what to set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from goodput.bench import (
    bar_chart,
    log,
    machine_info,
    machine_line,
    markdown_table,
    median,
    ratio,
    target,
    target_line,
    write_json,
)
from goodput.data.loader import DataConfig, ResumableLoader
from goodput.data.synthetic import make_dataset
from goodput.storage import Storage, StorageConfig

ROWS = ["remote", "cached cold", "cached warm", "floor"]


class MemorySource:
    """The floor: serves bytes read beforehand into a dict; same interface as RemoteSource."""

    def __init__(self, storage: Storage, blobs: dict[str, bytes]):
        self.storage, self.blobs = storage, blobs

    def read(self, rel: str) -> tuple[bytes, bool, int]:
        return self.blobs[rel], True, 0

    def prefetch(self, rels: list[str], protect: set[str]) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def dataset(a) -> str:
    """Generate once per size under --data-root; a marker written last says it is complete."""
    root = os.path.join(a.data_root, f"{a.classes}x{a.per_class}-{a.image_size}px")
    marker = os.path.join(root, "bench-dataset.json")
    if os.path.exists(marker):
        log(f"reusing the dataset at {root}")
        return root
    log(f"generating {a.classes * a.per_class} JPEGs into {root} (once) ...")
    t0 = time.perf_counter()
    counts = make_dataset(root, a.classes, a.per_class, 1, a.image_size, seed=0, threads=4)
    with open(marker, "w") as f:
        json.dump(counts, f)
    log(f"generated in {time.perf_counter() - t0:.1f}s")
    return root


def run(a, storage: Storage, kind: str, cache_dir: str, prefetch_steps: int, threads: int, steps: int):
    cfg = DataConfig(
        backend="cached" if kind.startswith("cached") else "remote",
        root=storage.root,
        cache_dir=cache_dir,
        image_size=a.image_size,
        num_workers=a.num_workers,
        prefetch_factor=a.prefetch_factor,
        prefetch_steps=prefetch_steps,
        prefetch_threads=threads,
        cache_limit=None,
        on_bad_sample="error",
    )
    loader = ResumableLoader(cfg, storage, a.seed, a.batch, steps, 0, 1, torch.device("cpu"))
    if kind == "floor":  # the same files, read into memory before the clock starts
        order, files = loader.order, loader.files.files
        rels = {files[i] for s in range(steps) for i in order.rank_batch(s, 0, 1)}
        plain = Storage(storage.root)  # no emulation: this is not part of the measurement
        mem = MemorySource(storage, {r: plain.read_bytes(r) for r in rels})
        loader.source = loader.dataset.source = mem  # before the first next(): workers fork after it
    fetch = []
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        next(loader)
        fetch.append(time.perf_counter() - t)
        time.sleep(a.compute_ms / 1000)  # the accelerator's share of the step
    total = time.perf_counter() - t0
    stats = loader.stats()
    loader.close()
    images = steps * a.batch
    return {
        "images_per_s": images / total,
        "fetch_s_per_step": sum(fetch) / steps,
        "wait_share": sum(fetch) / total,
        "seconds": total,
        "hit_rate": stats["data/cache_hits"] / images,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", default="outputs/bench/data", help="generated once, reused")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=2000, help="training JPEGs per class")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--latency-ms", type=float, default=10.0, help="emulated remote latency per file op")
    p.add_argument("--bandwidth-mb-s", type=float, default=100.0, help="emulated per-stream bandwidth")
    p.add_argument("--batch", type=int, default=256)
    # 30 steps x 256 images = 7680 images, under half an epoch: the remote row alone reads at ~170
    # images/s here, so 3 repeats of it take about 2 minutes; a whole epoch would take 6 per repeat.
    p.add_argument("--steps", type=int, default=30, help="steps per row")
    p.add_argument("--compute-ms", type=float, default=50.0, help="synthetic compute per step")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers, the same for every row")
    p.add_argument("--prefetch-factor", type=int, default=4)
    p.add_argument("--prefetch-steps", type=int, default=8, help="cached rows (conf/data default)")
    p.add_argument("--prefetch-threads", type=int, default=16, help="cached rows (conf/data default)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the four rows (median)")
    p.add_argument("--sweep-prefetch-steps", default="1,4,16", help="comma list; empty = no sweep")
    p.add_argument("--sweep-threads", default="4,16,32", help="comma list")
    p.add_argument("--sweep-steps", type=int, default=20, help="steps per sweep cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/bench", help="JSON, PNG and scratch space go here")
    a = p.parse_args()
    if a.classes * a.per_class < a.batch * max(a.steps, a.sweep_steps):
        p.error("the dataset must hold --steps and --sweep-steps batches (rows run within one epoch)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    log(f"machine: {machine_line(machine)}")
    root = dataset(a)
    storage = Storage(root, StorageConfig(a.latency_ms, a.bandwidth_mb_s))
    work = tempfile.mkdtemp(prefix="data-", dir=out)

    samples: dict[str, list[dict]] = {k: [] for k in ROWS}
    sweep = []
    try:
        for rep in range(a.repeats):
            cache = os.path.join(work, f"cache-{rep}")  # empty: cold; the warm row reuses it
            for kind in ROWS:
                log(f"repeat {rep + 1}/{a.repeats}: {kind} ...")
                r = run(a, storage, kind, cache, a.prefetch_steps, a.prefetch_threads, a.steps)
                samples[kind].append(r)
            shutil.rmtree(cache, ignore_errors=True)
        ps_list = [int(v) for v in a.sweep_prefetch_steps.split(",") if v.strip()]
        th_list = [int(v) for v in a.sweep_threads.split(",") if v.strip()]
        for ps in ps_list:
            for th in th_list:
                log(f"sweep: cached cold, prefetch_steps={ps} prefetch_threads={th} ...")
                cache = os.path.join(work, f"sweep-{ps}-{th}")
                r = run(a, storage, "cached cold", cache, ps, th, a.sweep_steps)
                sweep.append({"prefetch_steps": ps, "prefetch_threads": th, **r})
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = []
    for kind in ROWS:
        s = samples[kind]
        rows.append(
            {
                "row": kind,
                **{k: median([x[k] for x in s]) for k in s[0]},
                "images_per_s_samples": [x["images_per_s"] for x in s],
            }
        )
    by = {r["row"]: r for r in rows}
    for r in rows:
        r["vs_floor"] = ratio(r["images_per_s"], by["floor"]["images_per_s"])
        r["vs_remote"] = ratio(r["images_per_s"], by["remote"]["images_per_s"])

    warm, cold, floor, remote = by["cached warm"], by["cached cold"], by["floor"], by["remote"]
    targets = [
        target(
            "cached warm >= 90% of the floor's images/s",
            warm["vs_floor"],
            0.9,
            warm["vs_floor"] >= 0.9,
            f"{warm['images_per_s']:.0f} vs {floor['images_per_s']:.0f} img/s = "
            f"{100 * warm['vs_floor']:.0f}%",
        ),
        target(
            "cached cold (prefetch on) >= 3x remote images/s",
            cold["vs_remote"],
            3.0,
            cold["vs_remote"] >= 3.0,
            f"{cold['images_per_s']:.0f} vs {remote['images_per_s']:.0f} img/s = {cold['vs_remote']:.1f}x",
        ),
    ]

    head = (
        f"Data benchmark: {a.classes * a.per_class} JPEGs ({a.classes} classes, {a.image_size}px) on a "
        f"remote emulated at {a.latency_ms:g} ms per file op, {a.bandwidth_mb_s:g} MB/s per stream; "
        f"batch {a.batch}, {a.steps} steps per row (not a whole epoch: remote reads would take minutes), "
        f"{a.num_workers} workers, prefetch_factor {a.prefetch_factor}, {a.compute_ms:g} ms synthetic "
        f"compute per step; cached rows use prefetch_steps={a.prefetch_steps}, "
        f"prefetch_threads={a.prefetch_threads}.\n"
        f"Machine: {machine_line(machine)}.\n"
        f"Medians of {a.repeats} interleaved repeats; each row's time includes starting its DataLoader "
        f"workers."
    )
    table = markdown_table(
        ["row", "images/s", "fetch s / step", "waiting share", "vs floor", "vs remote", "cache hit rate"],
        [
            [
                r["row"],
                r["images_per_s"],
                r["fetch_s_per_step"],
                f"{100 * r['wait_share']:.0f}%",
                r["vs_floor"],
                r["vs_remote"],
                f"{100 * r['hit_rate']:.0f}%" if r["row"].startswith("cached") else "-",
            ]
            for r in rows
        ],
    )
    print(head + "\n\n" + table + "\n")
    if sweep:
        n = a.sweep_steps
        print(f"Cached cold sweep ({n} steps per cell, one run each; images/s, fetch s per step):\n")
        th_list = sorted({c["prefetch_threads"] for c in sweep})
        grid = []
        for ps in sorted({c["prefetch_steps"] for c in sweep}):
            cells = {c["prefetch_threads"]: c for c in sweep if c["prefetch_steps"] == ps}
            grid.append(
                [f"prefetch_steps={ps}"]
                + [
                    f"{cells[t]['images_per_s']:.0f} ({cells[t]['fetch_s_per_step']:.3f}s)"
                    if t in cells
                    else "-"
                    for t in th_list
                ]
            )
        print(markdown_table(["", *(f"threads={t}" for t in th_list)], grid) + "\n")
    print("\n".join(target_line(t) for t in targets))

    write_json(
        out / "bench_data.json",
        {"machine": machine, "args": vars(a), "rows": rows, "sweep": sweep, "targets": targets},
    )
    panels = [("images/s", [r["row"] for r in rows], [r["images_per_s"] for r in rows])]
    if sweep:
        panels.append(
            (
                "cached cold images/s",
                [f"steps={c['prefetch_steps']} threads={c['prefetch_threads']}" for c in sweep],
                [c["images_per_s"] for c in sweep],
            )
        )
    bar_chart(out / "bench_data.png", f"ResumableLoader, {a.latency_ms:g} ms/op remote", panels)
    log(f"wrote {out / 'bench_data.json'} and {out / 'bench_data.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
