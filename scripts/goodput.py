"""Checkpointing calculator: failure odds, goodput, Young/Daly interval, and the article's tables.

python scripts/goodput.py failure --gpus 1024 --days 30 --afr 0.01 --json
python scripts/goodput.py goodput --interruptions-per-day 8.6 --interval-minutes 30
python scripts/goodput.py optimal-interval --save-stall-seconds 2 --mtbf-hours 24
python scripts/goodput.py tables
"""

from __future__ import annotations

import argparse
import json
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
