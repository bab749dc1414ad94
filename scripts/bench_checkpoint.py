"""Checkpoint benchmark: what each backend costs the training loop, through the project's own manager.

    python scripts/bench_checkpoint.py                      # vit_b_16 + AdamW (~1 GB), 3 repeats
    python scripts/bench_checkpoint.py --model resnet50 --latency-ms 50 --bandwidth-mb-s 100

Part 1 saves one realistic state (a torchvision model with initialised AdamW state) to an emulated
remote with `CheckpointManager` and each backend, and reports per configuration:
  stall      seconds `manager.save()` blocked the loop
  commit     seconds from save start until `manager.wait()` returned on rank 0 (COMMIT.json written)
  floor      a bare in-memory copy of the same tensors into buffers allocated beforehand (what a
             staging copy cannot beat): the fastest of 3 copies right before each save
  state_dict, remote op   timed on their own for reference: get_state_dict (part of every stall),
             and one remote round trip at the emulated latency
The rows of one world size share a set of fresh processes and are interleaved save by save, so drift
on a noisy machine hits them alike. Every row starts with one uncounted warm-up save (the first
dcp_async process-type save spawns its daemon, seconds). Figures are medians of --repeats saves.

Part 3 prices the checksums: the same 1-rank saves (dcp_sync, dcp_async thread) with every file
hashed as it uploads (what the manager does) and with hashing replaced by a plain copy, interleaved
save by save; stall and time to commit, medians of --repeats.

Part 2 trains a small model on random data, per backend (1 rank), alternating blocks of
--save-every steps without saving and blocks that start with a save, and reports the mean step time
of each and the mean of the 3 steps right after a save (a background write competes for CPU).
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
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from hydra.utils import instantiate  # noqa: E402

from benchlib import (
    bar_chart,
    clean_dist_env,
    free_port,
    log,
    machine_info,
    machine_line,
    markdown_table,
    median,
    ratio,
    target,
    target_line,
    timed,
    write_json,
)
from goodput.checkpoint import BACKENDS, AppState, CheckpointConfig, CheckpointManager, step_dir
from goodput.parallel import init_distributed, shutdown_distributed
from goodput.storage import remote as storage_remote
from goodput.storage.checksum import Transfer
from goodput.storage.remote import Storage, StorageConfig

# (backend, ranks, async_type): the rows of part 1, in order.
CONFIGS = [
    ("torch_save", 1, None),
    ("dcp_sync", 1, None),
    ("dcp_sync", 2, None),
    ("dcp_async", 1, "thread"),
    ("dcp_async", 2, "thread"),
    ("dcp_async", 1, "process"),
    ("dcp_async", 2, "process"),
]
TRAIN_BACKENDS = [("torch_save", None), ("dcp_sync", None), ("dcp_async", "thread"), ("dcp_async", "process")]
AFTER = 3  # steps right after a save that are compared with the others


def label(backend: str, ranks: int | None = None, async_type: str | None = None) -> str:
    s = backend + (f"/{async_type}" if async_type else "")
    return s if ranks is None else f"{s} x{ranks}"


def build(name: str, num_classes: int | None = None):
    """Model + AdamW with its state initialised by one step on made-up gradients: their values do not
    change what a save costs, and a real forward/backward of vit_b_16 takes seconds on CPU."""
    kw = {"num_classes": num_classes} if num_classes else {}
    model = torchvision.models.get_model(name, weights=None, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_tensors(model, opt) -> list[torch.Tensor]:
    ts = list(model.state_dict().values())
    ts += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return ts


def _env(rank: int, world: int, port: int) -> None:
    if world > 1:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    else:
        clean_dist_env()
    # Ranks share the cores, as torchrun would set OMP_NUM_THREADS.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def _manager(a: dict, backend: str, async_type: str | None, work: str, d) -> CheckpointManager:
    """One row's manager, as the trainer builds it: its own remote dir and node-local staging dir."""
    storage = Storage(os.path.join(work, "remote"), StorageConfig(a["latency_ms"], a["bandwidth_mb_s"]))
    node = {"_target_": f"goodput.checkpoint.backends.{BACKENDS[backend].__name__}"}
    if backend == "dcp_async":
        node["async_type"] = async_type or "thread"
    cfg = CheckpointConfig(
        backend=node,
        dir=storage.root,
        staging_dir=os.path.join(work, "staging"),  # node-local, shared by the ranks of the node
        every_n_steps=None,
        every_n_minutes=None,
        keep_last=1,
    )
    impl = instantiate(node)
    return CheckpointManager(cfg, storage, impl, d.rank, d.world, d.local_rank, pg=d.ckpt_pg)


