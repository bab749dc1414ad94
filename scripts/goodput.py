"""Checkpointing calculator: failure odds, goodput, Young/Daly interval, and the article's tables.

python scripts/goodput.py failure --gpus 1024 --days 30 --afr 0.01 --json
python scripts/goodput.py goodput --interruptions-per-day 8.6 --interval-minutes 30
python scripts/goodput.py optimal-interval --save-stall-seconds 2 --mtbf-hours 24
python scripts/goodput.py tables
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# This file shares the package's name and Python puts the script's directory first on sys.path, so
# `import goodput` would load this file instead of the package. Drop that one entry before importing.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

from goodput import calculator  # noqa: E402

# A subcommand runs on parsed args and returns (JSON payload or None, human-readable text).
Result = tuple[dict[str, Any] | None, str]
Subcommand = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], Result]]


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")


def _failure_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--days", type=float, required=True)
    p.add_argument("--afr", type=float, required=True, help="annual failure rate per GPU, e.g. 0.01")
    _json_flag(p)


def _failure(a: argparse.Namespace) -> Result:
    p = calculator.failure_probability(a.gpus, a.days, a.afr)
    text = f"P(at least one failure) for {a.gpus} GPUs over {a.days:g} days at {a.afr:.2%} AFR: {p:.1%}"
    return {"probability": p}, text


def _goodput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--interruptions-per-day", type=float, required=True)
    p.add_argument("--interval-minutes", type=float, required=True, help="time between checkpoints")
    p.add_argument("--save-stall-seconds", type=float, default=0.0, help="training paused per save")
    p.add_argument("--restart-minutes", type=float, default=0.0, help="time to come back after a failure")
    _json_flag(p)


def _goodput(a: argparse.Namespace) -> Result:
    r = calculator.goodput(
        a.interruptions_per_day, a.interval_minutes, a.save_stall_seconds, a.restart_minutes
    )
    text = (
        f"Goodput {r['goodput']:.1%}: {r['lost_hours_per_day']:.2f} h/day recomputed, "
        f"{r['restart_hours_per_day']:.2f} h/day restarting, {r['stall_hours_per_day']:.2f} h/day saving"
    )
    return r, text


def _optimal_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-stall-seconds", type=float, required=True, help="training paused per save")
    p.add_argument("--mtbf-hours", type=float, required=True, help="mean time between failures of the job")
    p.add_argument("--restart-minutes", type=float, default=0.0, help="time to come back after a failure")
    _json_flag(p)


def _optimal(a: argparse.Namespace) -> Result:
    r = calculator.optimal_interval(a.save_stall_seconds, a.mtbf_hours, a.restart_minutes)
    text = f"Checkpoint every {r['interval_minutes']:.1f} min (Young/Daly) for goodput {r['goodput']:.1%}"
    return r, text


def _advise_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run", help="an MLflow run id, or a run's checkpoint dir (its commits name the MLflow run)"
    )
    p.add_argument("--gpus", type=int, default=1024, help="the scale to plan for")
    p.add_argument("--afr", type=float, default=0.01, help="annual failure rate per GPU")
    default_uri = os.environ.get(
        "MLFLOW_TRACKING_URI", f"sqlite:///{Path(__file__).resolve().parent.parent}/outputs/mlflow.db"
    )
    p.add_argument("--tracking-uri", default=default_uri)
    _json_flag(p)


def _run_id(run: str) -> str:
    """A checkpoint dir's newest COMMIT.json names the MLflow run; anything else is taken as a run id."""
    if "://" in run or os.path.isdir(run):
        from goodput.storage import Storage

        store = Storage(run)
        for name in sorted((n for n in store.ls() if n.startswith("step-")), reverse=True):
            try:
                return json.loads(store.read_bytes(f"{name}/COMMIT.json"))["mlflow_run_id"]
            except (FileNotFoundError, ValueError, KeyError):
                continue
        raise calculator.InputError("run", f"no committed checkpoint with an MLflow run id in {run}")
    return run


def _advise(a: argparse.Namespace) -> Result:
    """Plug a run's measured save stall and restart cost into Young/Daly at the scale asked for."""
    from mlflow.tracking import MlflowClient

    run_id = _run_id(a.run)
    client = MlflowClient(a.tracking_uri)
    try:
        run = client.get_run(run_id)
    except Exception as e:
        raise calculator.InputError("run", f"no MLflow run {run_id!r} in {a.tracking_uri} ({e})") from e
    stalls = sorted(m.value for m in client.get_metric_history(run_id, "ckpt/blocking_seconds"))
    if not stalls:
        raise calculator.InputError("run", f"run {run_id} logged no ckpt/blocking_seconds")
    stall = stalls[len(stalls) // 2]
    m = run.data.metrics
    attempts = 1 + int(m.get("goodput/restarts", 0))
    restart_s = m.get("goodput/startup_seconds", 0.0) / attempts  # start-up + restore, per attempt
    mtbf_h = calculator.mtbf_hours_from_afr(a.gpus, a.afr)
    r = calculator.optimal_interval(stall, mtbf_h, restart_s / 60)
    out = {
        "run_id": run_id, "gpus": a.gpus, "afr": a.afr, "mtbf_hours": mtbf_h, "save_stall_seconds": stall,
        "restart_seconds": restart_s, **r,
    }  # fmt: skip
    text = (
        f"At {a.gpus} GPUs and {a.afr:.1%} AFR (a failure every {mtbf_h:.1f} h), with this run's measured "
        f"save stall of {stall:.3f} s and restart cost of {restart_s:.1f} s: checkpoint every "
        f"{r['interval_minutes']:.1f} minutes for {100 * r['goodput']:.2f} % goodput"
    )
    return out, text


def _tables_args(p: argparse.ArgumentParser) -> None:
    pass


def _tables(a: argparse.Namespace) -> Result:
    return None, calculator.markdown(calculator.article_tables()).rstrip("\n")


# name -> (help, add_arguments, run). A new subcommand (e.g. `advise`) is one more entry here,
# or can be added by another module importing SUBCOMMANDS before calling main().
SUBCOMMANDS: dict[str, Subcommand] = {
    "failure": ("probability of at least one GPU failure", _failure_args, _failure),
    "goodput": ("goodput for a checkpoint interval", _goodput_args, _goodput),
    "optimal-interval": ("Young/Daly checkpoint interval", _optimal_args, _optimal),
    "advise": ("checkpoint interval for a measured run at a given scale", _advise_args, _advise),
    "tables": ("print the article's tables as markdown", _tables_args, _tables),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    subparsers = {}
    for name, (help_text, add_arguments, _) in SUBCOMMANDS.items():
        subparsers[name] = sub.add_parser(name, help=help_text)
        add_arguments(subparsers[name])
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    parser, subparsers = build_parser()
    args = parser.parse_args(argv)
    try:
        payload, text = SUBCOMMANDS[args.command][2](args)
    except calculator.InputError as e:
        # Argument names map one-to-one onto flags (gpus -> --gpus), so report the flag the user typed.
        subparsers[args.command].error(f"argument --{e.argument.replace('_', '-')}: {e.detail}")
    print(json.dumps(payload) if getattr(args, "json", False) else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
