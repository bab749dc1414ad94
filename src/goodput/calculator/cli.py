"""Checkpoint planner: failure odds, goodput, Young/Daly interval, Monte-Carlo, advice for a measured run.

python -m goodput.calculator failure --gpus 1024 --days 30 --afr 0.01 --json
python -m goodput.calculator failure --gpus 4096 --days 30 --cluster-gpus 608 --cluster-mtbf-hours 1.9
python -m goodput.calculator goodput --interruptions-per-day 8.6 --interval-minutes 30
python -m goodput.calculator optimal-interval --save-stall-seconds 2 --mtbf-hours 24
python -m goodput.calculator simulate --gpus 4096 --afr 0.01 --save-stall-seconds 0.1 --restart-seconds 9
python -m goodput.calculator simulate --gpus 4096 --afr 0.01 --save-stall-seconds 0.1 --restart-seconds 9 \
    --rescue-probability 0.9 --step-seconds 2
python -m goodput.calculator advise outputs/checkpoints/demo-<digest> --gpus 1024 --afr 0.01
python -m goodput.calculator plan-table --afr 0.01 --restart-seconds 9 2
python -m goodput.calculator tables

A failure rate is given once, in one of these forms: the job's own (--interruptions-per-day or
--mtbf-hours), or per GPU with --gpus: --afr (failures per GPU-year, any rate >= 0) or a cluster's
measurement (--cluster-gpus with --cluster-mtbf-hours or --cluster-interruptions-per-day). Per-GPU
rates assume GPUs fail independently at one rate, so a job's rate is proportional to its GPU count.
With --rescue-probability P (and --step-seconds S), a share P of failures is rescued by a surviving
replica and loses one step: lost work per failure = (1 - P) * interval/2 + P * S.
Installed, `goodput-plan` is the same command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from goodput import calculator as calc
from goodput.calculator import InputError

# A subcommand runs on parsed args and returns (JSON payload or None, human-readable text).
Result = tuple[dict[str, Any] | None, str]
Subcommand = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], Result]]


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")


def _rate_args(p: argparse.ArgumentParser, job: bool = True) -> None:
    g = p.add_argument_group("failure rate (give one)")
    if job:
        g.add_argument("--interruptions-per-day", type=float, help="the job's own failure rate")
        g.add_argument("--mtbf-hours", type=float, help="the job's mean time between failures")
    g.add_argument("--gpus", type=int, help="GPUs in the job (turns a per-GPU rate into the job's)")
    g.add_argument("--afr", type=float, help="failures per GPU-year, e.g. 0.01 (a rate: may exceed 1)")
    g.add_argument("--cluster-gpus", type=int, help="GPUs of a cluster whose failure rate was measured")
    g.add_argument("--cluster-mtbf-hours", type=float, help="that cluster's mean time between failures")
    g.add_argument("--cluster-interruptions-per-day", type=float, help="or its interruptions per day")


def _commit_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--commit-delay-seconds", type=float, default=0.0,
        help="from the end of a save's stall until it is committed (an async upload; default 0)",
    )  # fmt: skip


def _rescue_args(p: argparse.ArgumentParser, default: str = "0") -> None:
    p.add_argument(
        "--rescue-probability", type=float,
        help=f"share of failures a surviving replica rescues, losing one step (0..1; default {default})",
    )  # fmt: skip
    p.add_argument(
        "--step-seconds", type=float, help="seconds per training step: what a rescued failure loses"
    )


def _rescue(a: argparse.Namespace) -> dict[str, Any]:
    """The rescue keywords of the closed forms and the simulation; checked there, naming the flags."""
    return {"rescue_probability": a.rescue_probability or 0.0, "step_seconds": a.step_seconds}


def _rescue_line(p: float, step: float | None, per_failure: float, indent: str = "") -> list[str]:
    if not p:  # without rescue the output stays as it was
        return []
    return [f"{indent}Rescue checkpoints: {p:.1%} of failures lose one {step:g} s step instead of the work "
            f"since the last save: {per_failure:.4g} s lost per failure (closed form)"]  # fmt: skip


def _restart_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--restart-minutes", type=float, help="time from a failure until training resumes")
    g.add_argument("--restart-seconds", type=float, help="the same in seconds")


def _restart_minutes(a: argparse.Namespace) -> float:
    if a.restart_seconds is not None:
        a.flag_for = {**getattr(a, "flag_for", {}), "restart_minutes": "restart_seconds"}
        calc._non_negative("restart_seconds", a.restart_seconds)
        return a.restart_seconds / 60
    return a.restart_minutes or 0.0


@dataclass
class Rate:
    """A job's failure rate and how it was derived (for the human output and the JSON)."""

    interruptions_per_day: float
    gpus: int | None = None
    afr: float | None = None
    lines: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mtbf_hours(self) -> float:
        return 24 / self.interruptions_per_day if self.interruptions_per_day > 0 else math.inf

    def payload(self) -> dict[str, Any]:
        mtbf = self.mtbf_hours if math.isfinite(self.mtbf_hours) else None  # JSON has no infinity
        return {"interruptions_per_day": self.interruptions_per_day, "mtbf_hours": mtbf, "gpus": self.gpus,
                "afr": self.afr, **self.extra}  # fmt: skip


