"""Fault drill: the same job with seeded random SIGKILLs (automatic restarts) and without, side by side.

python scripts/drill.py                                   # demo job, dcp_async, kills with a 20 s MTBF
python scripts/drill.py --mtbf 10 --kills 2 -- checkpoint=dcp_sync checkpoint.every_n_steps=10
python scripts/drill.py --compare   # torch_save (long interval) vs dcp_sync / dcp_async (short)
python scripts/drill.py --preset mtbf60   # a failure every ~60 s over a >= 10 minute 2-rank demo job
python scripts/drill.py --preset rescue   # 2 x 26 kills of one rank of 2, checkpoints every 100 steps:
                                          # with rescues (rank 1, then rank 0 killed) and without
python scripts/drill.py --preset rescue60 # the same at a failure a minute: goodput against the clean run
python scripts/drill.py --preset spare60  # the same onto a warm spare (parallel.spares=1), beside rescue60
python scripts/drill.py --kills 0 --hang collective@30 --hang-rank 1 -- parallel=ddp   # a hang, no kills
python scripts/drill.py --mtbf 60 --kills 3 --hang-mtbf 60 --hangs 2 --hang-rank 1 -- parallel=ddp  # both
python scripts/drill.py --preset rescue60 --cpu   # also: CPU seconds per restart by process role
python scripts/drill.py --preset rescue60 --repeat 2 --only "rescue, rank 1"   # 2 clean/faulty pairs

Each faulty run is supervised by the elastic agent (parallel.max_restarts), so restarts are automatic;
the clean run has no faults. Prints goodput, lost work, restarts and stalls, whether the final
model_sha256 of the faulty run equals the clean one, and where each restart's time went (median
per phase, from summary.json's `recovery`); with --cpu, what a restart costs in CPU seconds by
process role (the elastic agent, its helpers, the ranks, their data workers) beside as long of
steady training. Writes JSON and markdown under --out.

Three ratios against the clean run: `vs_clean` (goodput over goodput), `wall_vs_clean` (wall over
wall) and `steady_vs_clean` (wall over wall with each run's steps at the clean run's steady speed,
see steady_cost), with `failure_s`, the wall seconds a failure cost, and `at_60s`, the ratio a
failure every 60 s would give. --repeat N interleaves N rounds, each compared with its own clean run.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import ROLES, TreeCPU, markdown_table

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "scripts" / "train.py")

COMPARE = {  # what the benchmark issue asks for: the baseline at a long interval, DCP at short ones
    "torch_save@50": ["checkpoint=torch_save", "checkpoint.every_n_steps=50"],
    "dcp_sync@10": ["checkpoint=dcp_sync", "checkpoint.every_n_steps=10"],
    "dcp_async@10": ["checkpoint=dcp_async", "checkpoint.every_n_steps=10"],
}


# A rank dies, the other survives: with rescue checkpoints (the default) each failure costs at most
# the step in flight, without them the steps since the last commit (every 100 here). Kills land on
# rank 1 in one run and on rank 0 (which commits and logs) in the other: 2 x 26 kills.
RESCUE = {
    "rescue, rank 1 killed": ["fault.rank=1"],
    "rescue, rank 0 killed": ["fault.rank=0"],
    "no rescue, rank 1 killed": ["fault.rank=1", "checkpoint.rescue=false"],
}

PRESETS = {  # a realistic ratio: failures every ~60 s, restarts cheap enough that they cost little
    "rescue": {
        "mtbf": 5.0,
        "kills": 26,
        "variants": RESCUE,
        "clean_variants": {"clean, no rescue": ["checkpoint.rescue=false"]},  # what noting boundaries costs
        "overrides": [
            "parallel=ddp",
            "checkpoint=dcp_async",
            "checkpoint.every_n_steps=100",
            "trainer.max_steps=1500",
        ],
    },
    "rescue60": {  # the goodput of a failure a minute with checkpoints every 100 steps
        "mtbf": 60.0,
        "kills": 12,
        "variants": {k: v for k, v in RESCUE.items() if "rank 0" not in k},
        "overrides": [
            "parallel=ddp",
            "checkpoint=dcp_async",
            "checkpoint.every_n_steps=100",
            "trainer.max_steps=3000",
        ],
    },
    "spare60": {  # rescue60 with a warm spare: the survivors keep their processes, no restart
        "mtbf": 60.0,
        "kills": 12,
        "variants": {
            "spare, rank 1 killed": ["fault.rank=1", "parallel.spares=1"],
            "rescue, rank 1 killed": ["fault.rank=1"],
        },
        "overrides": [
            "parallel=ddp",
            "checkpoint=dcp_async",
            "checkpoint.every_n_steps=100",
            "trainer.max_steps=3000",
        ],
    },
    "mtbf60": {
        "mtbf": 60.0,
        "kills": 12,
        "overrides": [
            "parallel=ddp",
            "checkpoint=dcp_async",
            "checkpoint.every_n_steps=20",
            "trainer.max_steps=3000",  # about 10-12 minutes clean on 2 cores
        ],
    },
}


def slug(label: str) -> str:
    """A variant's label as a run name (Hydra reads commas in an override as a sweep)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in label)


