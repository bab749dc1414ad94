"""Planning numbers for checkpointing at scale: failure odds, goodput, Young/Daly interval, simulation.

The closed forms here are stdlib only (the Monte-Carlo in `simulate.py` needs numpy, the CLI in
`cli.py` runs as `python -m goodput.calculator`). Time units are spelled out in every argument name
because mixing minutes, hours and seconds is the usual way these estimates go wrong.

Failure model shared by every function: GPUs fail independently, each at the same constant rate
`afr` (failures per GPU-year: a rate, so above 1 is allowed), and any GPU failure interrupts the
whole job. A job's failure rate is then proportional to its GPU count: `gpus * afr / 8760` per hour.

Rescue checkpoints: when a data-parallel job keeps a surviving replica, a surviving rank writes the
state of the last finished step without a collective. A fraction `rescue_probability` (p) of failures
then loses one step (`step_seconds`: the step in flight, counted whole, an upper bound) instead of the
work since the last save. p = 0 (the default) is a job without rescue.
"""

from __future__ import annotations

import math
from typing import Any

HOURS_PER_YEAR = 8760.0
DAYS_PER_YEAR = 365.0

# Inputs that reproduce the article's figures.
ARTICLE_AFR = 0.01
ARTICLE_DAYS = 30.0
ARTICLE_GPUS = (8, 64, 256, 1024, 4096)
ARTICLE_INTERRUPTIONS_PER_DAY = 8.6  # Llama 3 pre-training ...
ARTICLE_INTERRUPTIONS_GPUS = 16384  # ... on 16,384 H100s
ARTICLE_INTERVALS_MINUTES = (120.0, 60.0, 30.0, 15.0, 5.0)


class InputError(ValueError):
    """A ValueError that remembers which argument was bad, so the CLI can name its flag."""

    def __init__(self, argument: str, detail: str) -> None:
        super().__init__(f"{argument} {detail}")
        self.argument = argument
        self.detail = detail


