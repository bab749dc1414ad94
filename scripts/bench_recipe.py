"""What torchvision's ResNet-50 V2 recipe (experiment=recipe) buys on the demo data, and what each of
its parts costs per step.

    python scripts/bench_recipe.py                        # both parts (about 40 min on 2 CPU cores)
    python scripts/bench_recipe.py --only accuracy --steps 300 1200 --arms recipe
    python scripts/bench_recipe.py --only cost --cost-steps 40

Part 1 (accuracy): experiment=demo and experiment=recipe (also without its repeated augmentation,
and that without each other part in turn: `--arms` picks rows) trained for the same numbers of steps
(`--steps`; the recipe's max_epochs replaced by max_steps, its warm-up still one epoch), on two
datasets: the demo shapes (10 classes x 500 training images) and a harder one generated the same
way with a fifth of the images (10 x 100: overfitting, where the recipe's regularization should
matter). Each cell is the final val accuracy of the weights the run evaluates (the recipe: its
EMA) and the run's wall seconds, from summary.json.

Part 2 (cost): experiment=demo for `--cost-steps` steps with one part of the recipe switched on at a
time, then all of them, back to back: images/s over the step and the wait for data together
(steps x global batch / (productive + fetch seconds) of the goodput ledger; the augment presets cost
their time in the data workers, which shows as fetch when the workers cannot keep up). Ratios
against the plain row, measured in one run.

Writes outputs/bench/recipe.json (+ recipe.png) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import bar_chart, log, machine_info, machine_line, markdown_table, write_json
from goodput.parallel import without_launcher_env

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "scripts" / "train.py")

DATASETS = {
    "shapes (10 x 500)": [],
    "shapes, few (10 x 100)": ["demo_data.train_per_class=100"],
}
# the parts of experiment=recipe, one at a time on the demo job (part 2)
PARTS = {
    "plain (experiment=demo)": [],
    "augment=ta_wide": ["augment=ta_wide"],
    "label smoothing 0.1": ["task.loss.label_smoothing=0.1"],
    "mixup_cutmix": ["batch_augment=mixup_cutmix"],
    "EMA (every 2 steps)": ["trainer.ema_decay=0.95", "trainer.ema_every_n_steps=2", "trainer.eval_on=ema"],
    "norm_weight_decay=0": ["optim.norm_weight_decay=0.0"],
    "repeated_augment=4": ["data.repeated_augment=4"],
    "train crop 28": ["data.train_crop_size=28"],
    "all (experiment=recipe)": ["experiment=recipe", "trainer.max_epochs=null"],
}


def run(root: str, overrides: list[str], timeout: float) -> dict:
    """scripts/train.py with `overrides` under `root`; its summary.json."""
    env = {**without_launcher_env(None, "MLFLOW_TRACKING_URI"), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, TRAIN, f"paths.root={root}", "mlflow.log_model=none", *overrides]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(overrides)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    found = sorted(Path(root, "runs").glob("*/*/summary.json"), key=os.path.getmtime)
    return json.loads(found[-1].read_text())


RECIPE = ["experiment=recipe", "trainer.max_epochs=null"]
NO_RA = [*RECIPE, "data.repeated_augment=1"]
# part 1's configurations; the "-" rows take one part out of the recipe without repeated augmentation
ARMS = {
    "demo": ["experiment=demo"],
    "recipe": RECIPE,
    # repeated augmentation at equal steps: 1/4 of the distinct images on one process
    "recipe, repeated_augment=1": NO_RA,
    "  - ta_wide (augment=standard)": [*NO_RA, "augment=standard"],
    "  - label smoothing": [*NO_RA, "task.loss.label_smoothing=0.0"],
    "  - mixup_cutmix": [*NO_RA, "batch_augment=none"],
    "  - EMA (eval_on=model)": [*NO_RA, "trainer.eval_on=model"],
    "  - train crop 28 (32 / 32 / 32)": [*NO_RA, "data.train_crop_size=32", "data.val_resize_size=32"],
    "  - norm_weight_decay=0": [*NO_RA, "optim.norm_weight_decay=null"],
}


def accuracy(steps: list[int], data_dir: str, timeout: float, datasets: dict, arms: dict) -> list[dict]:
    rows = []
    for data, extra in datasets.items():
        for n in steps:
            for name, exp in arms.items():
                with tempfile.TemporaryDirectory() as tmp:
                    log(f"accuracy: {name.strip()}, {data}, {n} steps")
                    t0 = time.time()
                    s = run(tmp, [*exp, f"trainer.max_steps={n}", "trainer.eval_every_n_steps=0",
                                  f"paths.data_dir={data_dir}/{len(rows)}", *extra], timeout)  # fmt: skip
                    rows.append({"data": data, "steps": n, "config": name, "val_accuracy": s["val_accuracy"],
                                 "wall_s": round(time.time() - t0, 1), "images": n * 128})  # fmt: skip
    return rows


def chosen(names, words: str | None) -> list:
    """The first of `names` (the baseline) and those containing one of the comma-separated `words`."""
    w = [x for x in (words or "").split(",") if x]
    return [k for i, k in enumerate(names) if i == 0 or not w or any(x in k for x in w)]


def cost(steps: int, timeout: float, parts: dict) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        common = [f"trainer.max_steps={steps}", "trainer.eval_every_n_steps=0",
                  "checkpoint.every_n_steps=1000", "storage.latency_ms=0", "storage.bandwidth_mb_s=0",
                  "optim.schedule.warmup_epochs=null", "optim.schedule.warmup_steps=1"]  # fmt: skip
        run(tmp, common, timeout)  # the demo data generated and the cache warm before the first row
        for name, overrides in parts.items():
            log(f"cost: {name}")
            s = run(tmp, [*overrides, *common, f"run.name=cost-{len(rows)}"], timeout)
            g = s["goodput"]
            busy = g["productive_seconds"] + g["fetch_seconds"]
            rows.append({"part": name, "images_per_s": s["steps"] * 128 / busy,
                         "fetch_share": g["fetch_seconds"] / busy})  # fmt: skip
    plain = rows[0]["images_per_s"]
    for r in rows:
        r["vs_plain"] = r["images_per_s"] / plain
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["accuracy", "cost"])
    p.add_argument("--steps", type=int, nargs="+", default=[300, 1200], help="part 1's step budgets")
    p.add_argument("--cost-steps", type=int, default=60, help="part 2's steps per row")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--parts", help="part 2's rows whose name contains one of these (comma-separated)")
    p.add_argument("--datasets", type=int, default=len(DATASETS), help="part 1: the first N datasets")
    p.add_argument("--arms", help="part 1's rows whose name contains one of these (comma-separated)")
    p.add_argument("--out", default=str(REPO / "outputs" / "bench"))
    a = p.parse_args(argv)
    out: dict = {
        "machine": machine_info(),
        "command": " ".join(["python scripts/bench_recipe.py", *sys.argv[1:]]),
    }
    print(machine_line(out["machine"]))
    if a.only in (None, "accuracy"):
        with tempfile.TemporaryDirectory() as data:
            datasets = dict(list(DATASETS.items())[: a.datasets])
            arms = {k: ARMS[k] for k in chosen(ARMS, a.arms)}
            out["accuracy"] = accuracy(a.steps, data, a.timeout, datasets, arms)
        print(markdown_table(["data", "steps", "config", "val accuracy", "wall s"],
                             [[r["data"], r["steps"], r["config"], f"{r['val_accuracy']:.3f}", r["wall_s"]]
                              for r in out["accuracy"]]))  # fmt: skip
    if a.only in (None, "cost"):
        parts = {k: PARTS[k] for k in chosen(PARTS, a.parts)}
        out["cost"] = cost(a.cost_steps, a.timeout, parts)
        print(markdown_table(["part", "images/s", "vs plain", "waiting for data"],
                             [[r["part"], f"{r['images_per_s']:.0f}", f"{r['vs_plain']:.2f}",
                               f"{100 * r['fetch_share']:.0f} %"] for r in out["cost"]]))  # fmt: skip
        panels = [("images/s (step + wait for data)", [r["part"] for r in out["cost"]],
                   [r["images_per_s"] for r in out["cost"]])]  # fmt: skip
        bar_chart(os.path.join(a.out, "recipe.png"), "the V2 recipe's parts on the demo job", panels)
    write_json(os.path.join(a.out, "recipe.json"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