def run(root: str, name: str, overrides: list[str], cpu: bool = False) -> dict:
    """One job to its end; its summary.json. `cpu`: the job's process tree is sampled meanwhile, and
    the summary gets `cpu`, what its restarts cost in CPU time (cpu_per_failure)."""
    cmd = [sys.executable, TRAIN, f"paths.root={root}", f"run.name={name}", *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree = TreeCPU(p.pid).start() if cpu else None
    out, err = p.communicate()
    if tree is not None:
        tree.stop()
    if p.returncode != 0:
        sys.stderr.write(out[-3000:] + err[-5000:])
        raise SystemExit(f"drill run {name} failed with exit code {p.returncode}")
    files = sorted(glob.glob(f"{root}/runs/{name}/*/summary.json"), key=os.path.getmtime)
    s = json.loads(Path(files[-1]).read_text())
    s["elapsed"] = time.time() - t0
    s["steady_step_s"] = steady_step_seconds(tracking_uri(root, overrides), s)
    if tree is not None:
        s["cpu"] = cpu_per_failure(tree, s, s["elapsed"])
    return s


def cpu_per_failure(tree: TreeCPU, s: dict, elapsed: float, settle_s: float = 2.0) -> dict | None:
    """Mean CPU seconds by process role per restart (the kill -> the first resumed step), beside the
    same length of steady training: windows starting `settle_s` after a first resumed step, kept when
    they end before the next kill. The phases say where a restart waits; this says what it burns,
    which is what it costs where every core is busy (work moved between phases costs the same)."""
    spans = [(r["at"]["failure"], r["at"]["first_step"]) for r in per_restart(s)
             if "failure" in r.get("at", {}) and "first_step" in r.get("at", {})]  # fmt: skip
    if not spans or not tree.samples:
        return None
    restart = dict.fromkeys(ROLES, 0.0)
    steady = dict.fromkeys(ROLES, 0.0)
    steady_wall, n_steady = 0.0, 0
    ends = [a for a, _ in spans[1:]] + [tree.samples[-1][0]]
    for (a, b), nxt in zip(spans, ends):
        for role, c in tree.window(a, b).items():
            restart[role] += c
        s0 = b + settle_s
        if s0 + (b - a) < nxt:
            for role, c in tree.window(s0, s0 + (b - a)).items():
                steady[role] += c
            steady_wall, n_steady = steady_wall + b - a, n_steady + 1
    n = len(spans)
    wall = sum(b - a for a, b in spans) / n
    return {
        "restarts": n,
        "cpus": os.cpu_count(),
        "restart_wall_s": round(wall, 3),
        "restart_cpu_s": {k: round(v / n, 3) for k, v in restart.items()},
        # steady CPU per second of wall, over as long as a mean restart
        "steady_cpu_s": {k: round(v / steady_wall * wall, 3) for k, v in steady.items()}
        if steady_wall
        else None,
        "steady_windows": n_steady,
        "sampler_cpu_share": round(tree.self_cpu_s / max(elapsed, 1e-9), 4),  # of one CPU, the drill's own
    }


def cpu_table(label: str, c: dict) -> str:
    """Per role: CPU seconds of a mean restart and of as long of steady training, and the share of
    the machine each kept busy."""
    st = c["steady_cpu_s"] or {}
    rows = [[role, f"{c['restart_cpu_s'][role]:.2f}", f"{st[role]:.2f}" if st else "n/a"] for role in ROLES]
    total_r, total_s = sum(c["restart_cpu_s"].values()), sum(st.values()) if st else None
    rows.append(["all", f"{total_r:.2f}", f"{total_s:.2f}" if st else "n/a"])

    def busy(cpu_s: float) -> str:
        return f"{100 * cpu_s / (c['restart_wall_s'] * c['cpus']):.0f} %"

    rows.append([f"busy ({c['cpus']} CPUs)", busy(total_r), busy(total_s) if st else "n/a"])
    n, wall, steady = c["restarts"], c["restart_wall_s"], c["steady_windows"]
    head = (f"{label}: CPU seconds per restart ({n}, {wall:.2f} s from kill to first resumed step) "
            f"and in as long of steady training ({steady} windows)")  # fmt: skip
    return head + "\n\n" + markdown_table(["role", "restart", "steady"], rows)


def steady_step_seconds(uri: str, s: dict) -> float | None:
    """How fast the machine ran the loop's steps during this run: the median of the run's
    `perf/step_seconds` (one value per log window, fetch included, the slowest rank's) in MLflow.
    The few windows a restart disturbs (a slow first step, then batches already prefetched) hardly
    move a median of one value per `trainer.log_every_n_steps`. None, with a warning, when the
    store cannot say: a figure is not worth the drill's other results."""
    if not s.get("mlflow_run_id"):
        return None
    from mlflow.tracking import MlflowClient

    try:
        history = MlflowClient(uri).get_metric_history(s["mlflow_run_id"], "perf/step_seconds")
    except Exception as e:  # noqa: BLE001  (any store error: the figure is left out, not the drill)
        print(f"drill: no steady step time for run {s['mlflow_run_id']} in {uri}: {e}", file=sys.stderr)
        return None
    return statistics.median(m.value for m in history) if history else None


def tracking_uri(root: str, overrides: list[str]) -> str:
    """The MLflow store the runs log to: an `mlflow.tracking_uri=` override, else what the config
    reads (MLFLOW_TRACKING_URI, else the SQLite file under paths.root)."""
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("mlflow.tracking_uri=")]
    return given[-1] if given else os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root}/mlflow.db"


