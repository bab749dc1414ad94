"""Back-of-envelope numbers for checkpointing at scale: failure odds, goodput, Young/Daly interval.

Stdlib only so the CLI and tests run without torch. Time units are spelled out in every argument name
because mixing minutes, hours and seconds is the usual way these estimates go wrong.
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
ARTICLE_INTERRUPTIONS_PER_DAY = 8.6
ARTICLE_INTERVALS_MINUTES = (120.0, 60.0, 30.0, 15.0, 5.0)


class InputError(ValueError):
    """A ValueError that remembers which argument was bad, so the CLI can name its flag."""

    def __init__(self, argument: str, detail: str) -> None:
        super().__init__(f"{argument} {detail}")
        self.argument = argument
        self.detail = detail


def _positive(name: str, value: float) -> None:
    # `not value > 0` also rejects NaN.
    if not value > 0:
        raise InputError(name, f"must be > 0, got {value}")


def _non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise InputError(name, f"must be >= 0, got {value}")


def _fraction(name: str, value: float) -> None:
    if not 0 <= value <= 1:
        raise InputError(name, f"must be in [0, 1], got {value}")


def failure_probability(gpus: int, days: float, afr: float) -> float:
    """P(at least one failure) = 1 - exp(-gpus * afr * days / 365)."""
    _positive("gpus", gpus)
    _non_negative("days", days)
    _fraction("afr", afr)
    return 1.0 - math.exp(-gpus * afr * days / DAYS_PER_YEAR)


def mtbf_hours_from_afr(gpus: int, afr: float) -> float:
    """Cluster MTBF in hours = 8760 / (gpus * afr)."""
    _positive("gpus", gpus)
    _fraction("afr", afr)
    _positive("afr", afr)  # afr == 0 means no failures: MTBF is infinite
    return HOURS_PER_YEAR / (gpus * afr)


def interruptions_per_day_from_afr(gpus: int, afr: float) -> float:
    """Expected interruptions per day = gpus * afr / 365."""
    _positive("gpus", gpus)
    _fraction("afr", afr)
    return gpus * afr / DAYS_PER_YEAR


def goodput(
    interruptions_per_day: float,
    interval_minutes: float,
    save_stall_seconds: float = 0.0,
    restart_minutes: float = 0.0,
) -> dict[str, float]:
    """goodput = 1 - (R*M/2/60 + R*T/60 + (1440/M)*C/3600) / 24, clamped at 0."""
    _non_negative("interruptions_per_day", interruptions_per_day)
    _positive("interval_minutes", interval_minutes)
    _non_negative("save_stall_seconds", save_stall_seconds)
    _non_negative("restart_minutes", restart_minutes)
    # A failure lands uniformly inside an interval, so on average half an interval of work is redone.
    lost = interruptions_per_day * interval_minutes / 2 / 60
    restart = interruptions_per_day * restart_minutes / 60
    stall = (1440 / interval_minutes) * save_stall_seconds / 3600
    return {
        "goodput": max(0.0, 1.0 - (lost + restart + stall) / 24),
        "lost_hours_per_day": lost,
        "restart_hours_per_day": restart,
        "stall_hours_per_day": stall,
    }


def optimal_interval(
    save_stall_seconds: float, mtbf_hours: float, restart_minutes: float = 0.0
) -> dict[str, float]:
    """Young/Daly: T = sqrt(2*C*MTBF); goodput = 1 - C/T - T/(2*MTBF) - restart/MTBF, clamped to [0, 1]."""
    _non_negative("save_stall_seconds", save_stall_seconds)
    _positive("mtbf_hours", mtbf_hours)
    _non_negative("restart_minutes", restart_minutes)
    # Work in seconds throughout so C, T and MTBF share a unit.
    c = save_stall_seconds
    mtbf = mtbf_hours * 3600
    t = math.sqrt(2 * c * mtbf)
    stall_fraction = c / t if t > 0 else 0.0  # free checkpoints: save continuously, lose nothing
    g = 1.0 - stall_fraction - t / (2 * mtbf) - restart_minutes * 60 / mtbf
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