# -- part 1: one save, stall and time to commit ----------------------------------------------------
def _save_worker(rank: int, world: int, port: int, cfgs: list, a: dict, work: str, result: str) -> None:
    """All rows of one world size, in one set of processes, interleaved save by save (row 1, row 2,
    ..., row 1, ...) so that a noisy neighbour hits every row alike. Each row has its own manager,
    remote and staging dir; round 0 is the uncounted warm-up save of every row."""
    _env(rank, world, port)
    d = init_distributed()
    try:
        model, opt = build(a["model"])
        app = AppState(model, opt, d.rank)
        tensors = state_tensors(model, opt)
        # The floor: the same tensors copied into buffers allocated beforehand (DCP's stager keeps
        # its buffers between saves), by every rank at once, right before each save.
        dst = [t.clone() for t in tensors]
        copy = lambda: [b.copy_(t) for b, t in zip(dst, tensors)]
        mgrs = [_manager(a, c[0], c[2], os.path.join(work, f"row{i}"), d) for i, c in enumerate(cfgs)]
        keys = ("stall", "commit", "floor", "state_dict", "remote_op")
        samples = [{k: [] for k in keys} for _ in cfgs]
        for rnd in range(a["repeats"] + 1):
            for i, mgr in enumerate(mgrs):
                dist.barrier()
                got = {"floor": min(timed(copy, 3))}  # a floor: the fastest of a few
                # Two parts of the stall measured on their own: get_state_dict, and one remote
                # round trip (save() checks the remote for a leftover step dir before writing).
                got["state_dict"] = timed(lambda m=mgr: app.state_dict(m.backend.options), 1)[0]
                got["remote_op"] = timed(lambda m=mgr: m.storage.exists("absent"), 1)[0]
                dist.barrier()
                t0 = time.perf_counter()
                got["stall"] = mgr.save(rnd + 1, app)
                mgr.wait()
                got["commit"] = time.perf_counter() - t0
                if d.rank == 0 and not mgr.storage.exists(f"{step_dir(rnd + 1)}/COMMIT.json"):
                    raise RuntimeError(f"{label(*cfgs[i])}: step {rnd + 1} has no COMMIT.json after wait()")
                for k in keys:
                    samples[i][k].append(got[k])
        rows = []
        for c, mgr, smp in zip(cfgs, mgrs, samples):
            committed = mgr.committed() if d.rank == 0 else []
            mgr.close()
            rows.append(
                {
                    "backend": c[0],
                    "ranks": world,
                    "async_type": c[2],
                    "label": label(*c),
                    "state_bytes_per_rank": sum(t.numel() * t.element_size() for t in tensors),
                    "committed_bytes": committed[0]["bytes"] if committed else None,
                    "warmup_stall_s": smp["stall"][0],
                    "warmup_commit_s": smp["commit"][0],
                    **{f"{k}_s": median(v[1:]) for k, v in smp.items()},
                    **{f"{k}_samples": v[1:] for k, v in smp.items()},
                }
            )
        if d.rank == 0:
            write_json(result, {"rows": rows})
    finally:
        shutdown_distributed()


# -- part 3: what the checksums cost ---------------------------------------------------------------
CHECKSUM_ROWS = [("dcp_sync", None, True), ("dcp_sync", None, False),
                 ("dcp_async", "thread", True), ("dcp_async", "thread", False)]  # fmt: skip


def _plain_copy(src, dst, chunk: int):
    """The upload without hashing: same streaming copy, no checksum."""
    n = 0
    while buf := src.read(chunk):
        dst.write(buf)
        n += len(buf)
    return Transfer(n, "0" * 32)


def _checksum_worker(_: int, a: dict, work: str, result: str) -> None:
    _env(0, 1, 0)
    d = init_distributed()
    hashing = storage_remote._copy_hashing
    try:
        model, opt = build(a["model"])
        app = AppState(model, opt, d.rank)
        mgrs = [
            _manager(a, b, t, os.path.join(work, f"row{i}"), d) for i, (b, t, _) in enumerate(CHECKSUM_ROWS)
        ]
        samples = [{"stall": [], "commit": []} for _ in CHECKSUM_ROWS]
        for rnd in range(a["repeats"] + 1):
            for (_, _, on), mgr, smp in zip(CHECKSUM_ROWS, mgrs, samples):
                storage_remote._copy_hashing = hashing if on else _plain_copy
                t0 = time.perf_counter()
                stall = mgr.save(rnd + 1, app)
                mgr.wait()
                if rnd:  # round 0 is the warm-up
                    smp["stall"].append(stall)
                    smp["commit"].append(time.perf_counter() - t0)
        storage_remote._copy_hashing = hashing
        rows = []
        for (b, t, on), mgr, smp in zip(CHECKSUM_ROWS, mgrs, samples):
            mgr.close()
            rows.append({"label": label(b, None, t), "checksums": on, "stall_s": median(smp["stall"]),
                         "commit_s": median(smp["commit"])})  # fmt: skip
        write_json(result, {"rows": rows})
    finally:
        storage_remote._copy_hashing = hashing
        shutdown_distributed()