def _number(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InputError(name, f"must be a finite number, got {value!r}")


def _positive(name: str, value: float) -> None:
    _number(name, value)
    if not value > 0:
        raise InputError(name, f"must be > 0, got {value}")


def _non_negative(name: str, value: float) -> None:
    _number(name, value)
    if not value >= 0:
        raise InputError(name, f"must be >= 0, got {value}")


def _count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(name, f"must be a whole number > 0, got {value!r}")


def _interval_fits(interval_minutes: float, save_stall_seconds: float) -> None:
    # The interval runs from one save's start to the next, stall included: no room for work otherwise.
    if not interval_minutes * 60 > save_stall_seconds:
        raise InputError(
            "interval_minutes",
            f"must be longer than the save stall: {interval_minutes:g} min = {interval_minutes * 60:g} s "
            f"<= {save_stall_seconds:g} s",
        )


def _commit_fits(interval_minutes: float, save_stall_seconds: float, commit_delay_seconds: float) -> None:
    # One save in flight: the next save starts after the previous one committed.
    _non_negative("commit_delay_seconds", commit_delay_seconds)
    if commit_delay_seconds > interval_minutes * 60 - save_stall_seconds:
        raise InputError(
            "commit_delay_seconds",
            f"must fit between saves: {commit_delay_seconds:g} s > the interval minus the stall "
            f"({interval_minutes * 60 - save_stall_seconds:g} s)",
        )


def _probability(name: str, value: float) -> None:
    _number(name, value)
    if not 0 <= value <= 1:
        raise InputError(name, f"must be between 0 and 1, got {value}")


def _rescue(rescue_probability: float, step_seconds: float | None) -> None:
    _probability("rescue_probability", rescue_probability)
    if step_seconds is not None:
        _positive("step_seconds", step_seconds)
    elif rescue_probability > 0:  # a rescue's loss is one step: without its length there is no estimate
        raise InputError(
            "step_seconds", f"is required with --rescue-probability > 0 (got {rescue_probability:g})"
        )


def _step_fits(interval_minutes: float, save_stall_seconds: float, step_seconds: float | None) -> None:
    # Saves come at step boundaries: an interval holds at least one step of work.
    if step_seconds is not None and step_seconds > interval_minutes * 60 - save_stall_seconds:
        raise InputError(
            "step_seconds",
            f"must fit in the interval: {step_seconds:g} s > the interval minus the stall "
            f"({interval_minutes * 60 - save_stall_seconds:g} s)",
        )


def _restart_fits(restart_minutes: float, mtbf_hours: float) -> None:
    # A restart that outlasts the mean time between failures would mostly be interrupted itself.
    if restart_minutes / 60 >= mtbf_hours:
        raise InputError(
            "restart_minutes",
            f"must be shorter than the job's MTBF: {restart_minutes:g} min >= {mtbf_hours * 60:.4g} min",
        )


def afr_from_cluster(cluster_gpus: int, cluster_mtbf_hours: float) -> float:
    """Failures per GPU-year from a cluster's measured MTBF: 8760 / (cluster_gpus * cluster_mtbf_hours).

    Assumes the cluster's GPUs fail independently at one rate each, so the cluster's rate is their sum.
    """
    _count("cluster_gpus", cluster_gpus)
    _positive("cluster_mtbf_hours", cluster_mtbf_hours)
    return HOURS_PER_YEAR / (cluster_gpus * cluster_mtbf_hours)


def afr_from_interruptions(cluster_gpus: int, cluster_interruptions_per_day: float) -> float:
    """Failures per GPU-year from a cluster's interruptions per day: that * 365 / cluster_gpus."""
    _count("cluster_gpus", cluster_gpus)
    _positive("cluster_interruptions_per_day", cluster_interruptions_per_day)
    return cluster_interruptions_per_day * DAYS_PER_YEAR / cluster_gpus


def failure_probability(gpus: int, days: float, afr: float) -> float:
    """P(at least one failure) = 1 - exp(-gpus * afr * days / 365)."""
    _count("gpus", gpus)
    _non_negative("days", days)
    _non_negative("afr", afr)
    return -math.expm1(-gpus * afr * days / DAYS_PER_YEAR)


def mtbf_hours_from_afr(gpus: int, afr: float) -> float:
    """The job's mean time between failures in hours = 8760 / (gpus * afr)."""
    _count("gpus", gpus)
    _positive("afr", afr)  # afr == 0 means no failures: MTBF is infinite
    return HOURS_PER_YEAR / (gpus * afr)


def interruptions_per_day_from_afr(gpus: int, afr: float) -> float:
    """Expected interruptions per day = gpus * afr / 365."""
    _count("gpus", gpus)
    _non_negative("afr", afr)
    return gpus * afr / DAYS_PER_YEAR


def lost_work_per_failure_seconds(
    interval_minutes: float,
    commit_delay_seconds: float = 0.0,
    rescue_probability: float = 0.0,
    step_seconds: float | None = None,
) -> float:
    """Work redone per failure, first order: (1 - p) * (M*60/2 + D) + p * step_seconds.

    Without a rescue a failure lands uniformly inside an interval, so half an interval is redone,
    plus D (a failure in the D seconds after a stall falls back to the save before); a rescued one
    (probability p) loses one step and no commit delay: the rescue holds the newer state.
    """
    regular = interval_minutes * 60 / 2 + commit_delay_seconds
    if rescue_probability == 0:
        return regular
    return (1 - rescue_probability) * regular + rescue_probability * step_seconds


def goodput(
    interruptions_per_day: float,
    interval_minutes: float,
    save_stall_seconds: float = 0.0,
    restart_minutes: float = 0.0,
    commit_delay_seconds: float = 0.0,
    *,
    rescue_probability: float = 0.0,
    step_seconds: float | None = None,
) -> dict[str, float]:
    """First-order goodput = 1 - (R*L/3600 + R*T/60 + (1440/M)*C/3600) / 24, clamped at 0.

    R interruptions/day, M minutes from one save's start to the next, C seconds of stall per save,
    T minutes per restart, D seconds from the end of a stall until that save is committed (an async
    upload), L = `lost_work_per_failure_seconds` (M*60/2 + D without rescue). Exact only while
    failures are rare within an interval (R*M << 1440); `renewal_goodput` is exact for D = 0, p = 0.
    """
    _non_negative("interruptions_per_day", interruptions_per_day)
    _positive("interval_minutes", interval_minutes)
    _non_negative("save_stall_seconds", save_stall_seconds)
    _non_negative("restart_minutes", restart_minutes)
    _rescue(rescue_probability, step_seconds)
    _interval_fits(interval_minutes, save_stall_seconds)
    _commit_fits(interval_minutes, save_stall_seconds, commit_delay_seconds)
    _step_fits(interval_minutes, save_stall_seconds, step_seconds)
    if interruptions_per_day > 0:
        _restart_fits(restart_minutes, 24 / interruptions_per_day)
    per_failure = lost_work_per_failure_seconds(
        interval_minutes, commit_delay_seconds, rescue_probability, step_seconds
    )
    lost = interruptions_per_day * per_failure / 3600
    restart = interruptions_per_day * restart_minutes / 60
    stall = (1440 / interval_minutes) * save_stall_seconds / 3600
    return {
        "goodput": max(0.0, 1.0 - (lost + restart + stall) / 24),
        "lost_hours_per_day": lost,
        "restart_hours_per_day": restart,
        "stall_hours_per_day": stall,
    }


def renewal_goodput(
    interruptions_per_day: float,
    interval_minutes: float,
    save_stall_seconds: float = 0.0,
    restart_minutes: float = 0.0,
) -> float:
    """Exact long-run goodput for Poisson failures (the model `simulate` draws from, with shape 1).

    Work comes in segments of a = M minutes (w = a - C of compute, then a C-second save that commits
    at its end). A failure at any time (computing, saving, restarting) loses everything since the last
    completed save, then a restart of T minutes that a further failure starts over. With rate lam,
    the expected wall time per completed segment is exp(lam*T) * (exp(lam*a) - 1) / lam (Daly 2006),
    so goodput = w * lam * exp(-lam*T) / (exp(lam*a) - 1). Its first-order expansion is `goodput`.
    """
    _non_negative("interruptions_per_day", interruptions_per_day)
    _positive("interval_minutes", interval_minutes)
    _non_negative("save_stall_seconds", save_stall_seconds)
    _non_negative("restart_minutes", restart_minutes)
    _interval_fits(interval_minutes, save_stall_seconds)
    a = interval_minutes * 60
    work = a - save_stall_seconds
    if interruptions_per_day == 0:
        return work / a
    _restart_fits(restart_minutes, 24 / interruptions_per_day)
    lam = interruptions_per_day / 86400
    return work * lam * math.exp(-lam * restart_minutes * 60) / math.expm1(lam * a)


def optimal_interval(
    save_stall_seconds: float,
    mtbf_hours: float,
    restart_minutes: float = 0.0,
    commit_delay_seconds: float = 0.0,
    *,
    rescue_probability: float = 0.0,
    step_seconds: float | None = None,
) -> dict[str, Any]:
    """Young/Daly: T = sqrt(2*C*MTBF / (1 - p)); goodput = 1 - C/T - (L(T) + restart)/MTBF, in [0, 1].

    L(T) = `lost_work_per_failure_seconds`: only the (1 - p) unrescued failures pay half an interval,
    so the optimum grows by 1/sqrt(1 - p). A commit delay D, and a rescue's one step, cost the same per
    failure at any interval, so they do not move it. At p = 1 failures set no interval (every one
    costs a step however rarely the job saves): `interval_minutes` is None, `note` says why, and the
    goodput is the limit of no save stall.
    """
    _non_negative("save_stall_seconds", save_stall_seconds)
    _positive("mtbf_hours", mtbf_hours)
    _non_negative("restart_minutes", restart_minutes)
    _non_negative("commit_delay_seconds", commit_delay_seconds)
    _rescue(rescue_probability, step_seconds)
    _restart_fits(restart_minutes, mtbf_hours)
    # Work in seconds throughout so C, T and MTBF share a unit.
    c = save_stall_seconds
    mtbf = mtbf_hours * 3600
    restart = restart_minutes * 60
    if rescue_probability == 1:
        g = 1.0 - (step_seconds + restart) / mtbf
        note = "every failure is rescued (p = 1) and loses one step at any interval"
        return {"interval_minutes": None, "goodput": min(1.0, max(0.0, g)), "note": note}
    t = math.sqrt(2 * c * mtbf / (1 - rescue_probability))
    stall_fraction = c / t if t > 0 else 0.0  # free checkpoints: save continuously, lose nothing
    lost = lost_work_per_failure_seconds(t / 60, commit_delay_seconds, rescue_probability, step_seconds)
    g = 1.0 - stall_fraction - (lost + restart) / mtbf
    return {"interval_minutes": t / 60, "goodput": min(1.0, max(0.0, g))}


def article_tables() -> dict[str, dict[str, Any]]:
    """Rows reproducing the article: failure odds over 30 days at 1% AFR, goodput at 8.6 interruptions/day."""
    failure_rows = [[n, failure_probability(n, ARTICLE_DAYS, ARTICLE_AFR)] for n in ARTICLE_GPUS]
    goodput_rows = []
    for m in ARTICLE_INTERVALS_MINUTES:
        r = goodput(ARTICLE_INTERRUPTIONS_PER_DAY, m)
        goodput_rows.append([m, r["lost_hours_per_day"], r["goodput"]])
    return {
        "failure_probability": {
            "title": f"P(at least one failure) over {ARTICLE_DAYS:g} days at {ARTICLE_AFR:.0%} AFR",
            "columns": ["gpus", "probability"],
            "rows": failure_rows,
        },
        "goodput": {
            "title": f"Goodput at {ARTICLE_INTERRUPTIONS_PER_DAY:g} interruptions/day (free saves, restarts)",
            "columns": ["interval_minutes", "lost_hours_per_day", "goodput"],
            "rows": goodput_rows,
        },
    }


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}" if value.is_integer() else f"{value:.3f}"
    return str(value)


def markdown(tables: dict[str, dict[str, Any]]) -> str:
    """Render `article_tables()`-shaped tables as markdown, one titled table per entry."""
    blocks = []
    for table in tables.values():
        lines = [f"### {table['title']}", "", "| " + " | ".join(table["columns"]) + " |"]
        lines.append("|" + "---|" * len(table["columns"]))
        lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in table["rows"]]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"
