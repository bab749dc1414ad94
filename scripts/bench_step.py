"""Training-step benchmark: images/s per switch, and what a restart costs with torch.compile on.

    python scripts/bench_step.py                              # small_cnn + resnet18, 32 px, CPU
    python scripts/bench_step.py --models small_cnn --steps 20 --variant "tf32=trainer.foo=bar"

Part 1 runs the real entry point (scripts/train.py, experiment=smoke) once per (model, switch), the
rows of one model back to back, and reports images/s = steps x global batch / the ledger's
`productive_seconds` (the step itself: the wait for data, evaluation, checkpoints and compiling are
their own categories and excluded). Each switch is a list of Hydra overrides; a switch whose
`trainer` key this checkout does not have is reported as such, not run (add a row with --variant
NAME=OVERRIDE[,OVERRIDE...]). Compiled rows share one compile cache, warmed by part 2.

Part 2: restart cost with trainer.compile=true. A fresh run (empty compile cache) is killed after its
first checkpoint and relaunched; the relaunch reads the node-local cache. Reported from summary.json:
each start's compile seconds until its first step (`compile[].first_step_seconds`), the inductor
cache hits/misses, and the restart's phase record (`recovery.per_restart`). A third start on an
empty local cache with `trainer.compile_cache_upload=true` shows what the uploaded portable artifacts
alone give a new node. Target: a warm restart adds at most 10 % of the cold compile time.

Writes outputs/bench/step.json (+ step.png) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import (
    bar_chart,
    log,
    machine_info,
    machine_line,
    markdown_table,
    target,
    target_line,
    write_json,
)
from goodput.parallel import without_launcher_env
from goodput.run.config import TrainerConfig

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "scripts" / "train.py")

# name -> Hydra overrides. One line per switch.
VARIANTS = {
    "fp32": [],
    "bf16": ["trainer.precision=bf16-mixed"],
    "compile": ["trainer.compile=true"],
    "bf16+compile": ["trainer.precision=bf16-mixed", "trainer.compile=true"],
    "channels_last": ["trainer.channels_last=true"],
    "accumulation x2": ["trainer.micro_batch_size={half_rank_batch}"],
}
TRAINER_KEYS = {f.name for f in dataclasses.fields(TrainerConfig)}


def missing_keys(overrides: list[str]) -> list[str]:
    keys = [o.split("=", 1)[0] for o in overrides]
    return [k for k in keys if k.startswith("trainer.") and k.split(".", 1)[1] not in TRAINER_KEYS]


def run(root: Path, overrides: list[str], expect_kill: bool = False, timeout: int = 1800) -> dict | None:
    cmd = [sys.executable, TRAIN, "experiment=smoke", f"paths.root={root}", *overrides]
    env = {**without_launcher_env(None, "MLFLOW_TRACKING_URI"), "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if expect_kill:
        if p.returncode != -9:
            raise RuntimeError(f"expected the injected kill (-9), got {p.returncode}:\n{p.stderr[-3000:]}")
        return None
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(overrides)}: exit {p.returncode}\n{p.stderr[-3000:]}")
    files = sorted(glob.glob(f"{root}/runs/**/summary.json", recursive=True), key=os.path.getmtime)
    with open(files[-1]) as f:
        return json.load(f)


def throughput(args, work: Path, cache_dir: str) -> list[dict]:
    base = [f"trainer.max_steps={args.steps}", f"trainer.global_batch_size={args.batch}",
            f"data.image_size={args.image_size}", "checkpoint.every_n_steps=null",
            f"trainer.compile_cache_dir={cache_dir}", *args.set]  # fmt: skip
    rows = []
    for model in args.models:
        for name, over in VARIANTS.items():
            over = [o.format(half_rank_batch=args.batch // 2) for o in over]
            row = {"model": model, "switch": name, "overrides": over}
            if miss := missing_keys(over):
                row["skipped"] = f"not on this checkout: {', '.join(miss)}"
                log(f"{model} {name}: skipped ({row['skipped']})")
                rows.append(row)
                continue
            log(f"{model} {name}: {' '.join(over) or '(defaults)'}")
            s = run(work / f"tp-{model}-{len(rows)}", [f"model={model}", *base, *over])
            g = s["goodput"]
            row.update(
                images_per_s=s["steps"] * args.batch / g["productive_seconds"],
                step_ms=1000 * g["productive_seconds"] / s["steps"],
                compile_s=g.get("compile_seconds", 0.0),
                fetch_s=g["fetch_seconds"],
                final_loss=s["final_loss"],
            )
            rows.append(row)
    for model in args.models:  # ratios against fp32 of the same model, measured in this run
        done = [r for r in rows if r["model"] == model and "images_per_s" in r]
        ref = next((r for r in done if r["switch"] == "fp32"), None)
        for r in rows:
            if r["model"] == model and ref and "images_per_s" in r:
                r["vs_fp32"] = r["images_per_s"] / ref["images_per_s"]
    return rows


def restart_cost(args, work: Path, model: str) -> dict:
    """Cold start killed at step 6 (commit at 4), warm relaunch; then a 'new node' relaunch."""
    cache = work / f"cache-{model}"
    shutil.rmtree(cache, ignore_errors=True)
    over = [f"model={model}", f"data.image_size={args.image_size}", "trainer.compile=true",
            "checkpoint=dcp_sync", "checkpoint.every_n_steps=4", "trainer.max_steps=8",
            "trainer.compile_cache_upload=true", "fault.kill_at_step=6", *args.set]  # fmt: skip
    root = work / f"restart-{model}"
    log(f"restart {model}: cold start, killed at step 6")
    run(root, [*over, f"trainer.compile_cache_dir={cache}/node1"], expect_kill=True)
    log(f"restart {model}: relaunch on the same node (warm local cache)")
    s = run(root, [*over, f"trainer.compile_cache_dir={cache}/node1"])
    cold, warm = s["compile"][0], s["compile"][1]
    out = {"model": model, "cold": cold, "warm": warm, "recovery": s["recovery"]["per_restart"][0]}
    # A new node: the same node-local path, empty (inductor's keys on CPU include that path: a
    # different one misses), the artifacts uploaded beside the checkpoints. Two more steps to run.
    root2 = work / f"restart-{model}-newnode"
    shutil.copytree(root, root2, ignore=shutil.ignore_patterns("runs", "mlflow.db"), symlinks=True)
    shutil.rmtree(cache / "node1")
    log(f"restart {model}: relaunch on a 'new node' (empty local cache, uploaded artifacts)")
    s2 = run(root2, [*over, f"trainer.compile_cache_dir={cache}/node1", "trainer.max_steps=10"])
    out["new_node"] = s2["compile"][-1]
    out["model_sha256_resumed"] = s["model_sha256"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=lambda s: s.split(","), default=["small_cnn", "resnet18"])
    ap.add_argument("--restart-models", type=lambda s: s.split(","), default=["small_cnn"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32, help="trainer.global_batch_size")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--set", action="append", default=[], help="an override for every run (repeatable)")
    ap.add_argument("--variant", action="append", default=[], help="NAME=OVERRIDE[,...]: one more row")
    ap.add_argument("--only", type=lambda s: s.split(","), default=None, help="these switches only")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--out", default=str(REPO / "outputs" / "bench"))
    ap.add_argument("--work", default=None, help="scratch dir (default: a temp dir, removed)")
    args = ap.parse_args()
    for v in args.variant:
        name, _, over = v.partition("=")
        VARIANTS[name] = [o for o in over.split(",") if o]
    if args.only:
        unknown = set(args.only) - set(VARIANTS)
        if unknown:
            ap.error(f"--only: no such switch {sorted(unknown)} (known: {list(VARIANTS)})")
        for name in list(VARIANTS):
            if name not in args.only:
                del VARIANTS[name]
    args.restart_models = [m for m in args.restart_models if m]  # --restart-models "": none

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-step-"))
    m = machine_info()
    log(machine_line(m))
    result = {"machine": m, "args": vars(args), "restart": [], "throughput": []}
    try:
        for model in args.restart_models:
            result["restart"].append(restart_cost(args, work, model))
        if not args.skip_throughput:
            # compiled rows reuse the restart part's cache when the model matches (compile is excluded anyway)
            result["throughput"] = throughput(args, work, str(work / "cache-shared"))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    targets = []
    for r in result["restart"]:
        c, w = r["cold"]["first_step_seconds"], r["warm"]["first_step_seconds"]
        detail = f"warm {w:.2f} s vs cold {c:.2f} s = {100 * w / c:.1f} %"
        name = f"warm-cache restart compile <= 10% of cold ({r['model']})"
        targets.append(target(name, w / c, 0.10, w <= 0.10 * c, detail))
    result["targets"] = targets

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "step.json", result)
    print(f"\n{machine_line(m)}\n")
    if result["throughput"]:
        rows = [[r["model"], r["switch"], r.get("images_per_s", r.get("skipped")), r.get("vs_fp32", ""),
                 r.get("step_ms", ""), r.get("compile_s", "")] for r in result["throughput"]]  # fmt: skip
        print(markdown_table(["model", "switch", "images/s", "x fp32", "step ms", "compile s"], rows))
        ok = [r for r in result["throughput"] if "images_per_s" in r]
        panels = [(mod, [r["switch"] for r in ok if r["model"] == mod],
                   [r["images_per_s"] for r in ok if r["model"] == mod]) for mod in args.models]  # fmt: skip
        bar_chart(out / "step.png", "images/s per switch (productive time only)", panels)
    rows = []
    for r in result["restart"]:
        for label, key in (("cold (empty cache)", "cold"), ("restart, same node", "warm"),
                           ("relaunch, new node (uploaded)", "new_node")):  # fmt: skip
            a = r[key]
            rows.append([r["model"], label, a["first_step_seconds"], a["cache_artifacts_loaded"],
                         a["fxgraph_cache_hit"], a["fxgraph_cache_miss"]])  # fmt: skip
        total = r["recovery"].get("total_seconds")
        rows.append([r["model"], "restart total (failure -> first step)", total, "", "", ""])
    if rows:
        print()
        heads = ["model", "start", "compile s to 1st step", "artifacts", "fx hits", "fx misses"]
        print(markdown_table(heads, rows))
    for t in targets:
        print(target_line(t))
    print(f"\nwrote {out / 'step.json'}")


if __name__ == "__main__":
    main()