def _given(a: argparse.Namespace, name: str) -> bool:
    return getattr(a, name, None) is not None


def _rate(
    a: argparse.Namespace, required: str = "interruptions_per_day", default_afr: float | None = None
) -> Rate:
    """Resolve the one failure rate the user gave; a bad or missing combination names its flag."""
    if a.gpus is not None:  # also when it only scales GPU-hours: a zero must not pass as "one GPU"
        calc._count("gpus", a.gpus)
    sources = [n for n in ("interruptions_per_day", "mtbf_hours", "afr", "cluster_gpus") if _given(a, n)]
    for n in ("cluster_mtbf_hours", "cluster_interruptions_per_day"):
        if _given(a, n) and not _given(a, "cluster_gpus"):
            raise InputError("cluster_gpus", f"is needed with --{n.replace('_', '-')}")
    if not sources and default_afr is not None:
        a.afr, sources = default_afr, ["afr"]
    if not sources:
        raise InputError(required, "is required (or another failure rate: see --help)")
    if len(sources) > 1:
        first, second = (f"--{s.replace('_', '-')}" for s in sources[:2])
        raise InputError(sources[1], f"cannot be combined with {first}: give one failure rate")
    src = sources[0]
    if src == "interruptions_per_day":
        calc._non_negative("interruptions_per_day", a.interruptions_per_day)
        r = Rate(a.interruptions_per_day, a.gpus)
        r.lines.append(f"Job failure rate: {r.interruptions_per_day:g} interruptions/day")
    elif src == "mtbf_hours":
        calc._positive("mtbf_hours", a.mtbf_hours)
        r = Rate(24 / a.mtbf_hours, a.gpus)
        r.lines.append(f"Job failure rate: one every {a.mtbf_hours:g} h")
    else:
        if src == "afr":
            calc._non_negative("afr", a.afr)
            afr = a.afr
            r_lines = [f"Per-GPU rate: AFR {afr:.4g} failures per GPU-year ({afr:.2%})"]
            extra: dict[str, Any] = {}
        else:
            both = [n for n in ("cluster_mtbf_hours", "cluster_interruptions_per_day") if _given(a, n)]
            if len(both) != 1:
                raise InputError(
                    "cluster_mtbf_hours",
                    "or --cluster-interruptions-per-day (exactly one) must come with --cluster-gpus",
                )
            if both[0] == "cluster_mtbf_hours":
                afr = calc.afr_from_cluster(a.cluster_gpus, a.cluster_mtbf_hours)
                measured = f"a failure every {a.cluster_mtbf_hours:g} h"
                extra = {"cluster_gpus": a.cluster_gpus, "cluster_mtbf_hours": a.cluster_mtbf_hours}
            else:
                afr = calc.afr_from_interruptions(a.cluster_gpus, a.cluster_interruptions_per_day)
                measured = f"{a.cluster_interruptions_per_day:g} interruptions/day"
                extra = {"cluster_gpus": a.cluster_gpus,
                         "cluster_interruptions_per_day": a.cluster_interruptions_per_day}  # fmt: skip
            r_lines = [
                f"Measured: {a.cluster_gpus} GPUs, {measured} -> {afr:.4g} failures per GPU-year "
                f"(AFR {afr:.1%}), assuming GPUs fail independently at one rate, so a job's rate is "
                f"proportional to its GPU count"
            ]
        if a.gpus is None:
            raise InputError(
                "gpus", f"is needed to turn the per-GPU rate (--{src.replace('_', '-')}) into the job's"
            )
        per_day = calc.interruptions_per_day_from_afr(a.gpus, afr)
        r = Rate(per_day, a.gpus, afr, r_lines, extra)
        mtbf = f"one every {r.mtbf_hours:.4g} h" if per_day > 0 else "never"
        r.lines.append(f"At {a.gpus} GPUs: {per_day:.4g} interruptions/day, {mtbf} (the job's MTTF)")
    return r