STEADY = ("steady_vs_clean", "failure_s", "at_60s")  # steady_cost's figures


def steady_cost(s: dict, clean: dict) -> dict:
    """What the failures cost in wall time, with this run's steps put at the clean run's steady speed.

    `wall_vs_clean` carries any change of the machine's speed between two runs, and on a shared
    machine the steps of two runs minutes apart differ by a few percent: as much as the failures
    cost. `vs_clean` (goodput over goodput) carries the productive seconds of both, and where the
    loader's workers share the CPU with the steps, the steps after a restart run faster (their
    batches were prefetched during it): that charges a restart with work the clean run does inside
    its steps. Here each run's step time is measured against itself (`steady_step_seconds`), and
    the faulty run's wall is what it would have been at the clean run's step speed:
        wall' = wall - steps run x (steady step s - clean's steady step s)
    `steady_vs_clean` = clean wall / wall'; `failure_s`: (wall' - clean wall) per restart, which
    keeps the restart's moved work on both sides; `at_60s`: the ratio a failure every 60 s of clean
    training would give, 60 / (60 + failure_s)."""
    g, gc = s["goodput"], clean["goodput"]
    sf, sc = s.get("steady_step_s"), clean.get("steady_step_s")
    if sf is None or sc is None:
        return dict.fromkeys(STEADY)
    ran = s["steps"] + g["lost_steps"]  # steps redone after a failure ran at this run's speed too
    wall = g["wall_seconds"] - ran * (sf - sc)
    per = (wall - gc["wall_seconds"]) / g["restarts"] if g["restarts"] else None
    return {
        "steady_vs_clean": round(gc["wall_seconds"] / wall, 4),
        "failure_s": None if per is None else round(per, 3),
        "at_60s": None if per is None else round(60.0 / (60.0 + per), 4),
    }


