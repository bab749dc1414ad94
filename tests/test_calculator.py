"""Calculator numbers against the article's figures, plus the CLI end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from goodput import calculator
from goodput.calculator import (
    failure_probability,
    goodput,
    interruptions_per_day_from_afr,
    mtbf_hours_from_afr,
    optimal_interval,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("gpus", "expected"), [(256, 0.19), (1024, 0.57)])
def test_article_failure_probability(gpus: int, expected: float) -> None:
    assert failure_probability(gpus, 30, 0.01) == pytest.approx(expected, abs=0.005)


@pytest.mark.parametrize(
    ("interval", "expected_goodput", "expected_lost"), [(120, 0.64, 8.6), (30, 0.91, 2.15)]
)
def test_article_goodput(interval: float, expected_goodput: float, expected_lost: float) -> None:
    r = goodput(8.6, interval)
    assert r["goodput"] == pytest.approx(expected_goodput, abs=0.01)
    assert r["lost_hours_per_day"] == pytest.approx(expected_lost)
    assert r["restart_hours_per_day"] == 0 and r["stall_hours_per_day"] == 0


def test_goodput_costs_add_up() -> None:
    # 10 saves/day of 36 s = 0.1 h stall; 2 restarts of 30 min = 1 h; 2 * 144 / 2 min lost = 2.4 h.
    r = goodput(2, 144, save_stall_seconds=36, restart_minutes=30)
    assert r["stall_hours_per_day"] == pytest.approx(0.1)
    assert r["restart_hours_per_day"] == pytest.approx(1.0)
    assert r["lost_hours_per_day"] == pytest.approx(2.4)
    assert r["goodput"] == pytest.approx(1 - 3.5 / 24)


def test_goodput_clamped_at_zero() -> None:
    assert goodput(100, 600)["goodput"] == 0.0


def test_young_daly() -> None:
    r = optimal_interval(2, 24)
    assert r["interval_minutes"] == pytest.approx(math.sqrt(2 * 2 * 86400) / 60)
    assert r["interval_minutes"] == pytest.approx(9.8, abs=0.05)
    t = r["interval_minutes"] * 60
    assert r["goodput"] == pytest.approx(1 - 2 / t - t / (2 * 86400))


def test_young_daly_is_the_optimum() -> None:
    # The Young/Daly interval should beat nearby intervals under the same first-order model.
    c, mtbf_h = 5.0, 12.0
    best = optimal_interval(c, mtbf_h)
    for factor in (0.5, 0.8, 1.25, 2.0):
        m = best["interval_minutes"] * factor
        r = goodput(24 / mtbf_h, m, save_stall_seconds=c)
        assert r["goodput"] < best["goodput"]


def test_young_daly_edge_cases() -> None:
    assert optimal_interval(0, 24) == {"interval_minutes": 0.0, "goodput": 1.0}
    assert optimal_interval(2, 24, restart_minutes=60)["goodput"] < optimal_interval(2, 24)["goodput"]
    assert optimal_interval(3600, 0.5)["goodput"] == 0.0


def test_afr_conversions() -> None:
    assert mtbf_hours_from_afr(1024, 0.01) == pytest.approx(8760 / 10.24)
    assert interruptions_per_day_from_afr(1024, 0.01) == pytest.approx(10.24 / 365)
    # One interruption per MTBF: the two views must agree.
    assert interruptions_per_day_from_afr(256, 0.02) * mtbf_hours_from_afr(256, 0.02) == pytest.approx(24)


def test_shorter_interval_loses_less_work() -> None:
    lost = [goodput(8.6, m)["lost_hours_per_day"] for m in (120, 60, 30, 15, 5)]
    assert lost == sorted(lost, reverse=True) and len(set(lost)) == len(lost)


def test_larger_stall_lowers_goodput() -> None:
    values = [goodput(8.6, 30, save_stall_seconds=c)["goodput"] for c in (0, 1, 10, 60)]
    assert values == sorted(values, reverse=True) and len(set(values)) == len(values)
    yd = [optimal_interval(c, 24)["goodput"] for c in (1, 10, 60)]
    assert yd == sorted(yd, reverse=True)


def test_more_gpus_fail_more() -> None:
    p = [failure_probability(n, 30, 0.01) for n in (8, 64, 256, 1024, 4096)]
    assert p == sorted(p) and p[0] > 0 and p[-1] < 1
    assert failure_probability(1024, 0, 0.01) == 0.0


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: failure_probability(0, 30, 0.01), "gpus"),
        (lambda: failure_probability(8, -1, 0.01), "days"),
        (lambda: failure_probability(8, 30, 1.5), "afr"),
        (lambda: failure_probability(8, 30, -0.1), "afr"),
        (lambda: goodput(-1, 30), "interruptions_per_day"),
        (lambda: goodput(8.6, 0), "interval_minutes"),
        (lambda: goodput(8.6, 30, save_stall_seconds=-1), "save_stall_seconds"),
        (lambda: goodput(8.6, 30, restart_minutes=-1), "restart_minutes"),
        (lambda: optimal_interval(-1, 24), "save_stall_seconds"),
        (lambda: optimal_interval(2, 0), "mtbf_hours"),
        (lambda: optimal_interval(2, float("nan")), "mtbf_hours"),
        (lambda: mtbf_hours_from_afr(8, 0), "afr"),
        (lambda: interruptions_per_day_from_afr(-8, 0.01), "gpus"),
    ],
)
def test_invalid_input_names_the_argument(call, argument: str) -> None:
    with pytest.raises(ValueError, match=f"^{argument} "):
        call()


def test_article_tables_and_markdown() -> None:
    tables = calculator.article_tables()
    failure = dict(tables["failure_probability"]["rows"])
    assert {8, 64, 256, 1024, 4096} <= failure.keys()
    assert failure[256] == pytest.approx(0.19, abs=0.005)
    rows = {row[0]: row for row in tables["goodput"]["rows"]}
    assert set(rows) == {120, 60, 30, 15, 5}
    assert rows[120][-1] == pytest.approx(0.64, abs=0.01)
    md = calculator.markdown(tables)
    assert "| gpus | probability |" in md and "| 1024 | 0.569 |" in md and "| 30 | 2.150 | 0.910 |" in md


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT / "src"), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "scripts/goodput.py", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )


def test_cli_failure_json() -> None:
    out = run_cli("failure", "--gpus", "256", "--days", "30", "--afr", "0.01", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"probability": pytest.approx(0.19, abs=0.005)}


def test_cli_goodput_json() -> None:
    out = run_cli("goodput", "--interruptions-per-day", "8.6", "--interval-minutes", "120", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == goodput(8.6, 120)


def test_cli_optimal_interval_json() -> None:
    out = run_cli("optimal-interval", "--save-stall-seconds", "2", "--mtbf-hours", "24", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == optimal_interval(2, 24)


def test_cli_human_and_tables() -> None:
    out = run_cli("goodput", "--interruptions-per-day", "8.6", "--interval-minutes", "30")
    assert out.returncode == 0 and len(out.stdout.strip().splitlines()) == 1 and "91.0%" in out.stdout
    out = run_cli("tables")
    assert out.returncode == 0 and out.stdout == calculator.markdown(calculator.article_tables())


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["failure", "--gpus", "0", "--days", "30", "--afr", "0.01", "--json"], "--gpus"),
        (["failure", "--gpus", "8", "--days", "30", "--afr", "2", "--json"], "--afr"),
        (
            ["goodput", "--interruptions-per-day", "8.6", "--interval-minutes", "-5", "--json"],
            "--interval-minutes",
        ),
        (["optimal-interval", "--save-stall-seconds", "-2", "--mtbf-hours", "24"], "--save-stall-seconds"),
        (["optimal-interval", "--save-stall-seconds", "2", "--mtbf-hours", "0", "--json"], "--mtbf-hours"),
    ],
)
def test_cli_bad_input_exits_2(args: list[str], flag: str) -> None:
    out = run_cli(*args)
    assert out.returncode == 2
    assert f"argument {flag}" in out.stderr and out.stdout == ""