def _failure_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--days", type=float, required=True)
    _rate_args(p)
    _json_flag(p)


def _failure(a: argparse.Namespace) -> Result:
    r = _rate(a, required="afr")
    calc._non_negative("days", a.days)
    expected = r.interruptions_per_day * a.days
    p = -math.expm1(-expected)  # = failure_probability(gpus, days, afr) for a per-GPU rate
    text = "\n".join(
        r.lines + [f"P(at least one failure) over {a.days:g} days: {p:.1%} ({expected:.3g} expected)"]
    )
    return {"probability": p, "expected_failures": expected, "days": a.days, **r.payload()}, text


def _goodput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--interval-minutes", type=float, required=True, help="from one save's start to the next")
    p.add_argument("--save-stall-seconds", type=float, default=0.0, help="training paused per save")
    _commit_arg(p)
    _restart_args(p)
    _rescue_args(p)
    _rate_args(p)
    _json_flag(p)


def _goodput(a: argparse.Namespace) -> Result:
    rate = _rate(a)
    restart = _restart_minutes(a)
    rescue = _rescue(a)
    args = (rate.interruptions_per_day, a.interval_minutes, a.save_stall_seconds, restart)
    r = calc.goodput(*args, commit_delay_seconds=a.commit_delay_seconds, **rescue)
    # The renewal form knows neither a commit delay nor a rescue.
    plain = a.commit_delay_seconds == 0 and rescue["rescue_probability"] == 0
    exact = calc.renewal_goodput(*args) if plain else None
    exact_text = "" if exact is None else f"; exact for Poisson failures: {exact:.1%}"
    per_failure = calc.lost_work_per_failure_seconds(a.interval_minutes, a.commit_delay_seconds, **rescue)
    text = "\n".join(rate.lines + _rescue_line(*rescue.values(), per_failure) + [
        f"Goodput {r['goodput']:.1%}: {r['lost_hours_per_day']:.2f} h/day recomputed, "
        f"{r['restart_hours_per_day']:.2f} h/day restarting, {r['stall_hours_per_day']:.2f} h/day saving "
        f"(first order{exact_text})"
    ])  # fmt: skip
    return {**r, "renewal_goodput": exact, **rescue, **rate.payload()}, text


def _optimal_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-stall-seconds", type=float, required=True, help="training paused per save")
    _commit_arg(p)
    _restart_args(p)
    _rescue_args(p)
    _rate_args(p)
    _json_flag(p)


