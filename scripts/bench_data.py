"""Data-loading benchmark: the project's ResumableLoader, emulated remote and through a real S3 API.

    python scripts/bench_data.py                          # 10 classes x 1000 JPEGs at 64px, 30 steps a row
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

S3 rows (--s3, the honest section): the same loaders through moto's S3 server behind a proxy that
adds latency and caps bandwidth per connection (benchlib.S3Endpoint), per-file before/after
("old client": s3fs with a HEAD per file in a worker, and workers that fetch what is not
cached yet themselves, as before the request diet), data=shards, and MosaicML Streaming over MDS
shards of the same data as the reference (pip install -e '.[bench]'). Per row also: requests and
connections at the proxy, client CPU per image, and the endpoint's own CPU (it shares the cores).

    python scripts/bench_data.py --no-emulated --repeats 3 --s3-rows cached,shards,mosaic
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchlib import (
    S3Endpoint,
    bar_chart,
    log,
    machine_info,
    machine_line,
    markdown_table,
    median,
    process_cpu_s,
    ratio,
    target,
    target_line,
    write_json,
)
from goodput.data.config import DataConfig
from goodput.data.loader import ResumableLoader
from goodput.data.sources import CachedSource
from goodput.data.synthetic import make_dataset
from goodput.storage.remote import Storage, StorageConfig

EMU_ROWS = ["emulated remote", "emulated cached cold", "emulated cached warm", "floor"]
S3_ROWS = [
    "s3 remote",
    "s3 cached cold (old client)",
    "s3 cached cold",
    "s3 cached warm",
    "s3 shards cold",
    "s3 shards warm",
    "mosaic cold",
    "mosaic warm",
]
BUCKET = "goodput-bench"


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


class OldClientStorage(Storage):
    """The per-file read path before the request diet, for the before/after ratio: s3fs only, its
    default cat_file (a HEAD for the size, then the GET), exists() before each listing."""

    @property
    def read_fs(self):
        return self.fs

    def read_bytes(self, rel: str) -> bytes:
        return self._retry(f"read {self.url(rel)}", self.fs.cat_file, self._path(rel))

    def find(self, rel: str = "") -> dict[str, int]:
        self.fs.exists(self._path(rel))
        return super().find(rel)


class OldCachedSource(CachedSource):
    """The node cache before the request diet, for the old-client row: a DataLoader worker that
    finds a file missing fetches it itself (through its own fresh client), even while the prefetch
    pool has it queued or is fetching it: no fill locks, no waiting."""

    def read(self, rel: str) -> tuple[bytes, bool, int]:
        try:
            with open(self.local_path(rel), "rb") as f:
                return f.read(), True, 0
        except FileNotFoundError:
            data, size = self._fill(rel)
            return data, False, size

    def prefetch(self, rels: list[str], protect: set[str]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.prefetch_threads, thread_name_prefix="prefetch")
            self._queued: set[str] = set()
        for rel in rels:
            with self._lock:
                if rel in self._queued:
                    continue
                self._queued.add(rel)
            self._pool.submit(self._old_prefetch_one, rel)

    def _old_prefetch_one(self, rel: str) -> None:
        try:
            if not os.path.exists(self.local_path(rel)):
                self._fill(rel)
        except Exception:
            pass
        finally:
            with self._lock:
                self._queued.discard(rel)


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


def measure(a, make, steps: int, ep: S3Endpoint | None) -> dict:
    """One row: build the loader (listing, index), then `steps` steps of next() + synthetic compute.
    images/s counts the steps only; CPU and requests count everything from construction to close."""
    exclude = [ep.proc.pid] if ep else []
    if ep:
        ep.reset()
        ep_cpu0 = ep.cpu_s()
    cpu0, t_build = process_cpu_s(exclude), time.perf_counter()
    it, close, hit_rate = make()
    build_s = time.perf_counter() - t_build
    fetch = []
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        next(it)
        fetch.append(time.perf_counter() - t)
        time.sleep(a.compute_ms / 1000)  # the accelerator's share of the step
    total = time.perf_counter() - t0
    hits = hit_rate()
    close()
    images = steps * a.batch
    r = {
        "images_per_s": images / total,
        "fetch_s_per_step": sum(fetch) / steps,
        "first_batch_s": fetch[0],
        "wait_share": sum(fetch) / total,
        "seconds": total,
        "build_s": build_s,
        "hit_rate": hits,
        "cpu_ms_per_image": 1000 * (process_cpu_s(exclude) - cpu0) / images,
        "load_1m": os.getloadavg()[0],  # the machine is shared: how busy it was (this run included)
    }
    if ep:
        counts = ep.counts()
        r["requests"] = sum(counts.values())
        r["requests_by_method"] = counts
        r["connections"] = ep.connections()
        # The endpoint (moto + proxy) shares this machine's cores with the client: its CPU is time
        # the client's decode does not get, and it is what caps the per-file rows here.
        r["endpoint_cpu_s"] = ep.cpu_s() - ep_cpu0
        r["endpoint_cpu_share"] = r["endpoint_cpu_s"] / (total + build_s)
    return r


def ours(a, storage: Storage, backend: str, cache_dir: str, prefetch_steps: int, threads: int, steps: int,
         floor: bool = False, old_cache: bool = False):  # fmt: skip
    source = {
        "remote": {"_target_": "goodput.data.sources.RemoteSource"},
        "cached": {"_target_": "goodput.data.sources.CachedSource", "prefetch_threads": threads},
        "shards": {
            "_target_": "goodput.data.shards.ShardSource",
            "prefetch_threads": threads,
            "shuffle_block": a.shuffle_block,
        },
    }[backend]
    cfg = DataConfig(
        source=source,
        root=storage.root,
        cache_dir=cache_dir,
        image_size=a.image_size,
        num_workers=a.num_workers,
        prefetch_factor=a.prefetch_factor,
        prefetch_steps=prefetch_steps,
        on_bad_sample="error",
    )

    def make():
        loader = ResumableLoader(cfg, storage, a.seed, a.batch, steps, 0, 1, torch.device("cpu"))
        if floor:  # the same files, read into memory before the clock starts
            order, files = loader.order, loader.files.files
            rels = {files[i] for s in range(steps) for i in order.rank_batch(s, 0, 1)}
            plain = Storage(storage.root)  # no emulation: this is not part of the measurement
            mem = MemorySource(storage, {r: plain.read_bytes(r) for r in rels})
            loader.source = loader.dataset.source = mem  # before the first next(): workers fork after it
        if old_cache:
            old = OldCachedSource(storage, cache_dir, prefetch_threads=threads)
            loader.source = loader.dataset.source = old
        return loader, loader.close, lambda: loader.stats()["data/cache_hits"] / (steps * a.batch)

    return make


def mosaic(a, remote: str, local: str, steps: int, samples_per_shard: int):
    """MosaicML Streaming over MDS shards of the same JPEGs: same decode, transform, per-sample
    seeds, workers, batch and prefetch_factor; its own defaults otherwise (py1e, predownload)."""
    from streaming import StreamingDataLoader, StreamingDataset
    from torchvision.io import ImageReadMode, decode_image

    from goodput.data import augment
    from goodput.data.dataset import seeded
    from goodput.data.sampler import sample_seed

    class Images(StreamingDataset):
        def get_item(self, idx):
            s = super().get_item(idx)
            img = decode_image(
                torch.frombuffer(bytearray(s["image"]), dtype=torch.uint8), mode=ImageReadMode.RGB
            )
            x = seeded(self.tf, img, sample_seed(a.seed, 0, idx))  # as ImageDataset does
            return {"image": x, "label": s["label"]}

    def make():
        ds = Images(
            remote=remote,
            local=local,
            batch_size=a.batch,
            shuffle=True,
            shuffle_seed=a.seed,
            shuffle_block_size=max(1, a.shuffle_block) * samples_per_shard,
        )
        ds.tf = augment.build(None, a.image_size)[0]  # the standard pipeline, as ours use
        kw = {"prefetch_factor": a.prefetch_factor, "persistent_workers": True} if a.num_workers else {}
        dl = StreamingDataLoader(ds, batch_size=a.batch, num_workers=a.num_workers, **kw)
        it = iter(dl)

        def close():
            nonlocal it
            del it
            from streaming.base.util import clean_stale_shared_memory

            clean_stale_shared_memory()

        return it, close, lambda: float("nan")

    return make


def stage_s3(a, root: str, ep: S3Endpoint, work: str) -> dict:
    """Upload the ImageFolder, our shards and Mosaic's MDS shards of it to the endpoint (untimed)."""
    import s3fs
    from streaming import MDSWriter

    from goodput.data.dataset import ImageFolder
    from goodput.data.shards import pack

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    src = Storage(root)
    folder = Storage(f"s3://{BUCKET}/folder")
    rels = [r for r in src.find("") if r.startswith(("train/", "val/"))]
    log(f"uploading {len(rels)} files to {folder.root} ...")
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda r: folder.write_bytes(r, src.read_bytes(r)), rels))
    shard_bytes = int(a.shard_mb * 2**20)
    log("packing our shards from the local copy ...")
    idx = pack(src, Storage(f"s3://{BUCKET}/shards"), shard_bytes)
    train = idx["splits"]["train"]
    log("writing MDS shards (MosaicML Streaming) ...")
    mds = os.path.join(work, "mds")
    files = ImageFolder(src, "train")
    with MDSWriter(out=mds, columns={"image": "bytes", "label": "int"}, size_limit=shard_bytes) as w:
        for rel, label in zip(files.files, files.labels):
            w.write({"image": src.read_bytes(rel), "label": label})
    fs.put(mds, f"{BUCKET}/mds", recursive=True)
    return {
        "folder": folder.root,
        "shards": f"s3://{BUCKET}/shards",
        "mds": f"s3://{BUCKET}/mds",
        "shards_per_epoch": len(train["shards"]),
        "mds_shards": len([n for n in os.listdir(mds) if n.endswith(".mds")]),
        "samples_per_shard": max(1, len(train["files"]) // len(train["shards"])),
    }


def summarize(samples: dict[str, list[dict]], order: list[str]) -> list[dict]:
    rows = []
    for kind in order:
        got = samples.get(kind)
        if not got:
            continue
        row = {"row": kind, "images_per_s_samples": [x["images_per_s"] for x in got]}
        for k, v in got[0].items():
            if isinstance(v, int | float):
                row[k] = median([x[k] for x in got])
        if "requests_by_method" in got[-1]:
            row["requests_by_method"] = got[-1]["requests_by_method"]
        rows.append(row)
    return rows


def emulated_section(a, root: str, work: str) -> tuple[list[dict], list[dict], list[dict], str]:
    storage = Storage(root, StorageConfig(a.latency_ms, a.bandwidth_mb_s))
    samples: dict[str, list[dict]] = {k: [] for k in EMU_ROWS}
    for rep in range(a.repeats):
        cache = os.path.join(work, f"cache-{rep}")  # empty: cold; the warm row reuses it
        for kind in EMU_ROWS:
            log(f"repeat {rep + 1}/{a.repeats}: {kind} ...")
            backend = "remote" if kind in ("emulated remote", "floor") else "cached"
            make = ours(
                a, storage, backend, cache, a.prefetch_steps, a.prefetch_threads, a.steps, kind == "floor"
            )
            samples[kind].append(measure(a, make, a.steps, None))
        shutil.rmtree(cache, ignore_errors=True)
    sweep = []
    ps_list = [int(v) for v in a.sweep_prefetch_steps.split(",") if v.strip()]
    th_list = [int(v) for v in a.sweep_threads.split(",") if v.strip()]
    for ps in ps_list:
        for th in th_list:
            log(f"sweep: emulated cached cold, prefetch_steps={ps} prefetch_threads={th} ...")
            cache = os.path.join(work, f"sweep-{ps}-{th}")
            r = measure(a, ours(a, storage, "cached", cache, ps, th, a.sweep_steps), a.sweep_steps, None)
            sweep.append({"prefetch_steps": ps, "prefetch_threads": th, **r})
            shutil.rmtree(cache, ignore_errors=True)
    rows = summarize(samples, EMU_ROWS)
    by = {r["row"]: r for r in rows}
    for r in rows:
        r["vs_floor"] = ratio(r["images_per_s"], by["floor"]["images_per_s"])
        r["vs_remote"] = ratio(r["images_per_s"], by["emulated remote"]["images_per_s"])
    warm, cold, floor, remote = (
        by[k] for k in ("emulated cached warm", "emulated cached cold", "floor", "emulated remote")
    )
    targets = [
        target(
            "emulated: cached warm >= 90% of the floor's images/s",
            warm["vs_floor"],
            0.9,
            warm["vs_floor"] >= 0.9,
            f"{warm['images_per_s']:.0f} vs {floor['images_per_s']:.0f} img/s "
            f"= {100 * warm['vs_floor']:.0f}%",
        ),
        target(
            "emulated: cached cold (prefetch on) >= 3x remote images/s",
            cold["vs_remote"],
            3.0,
            cold["vs_remote"] >= 3.0,
            f"{cold['images_per_s']:.0f} vs {remote['images_per_s']:.0f} img/s = {cold['vs_remote']:.1f}x",
        ),
    ]
    text = (
        f"Emulated remote (time.sleep for {a.latency_ms:g} ms per file op and {a.bandwidth_mb_s:g} MB/s per "
        f"stream: costs no client CPU, so it flatters per-file reads; see the S3 rows), {a.steps} steps "
        f"per row:\n\n"
        + markdown_table(
            [
                "row",
                "images/s",
                "fetch s / step",
                "waiting share",
                "CPU ms / image",
                "vs floor",
                "vs remote",
                "cache hit rate",
            ],
            [
                [
                    r["row"],
                    r["images_per_s"],
                    r["fetch_s_per_step"],
                    f"{100 * r['wait_share']:.0f}%",
                    r["cpu_ms_per_image"],
                    r["vs_floor"],
                    r["vs_remote"],
                    f"{100 * r['hit_rate']:.0f}%" if "cached" in r["row"] else "-",
                ]
                for r in rows
            ],
        )  # fmt: skip
    )
    if sweep:
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
        text += (
            f"\n\nEmulated cached cold sweep ({a.sweep_steps} steps per cell, one run each; images/s, "
            f"fetch s per step):\n\n" + markdown_table(["", *(f"threads={t}" for t in th_list)], grid)
        )
    return rows, sweep, targets, text


def s3_section(a, root: str, work: str) -> tuple[list[dict], list[dict], str, dict]:
    try:
        import streaming  # noqa: F401

        have_mosaic = True
    except ImportError:
        have_mosaic = False
        log("mosaicml-streaming is not installed (pip install -e '.[bench]'): no Mosaic rows")
    ep = S3Endpoint(a.s3_latency_ms, a.s3_bandwidth_mb_s)
    try:
        ep.use_for_fsspec()
        staged = stage_s3(a, root, ep, work) if have_mosaic else stage_s3_ours(a, root)
        steps = a.s3_steps or (a.classes * a.per_class) // a.batch
        folder, shards = staged["folder"], staged["shards"]
        samples: dict[str, list[dict]] = {k: [] for k in S3_ROWS}
        for rep in range(a.repeats):
            d = os.path.join(work, f"s3-{rep}")
            ps, th, sth, old = a.prefetch_steps, a.prefetch_threads, a.shard_threads, OldClientStorage(folder)
            plan = [
                ("s3 remote", ours(a, Storage(folder), "remote", f"{d}/none", 1, 1, steps)),  # no prefetch
                (
                    "s3 cached cold (old client)",
                    ours(a, old, "cached", f"{d}/o", ps, th, steps, old_cache=True),
                ),
                ("s3 cached cold", ours(a, Storage(folder), "cached", f"{d}/c", ps, th, steps)),
                ("s3 cached warm", ours(a, Storage(folder), "cached", f"{d}/c", ps, th, steps)),
                ("s3 shards cold", ours(a, Storage(shards), "shards", f"{d}/s", ps, sth, steps)),
                ("s3 shards warm", ours(a, Storage(shards), "shards", f"{d}/s", ps, sth, steps)),
            ]
            if have_mosaic:
                plan += [
                    (k, mosaic(a, staged["mds"], f"{d}/mosaic", steps, staged["samples_per_shard"]))
                    for k in ("mosaic cold", "mosaic warm")
                ]
            if a.s3_rows:
                plan = [(k, m) for k, m in plan if any(w in k for w in a.s3_rows.split(","))]
            if rep % 2:  # alternate the order of backends (cold before warm within each) against drift
                groups: dict[str, list] = {}
                for kind, make in plan:
                    groups.setdefault(kind.rsplit(" ", 1)[0].removesuffix(" cold"), []).append((kind, make))
                plan = [x for g in reversed(groups.values()) for x in g]
            for kind, make in plan:
                log(f"S3 repeat {rep + 1}/{a.repeats}: {kind} ...")
                samples[kind].append(measure(a, make, steps, ep))
            shutil.rmtree(d, ignore_errors=True)
    finally:
        ep.close()
    rows = summarize(samples, S3_ROWS)
    by = {r["row"]: r for r in rows}
    images = steps * a.batch
    for r in rows:
        r["requests_per_1k_images"] = 1000 * r["requests"] / images
        ref = by.get("mosaic cold" if "cold" in r["row"] else "mosaic warm")
        r["vs_mosaic"] = ratio(r["images_per_s"], ref["images_per_s"]) if ref else float("nan")
    targets = []

    def versus(name, a_row, b_row, limit):
        if a_row in by and b_row in by:
            x = ratio(by[a_row]["images_per_s"], by[b_row]["images_per_s"])
            detail = f"{by[a_row]['images_per_s']:.0f} vs {by[b_row]['images_per_s']:.0f} img/s = {x:.2f}x"
            targets.append(target(name, x, limit, x >= limit, detail))

    versus(
        "S3: cached cold >= 1.5x the old per-file client",
        "s3 cached cold",
        "s3 cached cold (old client)",
        1.5,
    )
    versus("S3: shards cold >= 0.8x MosaicML Streaming cold", "s3 shards cold", "mosaic cold", 0.8)
    versus("S3: shards warm >= 1.0x MosaicML Streaming warm", "s3 shards warm", "mosaic warm", 1.0)
    text = (
        f"Through a real S3 API (moto's server on loopback behind a proxy adding {a.s3_latency_ms:g} ms per "
        f"request and {a.s3_bandwidth_mb_s:g} MB/s per connection), {steps} steps per row (one epoch of "
        f"{images} images); shards: {staged['shards_per_epoch']} per epoch ({a.shard_mb:g} MB target, "
        f"shuffle_block={a.shuffle_block}), MDS shards: {staged.get('mds_shards', '-')} at the same size "
        f"limit. "
        f"Requests are counted at the proxy, from building the loader (listing, index) to closing it; "
        f"client CPU is this process and its DataLoader workers over the same span; endpoint CPU is "
        f"moto's and the proxy's process, in cores busy over the row (it shares this machine):\n\n"
        + markdown_table(
            [
                "row",
                "images/s",
                "fetch s / step",
                "first batch s",
                "requests",
                "requests / 1k images",
                "client CPU ms / image",
                "endpoint CPU, cores",
                "vs Mosaic",
                "load (1 min)",
            ],
            [
                [
                    r["row"],
                    r["images_per_s"],
                    r["fetch_s_per_step"],
                    r["first_batch_s"],
                    int(r["requests"]),
                    r["requests_per_1k_images"],
                    r["cpu_ms_per_image"],
                    r["endpoint_cpu_share"],
                    r["vs_mosaic"],
                    r["load_1m"],
                ]
                for r in rows
            ],
        )  # fmt: skip
    )
    return rows, targets, text, staged


def stage_s3_ours(a, root: str) -> dict:
    """Without mosaicml-streaming: the ImageFolder and our shards only."""
    import s3fs

    from goodput.data.shards import pack

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    src, folder = Storage(root), Storage(f"s3://{BUCKET}/folder")
    rels = [r for r in src.find("") if r.startswith(("train/", "val/"))]
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda r: folder.write_bytes(r, src.read_bytes(r)), rels))
    idx = pack(src, Storage(f"s3://{BUCKET}/shards"), int(a.shard_mb * 2**20))
    train = idx["splits"]["train"]
    return {
        "folder": folder.root,
        "shards": f"s3://{BUCKET}/shards",
        "shards_per_epoch": len(train["shards"]),
        "samples_per_shard": max(1, len(train["files"]) // len(train["shards"])),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", default="outputs/bench/data", help="generated once, reused")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=1000, help="training JPEGs per class")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--latency-ms", type=float, default=10.0, help="emulated remote latency per file op")
    p.add_argument("--bandwidth-mb-s", type=float, default=100.0, help="emulated per-stream bandwidth")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=30, help="steps per emulated row")
    p.add_argument("--compute-ms", type=float, default=50.0, help="synthetic compute per step")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers, the same for every row")
    p.add_argument("--prefetch-factor", type=int, default=4)
    p.add_argument("--prefetch-steps", type=int, default=8, help="cached/shards rows (conf/data default)")
    p.add_argument("--prefetch-threads", type=int, default=16, help="cached rows (conf/data default)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the rows (median)")
    p.add_argument("--sweep-prefetch-steps", default="1,4,16", help="comma list; empty = no sweep")
    p.add_argument("--sweep-threads", default="4,16,32", help="comma list")
    p.add_argument("--sweep-steps", type=int, default=20, help="steps per sweep cell")
    p.add_argument("--emulated", action=argparse.BooleanOptionalAction, default=True, help="emulated rows")
    p.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True, help="rows through moto's S3")
    p.add_argument("--s3-latency-ms", type=float, default=10.0, help="added per request by the proxy")
    p.add_argument("--s3-bandwidth-mb-s", type=float, default=100.0, help="per connection, at the proxy")
    p.add_argument("--s3-steps", type=int, default=0, help="steps per S3 row; 0 = one epoch")
    p.add_argument("--s3-rows", default="", help="comma list of substrings: run only matching S3 rows")
    p.add_argument("--shard-mb", type=float, default=4.0, help="shard size, ours and MDS alike")
    p.add_argument("--shuffle-block", type=int, default=4, help="data.source.shuffle_block, shards rows")
    p.add_argument("--shard-threads", type=int, default=4, help="prefetch threads of the shards rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/bench", help="JSON, PNG and scratch space go here")
    a = p.parse_args()
    if a.emulated and a.classes * a.per_class < a.batch * max(a.steps, a.sweep_steps):
        p.error("the dataset must hold --steps and --sweep-steps batches (rows run within one epoch)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    log(f"machine: {machine_line(machine)}")
    root = dataset(a)
    work = tempfile.mkdtemp(prefix="data-", dir=out)
    rows, sweep, targets, texts, s3_rows, staged = [], [], [], [], [], {}
    try:
        if a.emulated:
            rows, sweep, t, text = emulated_section(a, root, work)
            targets += t
            texts.append(text)
        if a.s3:
            s3_rows, t, text, staged = s3_section(a, root, work)
            targets += t
            texts.append(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    head = (
        f"Data benchmark: {a.classes * a.per_class} JPEGs ({a.classes} classes, {a.image_size}px); batch "
        f"{a.batch}, {a.num_workers} workers, prefetch_factor {a.prefetch_factor}, {a.compute_ms:g} ms "
        f"synthetic compute per step; cached rows use prefetch_steps={a.prefetch_steps}, prefetch_threads="
        f"{a.prefetch_threads}.\nMachine: {machine_line(machine)}.\n"
        f"Medians of {a.repeats} interleaved repeats; images/s counts the steps, not building the loader."
    )
    print(head + "\n\n" + "\n\n".join(texts) + "\n")
    print("\n".join(target_line(t) for t in targets))

    write_json(
        out / "bench_data.json",
        {"machine": machine, "args": vars(a), "rows": rows, "sweep": sweep, "s3_rows": s3_rows,
         "s3_staged": staged, "targets": targets},
    )  # fmt: skip
    panels = []
    if rows:
        panels.append(("emulated: images/s", [r["row"] for r in rows], [r["images_per_s"] for r in rows]))
    if s3_rows:
        panels.append(("S3: images/s", [r["row"] for r in s3_rows], [r["images_per_s"] for r in s3_rows]))
        panels.append(
            (
                "S3: client CPU ms / image",
                [r["row"] for r in s3_rows],
                [r["cpu_ms_per_image"] for r in s3_rows],
            )
        )
    if panels:
        bar_chart(out / "bench_data.png", "ResumableLoader vs MosaicML Streaming", panels)
    log(f"wrote {out / 'bench_data.json'} and {out / 'bench_data.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