# -- part 2: step time while saving every N steps --------------------------------------------------
def _train_worker(_: int, cfgs: list, a: dict, work: str, result: str) -> None:
    """One process, one model, a manager per backend. Each round, per backend: [N steps without
    saving] then [a save, N steps], so both kinds of step are measured side by side in time. Before
    each plain block the loop waits (untimed) for the previous save to finish, so plain blocks carry
    no background write; how long that wait was is reported (0 = the write finished within N steps)."""
    _env(0, 1, 0)
    d = init_distributed()
    try:
        model, opt = build(a["train_model"], num_classes=10)
        app = AppState(model, opt, d.rank)
        n, size, every = a["train_batch"], a["train_image_size"], a["save_every"]
        x, y = torch.randn(n, 3, size, size), torch.randint(0, 10, (n,))
        mgrs = [_manager(a, c[0], c[1], os.path.join(work, f"row{i}"), d) for i, c in enumerate(cfgs)]
        mgr = mgrs[0]

        def step():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            mgr.wait_for_staging()  # as the loop does, before parameters change
            opt.step()

        timed(step, 3)  # allocator and kernel warm-up
        for m in mgrs:  # uncounted warm-up saves (the process type spawns its daemon)
            m.save(0, app)
            m.wait()
        keys = ("plain", "after", "rest", "stall", "unfinished")
        samples = [{k: [] for k in keys} for _ in cfgs]
        for r in range(a["train_rounds"]):
            for mgr, smp in zip(mgrs, samples):
                smp["unfinished"] += timed(mgr.wait, 1)
                smp["plain"] += timed(step, every)
                smp["stall"].append(mgr.save((r + 1) * every, app))
                block = timed(step, every)
                smp["after"] += block[:AFTER]
                smp["rest"] += block[AFTER:]
        for m in mgrs:
            m.close()
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
        rows = []
        for c, smp in zip(cfgs, samples):
            saving = smp["after"] + smp["rest"]
            rows.append(
                {
                    "backend": c[0],
                    "async_type": c[1],
                    "label": label(c[0], None, c[1]),
                    "train_state_bytes": sum(t.numel() * t.element_size() for t in state_tensors(model, opt)),
                    "saves": len(smp["stall"]),
                    "step_s_no_save": mean(smp["plain"]),
                    "step_s_with_save": (sum(saving) + sum(smp["stall"])) / len(saving),
                    "stall_s_mean": mean(smp["stall"]),
                    "after_save_step_s": mean(smp["after"]),
                    "other_step_s": mean(smp["rest"]),
                    # the first wait follows the warm-up save, which had no steps to hide behind
                    "unfinished_wait_s_mean": mean(smp["unfinished"][1:]),
                }
            )
        write_json(result, {"rows": rows})
    finally:
        shutdown_distributed()