def _optimal(a: argparse.Namespace) -> Result:
    rate = _rate(a, required="mtbf_hours")
    if rate.interruptions_per_day == 0:
        raise InputError(rate_flag(a), "gives no failures: there is no interval to trade against")
    rescue = _rescue(a)
    r = calc.optimal_interval(
        a.save_stall_seconds, rate.mtbf_hours, _restart_minutes(a), a.commit_delay_seconds, **rescue
    )
    return {**r, **rescue, **rate.payload()}, "\n".join(rate.lines + [_interval_text(r)])


def _interval_text(r: dict[str, Any]) -> str:
    if r["interval_minutes"] is None:  # p = 1: every failure costs one step whatever the interval
        return (f"Young/Daly sets no interval: {r['note']}; goodput {r['goodput']:.1%} (save as often as "
                "a failure no replica survives, a whole-job loss, can afford)")  # fmt: skip
    return f"Checkpoint every {r['interval_minutes']:.3g} min (Young/Daly) for goodput {r['goodput']:.1%}"


def rate_flag(a: argparse.Namespace) -> str:
    for n in (
        "interruptions_per_day",
        "mtbf_hours",
        "afr",
        "cluster_mtbf_hours",
        "cluster_interruptions_per_day",
    ):
        if _given(a, n):
            return n
    return "afr"


def _sim_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--days", type=float, default=30.0, help="length of the job (default 30)")
    p.add_argument("--trials", type=int, default=10_000, help="simulated jobs (default 10000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--weibull-shape", type=float, help="Weibull times between failures (default: exponential)"
    )


def _check_sim(a: argparse.Namespace) -> None:
    calc._positive("days", a.days)
    calc._count("trials", a.trials)
    if a.seed < 0:
        raise InputError("seed", f"must be >= 0, got {a.seed}")
    if a.weibull_shape is not None:
        calc._positive("weibull_shape", a.weibull_shape)


def _simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--interval-minutes", type=float, help="from one save's start to the next (default: Young/Daly)"
    )
    p.add_argument("--save-stall-seconds", type=float, default=0.0, help="training paused per save")
    _commit_arg(p)
    _restart_args(p)
    _rescue_args(p)
    _rate_args(p)
    _sim_args(p)
    _json_flag(p)


def _recommended(stall: float, rate: Rate, restart: float, rescue: dict[str, Any] | None = None) -> float:
    if rate.interruptions_per_day == 0:
        raise InputError("interval_minutes", "is required when there are no failures")
    if stall == 0:
        raise InputError("interval_minutes", "is required when saves are free (Young/Daly says: always)")
    r = calc.optimal_interval(stall, rate.mtbf_hours, restart, **(rescue or {}))
    if r["interval_minutes"] is None:
        raise InputError(
            "interval_minutes", "is required when every failure is rescued (Young/Daly sets none)"
        )
    return r["interval_minutes"]


def _run_simulation(
    a: argparse.Namespace,
    rate: Rate,
    interval: float,
    stall: float,
    restart: float,
    commit: float,
    rescue: dict[str, Any] | None = None,
) -> dict:
    from goodput.calculator.simulate import simulate

    return simulate(rate.interruptions_per_day, interval, stall, restart, days=a.days, gpus=rate.gpus or 1,
                    trials=a.trials, seed=a.seed, weibull_shape=a.weibull_shape,
                    commit_delay_seconds=commit, **(rescue or {}))  # fmt: skip


