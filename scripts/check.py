"""Does resume stay exact under your edit? A short run of your config, killed and resumed, compared
state by state with the same run uninterrupted: `make check ARGS="experiment=... key=value"`.

python scripts/check.py                          # the default config (experiment=demo), 8 steps
python scripts/check.py experiment=smoke task=multilabel
python scripts/check.py --steps 12 --kill-at 5 batch_augment=mixup_cutmix parallel=ddp

Both runs take your overrides, then: `--steps` optimizer steps, a commit after every step (every
one kept), data workers on (at least 2: their randomness must not matter), no storage emulation,
no logged model, in a temporary paths.root (your demo data is reused). The second run is SIGKILLed
at step `--kill-at` (fault.kill_at_step; on several ranks the last one, so that rank 0 writes the
rescue: a BatchNorm model's rescue written by another rank carries that rank's statistics, which
docs/checkpointing.md states) and relaunched by the same command. Then every commit
both runs have after the resume is read whole (model, EMA, optimizer, LR schedule, loader
position, every rank's RNG streams, the step's counters; the goodput ledger's timings aside) and
compared key by key, step by step. Prints "resume is exact" and exits 0, or names the first state
that differs (e.g. "model: blocks.0.0.weight differs after the resume at step 4") and exits 1.
A run that fails exits 2 with its output's tail. The usual causes of a difference, and their fixes:
docs/recipe.md ("After an edit: make check").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "scripts" / "train.py")
# extra.<part> -> what it is, in a message
PARTS = {"data": "loader position", "scheduler": "LR schedule", "step": "the step's counters (grad scaler)",
         "param_groups": "optimizer param groups", "best": "best checkpoint so far",
         "early_stopping": "early-stopping counter"}  # fmt: skip
IGNORED = {"extra.ledger"}  # the goodput ledger: wall-clock timings, which no two runs share
ORDER = ("model.", "ema.", "optim.", "extra.", "rank")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps of each run (default 8)")
    p.add_argument("--kill-at", type=int, help="the step the second run is killed at (default: steps / 2)")
    p.add_argument("--keep", action="store_true", help="keep the runs' directory (its path is printed)")
    p.add_argument("--timeout", type=float, default=600, help="seconds for each launch")
    p.add_argument("overrides", nargs="*", help="your Hydra overrides (as for scripts/train.py)")
    a = p.parse_args(argv)
    kill = a.kill_at if a.kill_at is not None else max(1, a.steps // 2)
    if not 1 <= kill < a.steps:
        p.error(f"--kill-at must be in [1, --steps): got {kill} with --steps {a.steps}")
    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix="goodput-check-")
    try:
        common = check_overrides(a.overrides, a.steps)
        ref, killed = os.path.join(tmp, "uninterrupted"), os.path.join(tmp, "killed")
        print(f"check: {a.steps} steps of your config, uninterrupted and killed at step {kill}, in {tmp}")
        faulty = [*a.overrides, *common, f"paths.root={killed}", f"fault.kill_at_step={kill}"]
        # the two first launches side by side: most of a launch is one process importing
        both = [
            start([*a.overrides, *common, f"paths.root={ref}"], f"{ref}.log"),
            start(faulty, f"{killed}.log"),
        ]
        wait(both[0], a.timeout, "the uninterrupted run")
        # killed: the process itself (one rank) or, under the elastic agent, the job exits non-zero
        fired = os.path.join(killed, "checkpoints", "check", "faults", f"kill_at_step-{kill}.fired")
        first = wait(both[1], a.timeout, "the killed run", killed=lambda: os.path.exists(fired))
        if first != 0:  # no restart inside the job (parallel.max_restarts=0): relaunch it, as a user would
            wait(start(faulty, f"{killed}-relaunch.log"), a.timeout, "the relaunch")
        verdict = compare(ref, killed)
    except CheckError as e:
        print(f"check: {e}", file=sys.stderr)
        return 2
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    took = f"({time.time() - t0:.0f} s)"
    if verdict is None:
        print(f"check: resume is exact {took}")
        return 0
    print(f"check: {verdict} {took}")
    print("check: the usual causes and their fixes: docs/recipe.md, 'After an edit: make check'")
    return 1


class CheckError(Exception):
    pass


def check_overrides(user: list[str], steps: int) -> list[str]:
    """What both runs add to the user's overrides (composed once here to reuse the demo data and
    keep the user's worker count when it is higher)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        try:
            cfg = compose("train", overrides=[o for o in user if not o.startswith("-")])
        except Exception as e:
            raise CheckError(f"your overrides do not compose: {e}") from None
    data_dir = os.path.abspath(str(cfg.paths.data_dir))
    return [
        f"trainer.max_steps={steps}",
        "checkpoint.every_n_steps=1",
        "checkpoint.every_n_minutes=null",
        f"checkpoint.keep_last={steps + 1}",
        f"data.num_workers={max(2, int(cfg.data.num_workers))}",
        "storage.latency_ms=0",
        "storage.bandwidth_mb_s=0",
        "storage.error_rate=0",
        "mlflow.log_model=none",
        "run.name=check",
        f"paths.data_dir={data_dir}",
        f"fault.rank={max(0, int(cfg.parallel.nproc_per_node) - 1)}",
    ]