def row(label: str, s: dict, clean: dict | None) -> dict:
    g = s["goodput"]
    clean_wall = None if clean is None else clean["goodput"]["wall_seconds"]
    return {
        "run": label,
        "goodput": g["goodput"],
        "restarts": g["restarts"],
        "lost_steps": g["lost_steps"],
        "lost_s": g["lost_seconds"],
        "ckpt_stall_s": g["checkpoint_seconds"],
        "hung_s": g.get("hung_seconds", 0.0),
        "fetch_s": g["fetch_seconds"],
        "productive_s": g["productive_seconds"],
        "wall_s": g["wall_seconds"],
        "same_model": None if clean is None else s["model_sha256"] == clean["model_sha256"],
        "restart_s": restart_cost(s),
        "rescued": s.get("rescues", {}).get("count", 0),
        "in_process": (s.get("recovery") or {}).get("in_process", 0),  # onto a spare (parallel.spares)
        # failure -> first productive step, over the run's failures: median and p95 (nearest rank)
        **recovery_spread(s),
        # per restart: the steps the failed attempt had finished that the restart redid
        "max_lost_per_failure": max((r.get("lost_steps", 0) for r in per_restart(s)), default=None),
        "vs_clean": None if clean is None else round(g["goodput"] / clean["goodput"]["goodput"], 4),
        # the same steps and the same model: the clean run's wall time over this one's
        "wall_vs_clean": None if clean is None else round(clean_wall / g["wall_seconds"], 4),
        "steady_step_s": None if s.get("steady_step_s") is None else round(s["steady_step_s"], 5),
        **(steady_cost(s, clean) if clean is not None else dict.fromkeys(STEADY)),
    }


def recovery_spread(s: dict) -> dict:
    """Median and p95 (nearest rank) of the seconds from a failure to the first productive step."""
    totals = sorted(r["total_seconds"] for r in per_restart(s) if r.get("total_seconds") is not None)
    if not totals:
        return {"recovery_p50_s": None, "recovery_p95_s": None}
    return {"recovery_p50_s": round(statistics.median(totals), 3),
            "recovery_p95_s": round(totals[math.ceil(0.95 * len(totals)) - 1], 3)}  # fmt: skip


def per_restart(s: dict) -> list[dict]:
    return (s.get("recovery") or {}).get("per_restart", [])


def restart_cost(s: dict) -> float | None:
    """Seconds lost per restart beyond the redone steps, from summary.json's goodput figures alone."""
    g = s["goodput"]
    if not g["restarts"]:
        return None
    step = g["productive_seconds"] / max(1, s["steps"])
    return (g["lost_seconds"] - g["lost_steps"] * step) / g["restarts"]


def phase_table(label: str, s: dict) -> str:
    """Median seconds per recovery phase over the run's restarts, and the total's median and p90."""
    r = s.get("recovery") or {}
    med = r.get("median_seconds")
    if not med:
        return ""
    head = "| " + " | ".join(["run", "restarts", *med, "total median", "total p90", "extra rounds"]) + " |"
    cells = [label, str(r["restarts"]), *(f"{v:.2f}" for v in med.values())]
    cells += [
        f"{r.get('total_median_seconds', float('nan')):.2f}",
        f"{r.get('total_p90_seconds', float('nan')):.2f}",
    ]
    cells.append(str(r.get("extra_rounds", "n/a")))
    return "\n".join([head, "|" + "---|" * len(cells), "| " + " | ".join(cells) + " |"])