def _sim_text(s: dict) -> list[str]:
    shape = "exponential" if s["weibull_shape"] in (None, 1) else f"Weibull shape {s['weibull_shape']:g}"
    per = "" if s["gpus"] > 1 else " (per GPU: pass --gpus)"
    return [
        f"Simulated {s['trials']} jobs of {s['days']:g} days (seed {s['seed']}, {shape} times between "
        f"failures, {s['failures_mean']:.3g} failures per job on average), checkpoint every "
        f"{s['interval_minutes']:.3g} min, {s['save_stall_seconds']:.3g} s stall, "
        f"{s['restart_seconds']:.3g} s restart, {s['commit_delay_seconds']:.3g} s from stall to commit:",
        *_rescue_line(s["rescue_probability"], s["step_seconds"], s["lost_work_per_failure_seconds"], "  "),
        f"  goodput     mean {s['goodput_mean']:.3%} (± {s['goodput_sem']:.3%} std error)   "
        f"p10 {s['goodput_p10']:.3%}   p50 {s['goodput_p50']:.3%}   p90 {s['goodput_p90']:.3%}",
        f"  GPU-hours lost{per}   mean {s['lost_gpu_hours_mean']:,.0f}   "
        f"p10 {s['lost_gpu_hours_p10']:,.0f}   p50 {s['lost_gpu_hours_p50']:,.0f}   "
        f"p90 {s['lost_gpu_hours_p90']:,.0f}",
        f"  job hours, mean: redone {s['redone_hours_mean']:.3g}, restarting {s['restart_hours_mean']:.3g}, "
        f"saving {s['stall_hours_mean']:.3g}",
        f"  closed form (first order) {s['closed_form_goodput']:.2%}: simulation differs by "
        f"{100 * s['closed_form_difference']:+.2f} points"
        + (
            ""
            if s["renewal_goodput"] is None
            else f"; exact for exponential failures {s['renewal_goodput']:.2%}: "
            f"{100 * s['renewal_difference']:+.2f} points"
        ),
    ]


def _simulate(a: argparse.Namespace) -> Result:
    _check_sim(a)
    rate = _rate(a)
    restart = _restart_minutes(a)
    rescue = _rescue(a)
    interval = a.interval_minutes
    lines = list(rate.lines)
    if interval is None:
        interval = _recommended(a.save_stall_seconds, rate, restart, rescue)
        lines.append(f"Young/Daly interval for a {a.save_stall_seconds:g} s stall: {interval:.3g} min")
    s = _run_simulation(a, rate, interval, a.save_stall_seconds, restart, a.commit_delay_seconds, rescue)
    return {**s, **rate.payload(), "gpus": s["gpus"]}, "\n".join(lines + _sim_text(s))


def _advise_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run", help="an MLflow run id, or a run's checkpoint dir (its commits name the MLflow run)"
    )
    _rate_args(p, job=False)
    p.set_defaults(gpus=1024)
    default_uri = os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{os.path.abspath('outputs/mlflow.db')}")
    p.add_argument(
        "--tracking-uri", default=default_uri, help="default: $MLFLOW_TRACKING_URI or outputs/mlflow.db"
    )
    _rescue_args(p, default="measured from the attempt records")
    _sim_args(p)
    _json_flag(p)


def _advise(a: argparse.Namespace) -> Result:
    """Plug a run's measured save stall and restart cost into Young/Daly and the simulation."""
    from goodput.calculator.advise import measured

    _check_sim(a)
    rate = _rate(a, required="afr", default_afr=0.01)
    if a.rescue_probability is not None:  # refused before the (slow) MLflow read
        calc._probability("rescue_probability", a.rescue_probability)
    if a.step_seconds is not None:
        calc._positive("step_seconds", a.step_seconds)
    m = measured(a.run, a.tracking_uri)
    a.flag_for = {"restart_minutes": "run", "save_stall_seconds": "run", "interval_minutes": "run"}
    stall, restart, commit = m["save_stall_seconds"], m["restart_seconds"] / 60, m["commit_delay_seconds"]
    if rate.interruptions_per_day == 0:
        raise InputError(rate_flag(a), "gives no failures: there is no interval to trade against")
    rescue, source, rescue_text = _advise_rescue(a, m)
    r = calc.optimal_interval(stall, rate.mtbf_hours, restart, commit, **rescue)
    text = [
        f"Run {m['run_id']}: median save stall {stall:.3f} s, committed {commit:.2f} s after it; "
        f"restart cost {m['restart_seconds']:.1f} s from {m['restart_source']}",
        rescue_text,
        *rate.lines,
    ]
    out = {**rate.payload(), **m, **r, **rescue, "rescue_source": source}
    if r["interval_minutes"] is None:  # every restart rescued: no interval to simulate at
        return out, "\n".join([*text, _interval_text(r)])
    s = _run_simulation(a, rate, r["interval_minutes"], stall, restart, commit, rescue)
    text.append(
        f"Checkpoint every {r['interval_minutes']:.1f} minutes (Young/Daly) for {r['goodput']:.2%} goodput"
    )
    return {**s, **out}, "\n".join(text + _sim_text(s))