def spawn(fn, world: int, args: tuple) -> None:
    mp.spawn(fn, args=args, nprocs=world, join=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_b_16", help="torchvision model name (e.g. resnet50, resnet18)")
    p.add_argument("--repeats", type=int, default=3, help="counted saves per configuration (median)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="emulated remote latency per operation")
    p.add_argument("--bandwidth-mb-s", type=float, default=200.0, help="emulated per-stream bandwidth")
    p.add_argument("--train-model", default="resnet18", help="model of the step-time part")
    p.add_argument("--train-image-size", type=int, default=64)
    p.add_argument("--train-batch", type=int, default=32)
    p.add_argument("--train-rounds", type=int, default=3, help="rounds of N plain steps + a save and N steps")
    p.add_argument("--save-every", type=int, default=10, help="N")
    p.add_argument("--skip-train", action="store_true", help="skip part 2")
    p.add_argument("--skip-checksum", action="store_true", help="skip part 3")
    p.add_argument("--out", default="outputs/bench", help="JSON, PNG and scratch space go here")
    a = p.parse_args()
    if a.repeats < 1 or a.train_rounds < 1 or a.save_every <= AFTER:
        p.error(f"need --repeats >= 1, --train-rounds >= 1 and --save-every > {AFTER}")
    args = vars(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    log(f"machine: {machine_line(machine)}")

    rows, train, sums = [], [], []
    work = tempfile.mkdtemp(prefix="ckpt-", dir=out)  # remotes and staging dirs; removed at the end
    try:
        for world in (1, 2):
            cfgs = [c for c in CONFIGS if c[1] == world]
            log(f"saving {a.model}, {world} rank(s): {', '.join(label(*c) for c in cfgs)} ...")
            result = os.path.join(work, f"part1-{world}.json")
            spawn(
                _save_worker, world, (world, free_port(), cfgs, args, os.path.join(work, f"w{world}"), result)
            )
            with open(result) as f:
                rows += json.load(f)["rows"]
            shutil.rmtree(os.path.join(work, f"w{world}"), ignore_errors=True)
        if not a.skip_train:
            log(f"training {a.train_model}, saving every {a.save_every} steps with each backend ...")
            result = os.path.join(work, "part2.json")
            spawn(_train_worker, 1, (TRAIN_BACKENDS, args, os.path.join(work, "train"), result))
            with open(result) as f:
                train = json.load(f)["rows"]
        if not a.skip_checksum:
            log(f"saving {a.model} with and without checksums, 1 rank ...")
            result = os.path.join(work, "part3.json")
            spawn(_checksum_worker, 1, (args, os.path.join(work, "sums"), result))
            with open(result) as f:
                sums = json.load(f)["rows"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows.sort(key=lambda r: CONFIGS.index((r["backend"], r["ranks"], r["async_type"])))

    base = rows[0]
    assert base["backend"] == "torch_save"
    for r in rows:
        r["stall_vs_torch_save"] = ratio(r["stall_s"], base["stall_s"])
        r["stall_vs_floor"] = ratio(r["stall_s"], r["floor_s"])
        r["commit_vs_torch_save"] = ratio(r["commit_s"], base["commit_s"])
    for r in train:
        r["overhead"] = ratio(r["step_s_with_save"], r["step_s_no_save"]) - 1
        r["after_vs_plain"] = ratio(r["after_save_step_s"], r["step_s_no_save"])

    # -- targets: evaluated on what was measured, reported either way ------------------------------
    targets = []
    for r in rows:
        if r["backend"] == "dcp_async":
            targets.append(
                target(
                    f"{r['label']} stall <= 5% of torch_save's",
                    r["stall_vs_torch_save"],
                    0.05,
                    r["stall_vs_torch_save"] <= 0.05,
                    f"{r['stall_s']:.3f}s vs {base['stall_s']:.3f}s = {100 * r['stall_vs_torch_save']:.1f}%",
                )
            )
            targets.append(
                target(
                    f"{r['label']} stall <= 2x the memory-copy floor",
                    r["stall_vs_floor"],
                    2.0,
                    r["stall_vs_floor"] <= 2.0,
                    f"{r['stall_s']:.3f}s vs floor {r['floor_s']:.3f}s = {r['stall_vs_floor']:.2f}x",
                )
            )
    for r in rows:
        if r["backend"] == "dcp_sync" and r["ranks"] == 2:
            targets.append(
                target(
                    "dcp_sync x2 time-to-commit <= 0.6x torch_save's",
                    r["commit_vs_torch_save"],
                    0.6,
                    r["commit_vs_torch_save"] <= 0.6,
                    f"{r['commit_s']:.2f}s vs {base['commit_s']:.2f}s = {r['commit_vs_torch_save']:.2f}x",
                )
            )

    for on, off in zip(sums[::2], sums[1::2]):
        on["stall_vs_without"] = ratio(on["stall_s"], off["stall_s"])
        on["commit_vs_without"] = ratio(on["commit_s"], off["commit_s"])
        targets.append(
            target(
                f"{on['label']} time-to-commit with checksums <= 1.1x without",
                on["commit_vs_without"],
                1.1,
                on["commit_vs_without"] <= 1.1,
                f"{on['commit_s']:.2f}s vs {off['commit_s']:.2f}s = {on['commit_vs_without']:.2f}x "
                f"(stall {on['stall_s']:.3f}s vs {off['stall_s']:.3f}s)",
            )
        )

    gb = base["state_bytes_per_rank"] / 1e9
    head = (
        f"Checkpoint benchmark: {a.model} + AdamW, {gb:.2f} GB of model+optimizer state per rank; remote "
        f"emulated at {a.latency_ms:g} ms/op, {a.bandwidth_mb_s:g} MB/s per stream.\n"
        f"Machine: {machine_line(machine)}.\n"
        f"Medians of {a.repeats} saves per row after one uncounted warm-up save per row (the first "
        f"dcp_async process-type save spawns its daemon); rows of one world size share fresh processes "
        f"and are interleaved save by save. floor = copy of the same tensors into buffers allocated "
        f"beforehand, fastest of 3 right before each save; state_dict = get_state_dict alone (part of "
        f"every stall); remote op = one remote round trip, for reference."
    )
    table = markdown_table(
        [
            "backend",
            "ranks",
            "stall s",
            "commit s",
            "stall / torch_save",
            "stall / floor",
            "commit / torch_save",
            "floor s",
            "state_dict s",
            "remote op s",
            "warm-up stall s",
        ],
        [
            [
                label(r["backend"], None, r["async_type"]),
                r["ranks"],
                r["stall_s"],
                r["commit_s"],
                r["stall_vs_torch_save"],
                r["stall_vs_floor"],
                r["commit_vs_torch_save"],
                r["floor_s"],
                r["state_dict_s"],
                r["remote_op_s"],
                r["warmup_stall_s"],
            ]
            for r in rows
        ],
    )
    print(head + "\n\n" + table + "\n")
    if train:
        tb = train[0]["train_state_bytes"] / 1e6
        print(
            f"Step time, {a.train_model} at {a.train_image_size}px, batch {a.train_batch}, 1 rank "
            f"({tb:.0f} MB state), {a.train_rounds} rounds of [{a.save_every} steps without saving] then "
            f"[a save, {a.save_every} steps], backends interleaved in one process, after one uncounted "
            f"warm-up save each. 'with saving' includes the "
            f"stalls; 'after save' = the {AFTER} steps right after a save, 'rest' = the block's other steps "
            f"(stall excluded from both); 'unfinished' = how long the previous save was still running "
            f"{a.save_every} steps later.\n"
        )
        print(
            markdown_table(
                [
                    "backend",
                    "step s (no save)",
                    "step s (with saving)",
                    "overhead",
                    "stall s / save",
                    "after-save step s",
                    "rest step s",
                    "after-save / no save",
                    "unfinished s",
                ],
                [
                    [
                        r["label"],
                        r["step_s_no_save"],
                        r["step_s_with_save"],
                        f"{100 * r['overhead']:+.1f}%",
                        r["stall_s_mean"],
                        r["after_save_step_s"],
                        r["other_step_s"],
                        r["after_vs_plain"],
                        r["unfinished_wait_s_mean"],
                    ]
                    for r in train
                ],
            )
            + "\n"
        )
    if sums:
        print(
            f"Checksums (xxh3_128, computed while each file uploads), {a.model}, 1 rank, medians of "
            f"{a.repeats} saves, with and without interleaved:\n"
        )
        print(
            markdown_table(
                ["backend", "checksums", "stall s", "commit s", "stall / without", "commit / without"],
                [
                    [
                        r["label"],
                        "on" if r["checksums"] else "off",
                        r["stall_s"],
                        r["commit_s"],
                        r.get("stall_vs_without", ""),
                        r.get("commit_vs_without", ""),
                    ]
                    for r in sums
                ],
            )  # fmt: skip
            + "\n"
        )
    print("\n".join(target_line(t) for t in targets))

    report = {
        "machine": machine,
        "args": args,
        "state_bytes_per_rank": base["state_bytes_per_rank"],
        "rows": rows,
        "train": train,
        "checksums": sums,
        "targets": targets,
        "notes": [
            "rows of one world size share fresh processes, interleaved save by save; "
            "one warm-up save per row is not counted",
            "stall = seconds manager.save() blocked; commit = save start until manager.wait() on rank 0",
            "floor = copy into preallocated buffers of the same tensors, on every rank at once, "
            "fastest of 3 right before each save",
            "part 2: one process, backends interleaved round by round",
        ],
    }
    write_json(out / "bench_checkpoint.json", report)
    panels = [
        ("loop stall per save, s", [r["label"] for r in rows], [r["stall_s"] for r in rows]),
        ("time until committed, s", [r["label"] for r in rows], [r["commit_s"] for r in rows]),
    ]
    if train:
        panels.append(
            (
                "step-time overhead of saving, %",
                [r["label"] for r in train],
                [100 * r["overhead"] for r in train],
            )
        )
    bar_chart(out / "bench_checkpoint.png", f"{a.model} + AdamW, {gb:.2f} GB per rank", panels)
    log(f"wrote {out / 'bench_checkpoint.json'} and {out / 'bench_checkpoint.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