def markdown(rows: list[dict]) -> str:
    cols = list(rows[0])
    ratio = lambda v: f"{v:.3f}"  # noqa: E731  (a 1 % question needs the third digit)
    fmt = {"goodput": lambda v: f"{100 * v:.1f}%", "steady_step_s": lambda v: f"{v:.4f}"}
    fmt.update(dict.fromkeys(("vs_clean", "wall_vs_clean", "steady_vs_clean", "at_60s"), ratio))
    plain = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r[c]) if r[c] is None else fmt.get(c, plain)(r[c]) for c in cols]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=str(REPO / "outputs" / "drill"), help="paths.root for the drill runs")
    p.add_argument("--out", default=str(REPO / "outputs" / "bench"))
    p.add_argument("--mtbf", type=float, help="mean seconds between kills (default 20, or the preset's)")
    p.add_argument("--kills", type=int, help="most kills per faulty run (default 2, or the preset's)")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill times (repeatable drills)")
    p.add_argument(
        "--compare", action="store_true", help="faulty runs for torch_save@50, dcp_sync@10, dcp_async@10"
    )
    p.add_argument(
        "--hang", metavar="SITE@STEP", help="also hang one rank once: fault.hang_site at fault.hang_at_step "
        "(step, collective, storage_read, storage_write, dataloader)",
    )  # fmt: skip
    p.add_argument(
        "--hang-mtbf", type=float, metavar="SECONDS",
        help="random hangs with this mean time between them (fault.hang_mtbf_seconds), at --hang-site",
    )  # fmt: skip
    p.add_argument("--hangs", type=int, default=1, help="at most this many random hangs (fault.max_hangs)")
    p.add_argument("--hang-site", default="step", help="fault.hang_site of --hang-mtbf's hangs")
    p.add_argument("--hang-rank", type=int, default=0, help="the rank that hangs (fault.hang_rank)")
    p.add_argument(
        "--hang-timeout", type=float, default=5.0, help="trainer.hang_timeout_s of the faulty runs"
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="mtbf, kills and overrides of a named drill")
    p.add_argument(
        "--cpu", action="store_true",
        help="sample the faulty runs' processes (Linux): CPU seconds of a restart by process role",
    )  # fmt: skip
    p.add_argument(
        "--repeat", type=int, default=1, metavar="N",
        help="N rounds of the clean run and the faulty ones, interleaved; each faulty run is compared "
        "with its own round's clean run",
    )  # fmt: skip
    p.add_argument("--only", metavar="TEXT", help="only the faulty variants whose label starts with TEXT")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    a = p.parse_args()
    variants = COMPARE if a.compare else {"faulty": []}
    pre = PRESETS[a.preset] if a.preset else {"mtbf": 20.0, "kills": 2, "overrides": []}
    # the preset's values; --mtbf, --kills and the overrides given after -- still win
    a.mtbf = pre["mtbf"] if a.mtbf is None else a.mtbf
    a.kills = pre["kills"] if a.kills is None else a.kills
    a.overrides = [*pre["overrides"], *a.overrides]
    variants = pre.get("variants", variants)
    if a.only is not None:
        variants = {k: v for k, v in variants.items() if k.startswith(a.only)}
        if not variants:
            p.error(f"--only {a.only!r} matches no variant")
    if a.mtbf <= 0 or a.kills < 0:
        p.error("--mtbf must be > 0 and --kills >= 0")
    if a.repeat < 1:
        p.error(f"--repeat must be >= 1, got {a.repeat}")
    if a.hang and a.hang_mtbf:
        p.error("--hang (one hang at a step) and --hang-mtbf (random hangs) are exclusive")
    hangs = bool(a.hang) + (a.hangs if a.hang_mtbf else 0)

    tag = time.strftime("%Y%m%d-%H%M%S")
    faults = [
        f"fault.mtbf_seconds={a.mtbf}",
        f"fault.max_kills={a.kills}",
        f"parallel.max_restarts={a.kills + 1 + hangs}",
    ]
    if a.hang_mtbf:
        faults += [f"fault.hang_site={a.hang_site}", f"fault.hang_mtbf_seconds={a.hang_mtbf}",
                   f"fault.max_hangs={a.hangs}", f"fault.hang_rank={a.hang_rank}",
                   f"trainer.hang_timeout_s={a.hang_timeout}"]  # fmt: skip
    if a.hang:
        site, _, at = a.hang.partition("@")
        if not at.isdecimal():
            p.error(f"--hang wants SITE@STEP, got {a.hang!r}")
        faults += [f"fault.hang_site={site}", f"fault.hang_at_step={int(at)}",
                   f"fault.hang_rank={a.hang_rank}", f"trainer.hang_timeout_s={a.hang_timeout}"]  # fmt: skip
    # The first run under a root pays one-time costs that would count in its wall time: demo data
    # generation, MLflow database creation, cold file caches. A one-step warm-up pays them, so the
    # clean and the faulty runs start alike (without it, cheap restarts made faulty beat clean).
    # Longer than the demo's LR warm-up (20 steps), which a run of one step would be refused for.
    print("warm-up run (data, MLflow database, file caches) ...", flush=True)
    run(a.root, f"drill-{tag}/warmup", [*a.overrides, "trainer.max_steps=25", f"seed={a.seed}"])
    rows, phases, recovery, lost, cpu = [], [], {}, {}, {}
    for k in range(1, a.repeat + 1):
        n = f" #{k}" if a.repeat > 1 else ""  # a round's labels and run names
        print(f"clean run{n} ({' '.join(a.overrides) or 'defaults'}) ...", flush=True)
        clean = run(a.root, f"drill-{tag}/{slug('clean' + n)}", [*a.overrides, f"seed={a.seed}"])
        rows.append(row("clean" + n, clean, None))
        for label, extra in (PRESETS[a.preset].get("clean_variants", {}) if a.preset else {}).items():
            print(f"{label}{n} ...", flush=True)
            s = run(a.root, f"drill-{tag}/{slug(label + n)}", [*a.overrides, *extra, f"seed={a.seed}"])
            rows.append(row(label + n, s, clean))
        for label, extra in variants.items():
            hang = f", hang at {a.hang} on rank {a.hang_rank}" if a.hang else ""
            if a.hang_mtbf:
                hang = f", hangs at {a.hang_site} with mean {a.hang_mtbf:g}s (at most {a.hangs})"
            print(f"{label}{n}: kills with mean {a.mtbf:g}s (at most {a.kills}){hang} ...", flush=True)
            args = [*a.overrides, *extra, *faults, f"seed={a.seed}"]
            s = run(a.root, f"drill-{tag}/{slug(label + n)}", args, a.cpu)
            label += n
            rows.append(row(label, s, clean))  # checkpointing never changes the maths: same model expected
            phases.append(phase_table(label, s))
            if s.get("cpu"):
                cpu[label] = s["cpu"]
            recovery[label] = s.get("recovery")
            lost[label] = [(r.get("resumed_kind"), r.get("lost_steps")) for r in per_restart(s)]
    table = markdown(rows)
    phase_md = "\n\n".join(p for p in phases if p)
    print(table)
    if phase_md:
        print("\nrecovery phases (median seconds per restart; each from the previous phase's end):")
        print(phase_md)
    if a.repeat > 1:  # one line per variant: its rounds side by side
        for label in variants:
            got = [r for r in rows if r["run"].startswith(label + " #")]
            figures = ("vs_clean", "wall_vs_clean", "steady_vs_clean", "failure_s")
            print(f"{label}: " + ", ".join(f"{k} {[r[k] for r in got]}" for k in figures))
    for label, per in lost.items():  # what each failure cost: (resumed from, steps redone)
        print(f"{label}: lost steps per restart {[n for _, n in per]} (resumed from {[k for k, _ in per]})")
    cpu_md = "\n\n".join(cpu_table(label, c) for label, c in cpu.items())
    if cpu_md:
        print("\n" + cpu_md)
    os.makedirs(a.out, exist_ok=True)
    result = {
        "mtbf_seconds": a.mtbf,
        "max_kills": a.kills,
        "hang": a.hang,
        "hang_rank": a.hang_rank,
        "hang_mtbf_seconds": a.hang_mtbf,
        "max_hangs": a.hangs if a.hang_mtbf else None,
        "overrides": a.overrides,
        "repeat": a.repeat,
        "rows": rows,
        "recovery": recovery,
        "lost_steps_per_restart": lost,
        "cpu": cpu,
    }
    Path(a.out, "drill.json").write_text(json.dumps(result, indent=2))
    Path(a.out, "drill.md").write_text("\n\n".join(x for x in (table, phase_md, cpu_md) if x) + "\n")
    print(f"wrote {a.out}/drill.json and drill.md")


if __name__ == "__main__":
    main()