def _advise_rescue(a: argparse.Namespace, m: dict[str, Any]) -> tuple[dict[str, Any], str, str]:
    """The rescue probability (--rescue-probability, else the attempt records') and the step time
    (--step-seconds, else the run's mean productive seconds per step), whence p came, and a line."""
    p, source = m["rescue_probability"], m["rescue_source"]
    if a.rescue_probability is not None:  # an explicit value overrides the measured one
        p, source = a.rescue_probability, f"--rescue-probability (measured {p:.3g}: {source})"
    step, step_source = a.step_seconds, "--step-seconds"
    if step is None:
        step, step_source = m["productive_step_seconds"], "the run's mean productive seconds per step"
    # A measured step time only matters with a rescue: at p = 0 the output stays as it was.
    rescue = {"rescue_probability": p, "step_seconds": step if p > 0 else a.step_seconds}
    calc._rescue(**rescue)
    text = f"Rescue probability {p:.3g} from {source}"
    if p > 0:
        text += f"; a rescue loses one {step:.3g} s step ({step_source})"
    return rescue, source, text


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--save-stall-seconds", type=float, required=True, help="training paused per save")
    p.add_argument(
        "--restart-seconds", type=float, nargs="+", required=True, help="one or more restart costs"
    )
    _commit_arg(p)
    p.add_argument(
        "--afr", type=float, nargs="*", default=[], help="per-GPU failures per year, one row block each"
    )
    p.add_argument("--cluster-gpus", type=int, help="a measured cluster: its GPUs ...")
    p.add_argument("--cluster-mtbf-hours", type=float, help="... and its MTBF")
    p.add_argument("--cluster-interruptions-per-day", type=float, help="... or its interruptions per day")
    _sim_args(p)
    _json_flag(p)