def start(overrides: list[str], log: str) -> subprocess.Popen:
    """scripts/train.py with `overrides`, its output into the file `log`."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONUNBUFFERED"] = "1"
    flags = [o for o in overrides if o.startswith("-")]
    cmd = [sys.executable, TRAIN, *flags, *[o for o in overrides if not o.startswith("-")]]
    with open(log, "w") as out:  # the child has its own copy of the descriptor
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    p.log = log
    return p


def wait(p: subprocess.Popen, timeout: float, what: str, killed=lambda: False) -> int:
    """The exit status of `p`: 0, or another when `killed()` says the kill that was asked fired."""
    try:
        rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise CheckError(f"{what} took over {timeout:.0f} s (--timeout)") from None
    if rc == 0 or killed():
        return rc
    with open(p.log) as f:
        tail = "\n".join(f.read().splitlines()[-15:])
    raise CheckError(f"{what} exited {rc}:\n{tail}")


def summary(root: str) -> dict:
    found = sorted(Path(root, "runs").glob("*/*/summary.json"), key=os.path.getmtime)
    if not found:
        raise CheckError(f"no summary.json under {root}/runs: the run did not finish")
    return json.loads(found[-1].read_text())


def compare(ref: str, killed: str) -> str | None:
    """None when every commit both runs have after the resume holds the same state; else the first
    difference, in words."""
    from goodput.checkpoint.commits import Commits
    from goodput.storage.remote import Storage

    a, b = summary(ref), summary(killed)
    resumed = b.get("resumed_from_steps") or []
    if not resumed:
        return "the second run was not resumed (its kill did not fire?): nothing was checked"
    at = resumed[-1]
    stores = [Storage(os.path.join(r, "checkpoints", "check")) for r in (ref, killed)]
    commits = [{c["step"]: c for c in Commits(s).committed()} for s in stores]
    steps = sorted(s for s in commits[0].keys() & commits[1].keys() if s > at)
    if not steps:
        return f"no commit after the resume at step {at} in both runs: nothing was checked"
    for step in steps:
        diff = differs(*(full(s, c[step]) for s, c in zip(stores, commits)))
        if diff:
            what, detail = diff
            where = [f"at step {step}"] if step != at + 1 else []
            more = f" ({'; '.join(where + ([detail] if detail else []))})" if where or detail else ""
            return f"{what} after the resume at step {at}{more}"
    for key in ("model_sha256", "sample_order_sha256"):
        if a.get(key) != b.get(key):
            return f"summary.json {key} differs after the resume at step {at}"
    return None


def full(store, rec) -> dict:
    from goodput.checkpoint.export import full_state

    return full_state(store, rec)


def differs(a: dict, b: dict) -> tuple[str, str] | None:
    """The first key whose tensors differ: ('<part>: <key> differs', a detail or ''); None when
    all are equal."""
    import torch

    from goodput.checkpoint.state import decode

    keys = sorted((a.keys() | b.keys()) - IGNORED, key=lambda k: (_rank(k), k))
    for k in keys:
        if k not in a or k not in b:
            return f"{_part(k)}: {_name(k)} is in one run's checkpoint only", ""
        x, y = a[k], b[k]
        if x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y):
            continue
        if k.startswith("extra.") and x.dtype == torch.uint8:  # a JSON part: which field
            try:
                u, v = decode(x), decode(y)
                fields = sorted(f for f in u.keys() | v.keys() if u.get(f) != v.get(f))
                return f"{_part(k)}: {', '.join(fields)} differs", ""
            except Exception:
                pass
        gap = ""
        if x.shape == y.shape and x.is_floating_point():
            gap = f"largest difference {(x.double() - y.double()).abs().max().item():.3g}"
        return f"{_part(k)}: {_name(k)} differs", gap
    return None


def _rank(key: str) -> int:
    return next((i for i, p in enumerate(ORDER) if key.startswith(p)), len(ORDER))


def _part(key: str) -> str:
    head = key.split(".", 1)[0]
    if head == "model":
        return "model"
    if head == "ema":
        return "EMA weights"
    if head == "optim":
        return "optimizer"
    if head == "extra":
        name = key.split(".")[1]
        return PARTS.get(name, name)
    if head.startswith("rank"):
        return f"RNG state of {head}" if key.endswith("rng") or ".rng." in key else head
    return head


def _name(key: str) -> str:
    return key.split(".", 1)[1] if "." in key else key


if __name__ == "__main__":
    sys.exit(main())