def _plan(a: argparse.Namespace) -> Result:
    """One row per (failure rate, GPUs, restart cost): Young/Daly interval, closed form, simulated spread."""
    _check_sim(a)
    scenarios = [("afr", x, f"AFR {x:.3g}") for x in a.afr]
    if (
        _given(a, "cluster_gpus")
        or _given(a, "cluster_mtbf_hours")
        or _given(a, "cluster_interruptions_per_day")
    ):
        per_day = _given(a, "cluster_interruptions_per_day")
        what = f"{a.cluster_interruptions_per_day:g}/day" if per_day else f"MTBF {a.cluster_mtbf_hours:g} h"
        scenarios.append(("cluster", None, f"{what} at {a.cluster_gpus:,} GPUs"))
    if not scenarios:
        raise InputError("afr", "(or --cluster-gpus with its rate) is required")
    a.flag_for = {"restart_minutes": "restart_seconds"}
    rows = []
    for kind, afr, label in scenarios:
        for gpus in a.gpus:
            for restart_s in a.restart_seconds:
                calc._non_negative("restart_seconds", restart_s)
                only = {"afr": afr} if kind == "afr" else {"afr": None}
                if kind == "afr":  # this block's rate only: hide the cluster's
                    only |= dict.fromkeys(
                        ("cluster_gpus", "cluster_mtbf_hours", "cluster_interruptions_per_day")
                    )
                ns = argparse.Namespace(**{**vars(a), "gpus": gpus, **only})
                rate = _rate(ns)
                stall, restart = a.save_stall_seconds, restart_s / 60
                interval = _recommended(stall, rate, restart)
                s = _run_simulation(a, rate, interval, stall, restart, a.commit_delay_seconds)
                row = {"failure_rate": label, "gpus": gpus, "afr": rate.afr, "restart_seconds": restart_s}
                rows.append({**row, "mtbf_hours": rate.mtbf_hours, **{k: s[k] for k in _PLAN_KEYS}})
    # One line per (rate, GPUs); the restart costs side by side (the interval does not depend on them).
    head = ["failure rate", "GPUs", "job MTBF h", "failures / run", "interval min"]
    for restart_s in a.restart_seconds:
        r = f"restart {restart_s:g} s"
        head += [f"{r}: goodput mean (closed form)", "p10", "GPU-h lost mean / p90"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    per = len(a.restart_seconds)
    for i in range(0, len(rows), per):
        r = rows[i]
        cells = [r["failure_rate"], f"{r['gpus']:,}", f"{r['mtbf_hours']:.3g}", f"{r['failures_mean']:.3g}"]
        cells.append(f"{r['interval_minutes']:.2f}")
        for r in rows[i : i + per]:
            cells += [f"{r['goodput_mean']:.2%} ({r['closed_form_goodput']:.2%})", f"{r['goodput_p10']:.2%}"]
            cells.append(f"{r['lost_gpu_hours_mean']:,.0f} / {r['lost_gpu_hours_p90']:,.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    setup = (
        f"{a.days:g} days, {a.save_stall_seconds:g} s save stall, committed "
        f"{a.commit_delay_seconds:g} s later, Young/Daly interval, "
        f"{a.trials} simulated jobs per row (seed {a.seed})"
    )
    return {"rows": rows, "days": a.days, "save_stall_seconds": a.save_stall_seconds, "trials": a.trials,
            "seed": a.seed}, "\n".join([setup, "", *lines])  # fmt: skip


_PLAN_KEYS = ("interval_minutes", "failures_mean", "closed_form_goodput", "renewal_goodput", "goodput_mean",
              "goodput_p10", "goodput_p50", "goodput_p90", "lost_gpu_hours_mean", "lost_gpu_hours_p10",
              "lost_gpu_hours_p50", "lost_gpu_hours_p90")  # fmt: skip


def _tables_args(p: argparse.ArgumentParser) -> None:
    pass


def _tables(a: argparse.Namespace) -> Result:
    return None, calc.markdown(calc.article_tables()).rstrip("\n")


# name -> (help, add_arguments, run). A new subcommand is one more entry here.
SUBCOMMANDS: dict[str, Subcommand] = {
    "failure": ("probability of at least one failure", _failure_args, _failure),
    "goodput": ("goodput for a checkpoint interval", _goodput_args, _goodput),
    "optimal-interval": ("Young/Daly checkpoint interval", _optimal_args, _optimal),
    "simulate": ("Monte-Carlo spread of goodput and lost GPU-hours", _simulate_args, _simulate),
    "advise": ("interval and spread for a measured run at a given scale", _advise_args, _advise),
    "plan-table": ("markdown planning table over GPU counts and restart costs", _plan_args, _plan),
    "tables": ("print the article's tables as markdown", _tables_args, _tables),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="python -m goodput.calculator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    except InputError as e:
        # Argument names map one-to-one onto flags (gpus -> --gpus), so report the flag the user typed.
        name = getattr(args, "flag_for", {}).get(e.argument, e.argument)
        flag = name if name == "run" else f"--{name.replace('_', '-')}"
        subparsers[args.command].error(f"argument {flag}: {e.detail}")
    print(json.dumps(payload) if getattr(args, "json", False) else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
