"""Calculator: the article's figures, AFR as a rate, the Monte-Carlo against the closed forms, the CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tomllib
from importlib import import_module

import numpy as np
import pytest
from helpers import REPO

from goodput import calculator
from goodput.calculator import (
    afr_from_cluster,
    afr_from_interruptions,
    failure_probability,
    goodput,
    interruptions_per_day_from_afr,
    mtbf_hours_from_afr,
    optimal_interval,
    renewal_goodput,
)
from goodput.calculator.advise import restart_cost
from goodput.calculator.cli import main
from goodput.calculator.simulate import simulate


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
        (lambda: failure_probability(8, 30, -0.1), "afr"),
        (lambda: failure_probability(8, 30, float("nan")), "afr"),
        (lambda: failure_probability(8, 30, float("inf")), "afr"),
        (lambda: failure_probability(8.5, 30, 0.01), "gpus"),
        (lambda: goodput(-1, 30), "interruptions_per_day"),
        (lambda: goodput(8.6, 0), "interval_minutes"),
        (lambda: goodput(8.6, 30, save_stall_seconds=-1), "save_stall_seconds"),
        (lambda: goodput(8.6, 30, restart_minutes=-1), "restart_minutes"),
        (lambda: optimal_interval(-1, 24), "save_stall_seconds"),
        (lambda: optimal_interval(2, 0), "mtbf_hours"),
        (lambda: optimal_interval(2, float("nan")), "mtbf_hours"),
        (lambda: mtbf_hours_from_afr(8, 0), "afr"),
        (lambda: interruptions_per_day_from_afr(-8, 0.01), "gpus"),
        (lambda: goodput(8.6, 0.01, save_stall_seconds=1), "interval_minutes"),  # 0.6 s < 1 s stall
        (lambda: goodput(8.6, 1, save_stall_seconds=60), "interval_minutes"),  # no room for work
        (lambda: goodput(48, 30, restart_minutes=30), "restart_minutes"),  # restart = MTBF
        (lambda: renewal_goodput(8.6, 1, save_stall_seconds=60), "interval_minutes"),
        (lambda: optimal_interval(2, 1, restart_minutes=90), "restart_minutes"),
        (lambda: afr_from_cluster(0, 1.9), "cluster_gpus"),
        (lambda: afr_from_cluster(608, float("nan")), "cluster_mtbf_hours"),
        (lambda: afr_from_interruptions(16384, -1), "cluster_interruptions_per_day"),
        (lambda: simulate(8.6, 30, trials=0), "trials"),
        (lambda: simulate(8.6, 30, days=0), "days"),
        (lambda: simulate(8.6, 30, gpus=0), "gpus"),
        (lambda: simulate(8.6, 30, weibull_shape=float("nan")), "weibull_shape"),
        (lambda: simulate(8.6, 0.5, save_stall_seconds=30), "interval_minutes"),
        (lambda: simulate(8.6, 30, restart_minutes=200), "restart_minutes"),
        (lambda: simulate(3456, 0.1, trials=10_000), "trials"),  # ~1e9 draws: refuse rather than crawl
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


def test_afr_is_a_rate_and_a_cluster_mtbf_converts_to_it() -> None:
    # The article's 608-GPU H100 system failing every 1.9 h: 7.6 failures per GPU-year, far above 1.
    afr = afr_from_cluster(608, 1.9)
    assert afr == pytest.approx(8760 / (608 * 1.9)) and afr > 1
    # Same GPUs, same rate: the job's MTTF is the cluster's; scaled by GPU count elsewhere.
    assert mtbf_hours_from_afr(608, afr) == pytest.approx(1.9)
    assert mtbf_hours_from_afr(4096, afr) == pytest.approx(1.9 * 608 / 4096)
    assert failure_probability(608, 1.9 / 24, afr) == pytest.approx(1 - math.exp(-1))
    # Llama 3: 8.6 interruptions/day at 16,384 GPUs is a 19 % AFR; at 4,096 GPUs a quarter of the rate.
    llama = afr_from_interruptions(16384, 8.6)
    assert llama == pytest.approx(8.6 * 365 / 16384)
    assert interruptions_per_day_from_afr(4096, llama) == pytest.approx(8.6 / 4)


def run_json(capsys, *args: str) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_cluster_mtbf_gives_the_same_job_mttf_as_the_equivalent_afr(capsys) -> None:
    cluster = run_json(capsys, "failure", "--gpus", "4096", "--days", "1", "--cluster-gpus", "608",
                       "--cluster-mtbf-hours", "1.9")  # fmt: skip
    same = run_json(
        capsys, "failure", "--gpus", "4096", "--days", "1", "--afr", str(afr_from_cluster(608, 1.9))
    )
    assert cluster["mtbf_hours"] == pytest.approx(1.9 * 608 / 4096) == pytest.approx(same["mtbf_hours"])
    assert cluster["probability"] == pytest.approx(same["probability"])
    assert cluster["afr"] == pytest.approx(same["afr"]) and cluster["cluster_mtbf_hours"] == 1.9
    per_day = run_json(capsys, "optimal-interval", "--save-stall-seconds", "1", "--gpus", "4096",
                       "--cluster-gpus", "16384", "--cluster-interruptions-per-day", "8.6")  # fmt: skip
    assert per_day["mtbf_hours"] == pytest.approx(24 / (8.6 / 4))
    assert per_day["interval_minutes"] == pytest.approx(optimal_interval(1, 24 / 2.15)["interval_minutes"])


def test_cli_prints_the_derivation(capsys) -> None:
    assert main(["failure", "--gpus", "4096", "--days", "30", "--cluster-gpus", "608",
                 "--cluster-mtbf-hours", "1.9"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "7.583 failures per GPU-year" in out and "independently" in out
    assert "one every 0.282 h (the job's MTTF)" in out


def test_renewal_goodput_is_the_exact_form_of_the_first_order_one() -> None:
    assert renewal_goodput(0, 10, save_stall_seconds=6) == pytest.approx(0.99)
    # Rare failures within an interval: the two agree; frequent ones: first order is pessimistic.
    assert renewal_goodput(1, 5, 1, 1) == pytest.approx(goodput(1, 5, 1, 1)["goodput"], abs=1e-4)
    assert renewal_goodput(8.6, 120) == pytest.approx(0.684, abs=0.001)
    assert renewal_goodput(8.6, 120) > goodput(8.6, 120)["goodput"] + 0.04


@pytest.mark.parametrize("args", [(8.6, 15, 0, 0), (8.6, 5, 1, 1), (2, 30, 10, 5)])
def test_simulation_mean_matches_the_closed_form(args) -> None:
    r = simulate(*args, trials=2000, seed=1)
    # Failures rare within an interval (8.6/day at 15 min: 9 %): first order within a point ...
    assert abs(r["goodput_mean"] - r["closed_form_goodput"]) < 0.01
    # ... and the exact renewal form within sampling error (mean of a 30-day window vs the long run).
    assert abs(r["renewal_difference"]) < 4 * r["goodput_sem"] + 2e-4
    assert r["goodput_p10"] <= r["goodput_p50"] <= r["goodput_p90"]
    assert r["lost_gpu_hours_p10"] <= r["lost_gpu_hours_mean"] * 1.5


def test_simulation_matches_the_exact_form_where_first_order_is_off() -> None:
    # 100 failures/day, 5 min intervals, 1 s saves, 2 min restarts (failures hit restarts too).
    r = simulate(100, 5, 1, 2, trials=1000, seed=2)
    assert r["closed_form_difference"] > 0.03  # the first-order form is 4 points pessimistic here
    assert abs(r["renewal_difference"]) < 4 * r["goodput_sem"] + 2e-4
    # Where the time went adds up to the window: compute that survives + redone + restarting + saving.
    accounted = (
        r["goodput_mean"] * 24 * 30 + r["redone_hours_mean"] + r["restart_hours_mean"] + r["stall_hours_mean"]
    )
    assert accounted == pytest.approx(24 * 30)
    assert r["failures_mean"] == pytest.approx(100 * 30, rel=0.01)


def test_a_late_commit_costs_its_delay_per_failure() -> None:
    # An async save commits after its upload: a failure in that window reaches back one more save.
    r = goodput(8.6, 30, save_stall_seconds=0.1, commit_delay_seconds=36)
    assert r["lost_hours_per_day"] == pytest.approx(8.6 * (15 + 0.6) / 60)
    late = simulate(8.6, 5, 0.1, 0.15, commit_delay_seconds=8, trials=2000, seed=5)
    now = simulate(8.6, 5, 0.1, 0.15, trials=2000, seed=5)  # same seed: the same failure times
    extra = late["redone_hours_mean"] - now["redone_hours_mean"]
    assert extra == pytest.approx(now["failures_mean"] * 8 / 3600, rel=0.05)
    assert abs(late["closed_form_difference"]) < 0.001 and late["renewal_goodput"] is None
    assert optimal_interval(0.1, 24, commit_delay_seconds=8)["interval_minutes"] == pytest.approx(
        optimal_interval(0.1, 24)["interval_minutes"]
    )


def test_simulation_without_failures_pays_only_the_stall() -> None:
    r = simulate(0, 10, save_stall_seconds=6, days=1, gpus=8, trials=5)
    assert r["goodput_mean"] == r["goodput_p10"] == pytest.approx(0.99)
    assert r["lost_gpu_hours_mean"] == pytest.approx(8 * 24 * 0.01)


def test_simulation_spread_shrinks_with_more_trials() -> None:
    def spread(trials: int) -> float:
        return float(np.std([simulate(8.6, 30, trials=trials, seed=s)["goodput_mean"] for s in range(8)]))

    small, large = spread(100), spread(1600)
    assert large < small / 2  # 16x the trials: ~1/4 the spread of the mean across seeds
    assert simulate(8.6, 30, trials=1600)["goodput_sem"] < simulate(8.6, 30, trials=100)["goodput_sem"] / 2


def test_simulation_is_seeded_and_weibull_shape_matters() -> None:
    assert simulate(8.6, 30, trials=200, seed=3) == simulate(8.6, 30, trials=200, seed=3)
    assert simulate(8.6, 30, trials=200, seed=3) != simulate(8.6, 30, trials=200, seed=4)
    exponential = simulate(8.6, 30, trials=200, weibull_shape=1)
    assert exponential == {**simulate(8.6, 30, trials=200), "weibull_shape": 1}
    bursty = simulate(8.6, 30, trials=2000, weibull_shape=0.5)
    poisson = simulate(8.6, 30, trials=2000)
    assert bursty["failures_mean"] == pytest.approx(poisson["failures_mean"], rel=0.05)  # same mean rate
    assert bursty["goodput_std"] > 1.3 * poisson["goodput_std"]  # clustered failures: wider spread


def test_restart_cost_from_the_ledger_and_the_attempt_records() -> None:
    m = {"goodput/restarts": 2, "goodput/startup_seconds": 9.0, "goodput/lost_seconds": 30.0}
    m |= {"goodput/lost_steps": 20, "goodput/productive_seconds": 100.0}
    r = restart_cost(m, steps=200)  # a step computes 0.5 s; 20 redone = 10 s; (30 - 10) / 2 restarts
    assert r["restart_seconds"] == r["restart_seconds_ledger"] == pytest.approx(10)
    assert r["restart_source"].startswith("ledger: (lost_seconds")
    # A hang's detection time (booked as hung) is part of the restart cost: 2 hangs of 3 s each.
    r = restart_cost(m | {"goodput/hung_seconds": 6.0}, steps=200)
    assert r["restart_seconds"] == pytest.approx(13) and r["hung_seconds"] == 6.0
    r = restart_cost({"goodput/restarts": 0, "goodput/startup_seconds": 4.0}, steps=200)
    assert r["restart_seconds"] == 4.0 and "no restarts" in r["restart_source"]
    # With the heartbeat records: last sign of life of each crashed attempt to the next one's start.
    records = [{"attempt": 0, "start": 0.0, "last_seen": 100.0}, {"attempt": 1, "start": 121.0}]
    records[1]["last_seen"] = 150.0
    records.append({"attempt": 2, "start": 165.0})
    r = restart_cost(m, steps=200, records=records)
    assert r["restart_seconds"] == r["restart_seconds_attempts"] == pytest.approx((21 + 15) / 2)
    assert r["restart_seconds_ledger"] == pytest.approx(10) and "attempt records" in r["restart_source"]


def test_cli_json_keys(capsys) -> None:
    r = run_json(capsys, "failure", "--gpus", "256", "--days", "30", "--afr", "0.01")
    assert r["probability"] == pytest.approx(0.19, abs=0.005)
    r = run_json(capsys, "goodput", "--interruptions-per-day", "8.6", "--interval-minutes", "120")
    assert {k: r[k] for k in goodput(8.6, 120)} == goodput(8.6, 120) and "renewal_goodput" in r
    r = run_json(capsys, "optimal-interval", "--save-stall-seconds", "2", "--mtbf-hours", "24")
    assert r["interval_minutes"] == optimal_interval(2, 24)["interval_minutes"]
    r = run_json(capsys, "simulate", "--gpus", "4096", "--afr", "0.01", "--save-stall-seconds", "0.1",
                 "--restart-seconds", "9", "--trials", "500")  # fmt: skip
    keys = {"goodput_mean", "goodput_p10", "goodput_p50", "goodput_p90", "lost_gpu_hours_mean",
            "closed_form_goodput", "renewal_goodput", "mtbf_hours", "interval_minutes"}  # fmt: skip
    assert keys <= r.keys() and r["restart_seconds"] == 9 and r["gpus"] == 4096
    yd = optimal_interval(0.1, mtbf_hours_from_afr(4096, 0.01), 9 / 60)["interval_minutes"]
    assert r["interval_minutes"] == pytest.approx(yd)  # no --interval-minutes: Young/Daly's


def test_cli_plan_table(capsys) -> None:
    args = [
        "plan-table",
        "--gpus",
        "1024",
        "4096",
        "--save-stall-seconds",
        "0.1",
        "--restart-seconds",
        "9",
        "2",
        "--afr",
        "0.01",
    ]
    args += ["--cluster-gpus", "16384", "--cluster-interruptions-per-day", "8.6", "--trials", "200"]
    r = run_json(capsys, *args)
    assert len(r["rows"]) == 2 * 2 * 2
    llama_4k = [x for x in r["rows"] if x["gpus"] == 4096 and x["afr"] > 0.1]
    assert llama_4k[0]["mtbf_hours"] == pytest.approx(24 / 2.15)
    assert main(args) == 0
    table = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("| ") for line in table) == 1 + 4 and "| AFR 0.01 | 1,024 |" in table[4]
    assert "restart 9 s: goodput mean (closed form)" in table[2] and table[2].count("GPU-h lost") == 2


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["failure", "--gpus", "0", "--days", "30", "--afr", "0.01"], "--gpus"),
        (["failure", "--gpus", "8", "--days", "30", "--afr", "nan"], "--afr"),
        (["failure", "--gpus", "8", "--days", "30", "--afr", "-1"], "--afr"),
        (["failure", "--days", "30", "--afr", "0.01"], "--gpus"),
        (["failure", "--gpus", "8", "--days", "30", "--cluster-gpus", "608"], "--cluster-mtbf-hours"),
        (["failure", "--gpus", "8", "--days", "30", "--cluster-mtbf-hours", "2"], "--cluster-gpus"),
        (
            ["failure", "--gpus", "8", "--days", "30", "--cluster-gpus", "0", "--cluster-mtbf-hours", "2"],
            "--cluster-gpus",
        ),  # fmt: skip
        (["goodput", "--interruptions-per-day", "8.6", "--interval-minutes", "-5"], "--interval-minutes"),
        (
            [
                "goodput",
                "--interruptions-per-day",
                "8.6",
                "--interval-minutes",
                "0.01",
                "--save-stall-seconds",
                "1",
            ],
            "--interval-minutes",
        ),  # fmt: skip
        (
            [
                "goodput",
                "--interruptions-per-day",
                "48",
                "--interval-minutes",
                "5",
                "--restart-seconds",
                "1800",
            ],
            "--restart-seconds",
        ),  # fmt: skip
        (["goodput", "--interval-minutes", "5"], "--interruptions-per-day"),
        (["goodput", "--mtbf-hours", "5", "--interval-minutes", "5", "--gpus", "8", "--afr", "0.1"], "--afr"),
        (["optimal-interval", "--save-stall-seconds", "-2", "--mtbf-hours", "24"], "--save-stall-seconds"),
        (["optimal-interval", "--save-stall-seconds", "2", "--mtbf-hours", "0"], "--mtbf-hours"),
        (
            ["optimal-interval", "--save-stall-seconds", "2", "--mtbf-hours", "1", "--restart-minutes", "60"],
            "--restart-minutes",
        ),  # fmt: skip
        (
            ["simulate", "--interruptions-per-day", "8.6", "--interval-minutes", "5", "--trials", "0"],
            "--trials",
        ),
        (
            ["simulate", "--interruptions-per-day", "8.6", "--interval-minutes", "5", "--days", "nan"],
            "--days",
        ),
        (["simulate", "--interruptions-per-day", "8.6", "--interval-minutes", "5", "--seed", "-1"], "--seed"),
        (["simulate", "--interruptions-per-day", "8.6", "--interval-minutes", "5", "--gpus", "0"], "--gpus"),
        (["simulate", "--interruptions-per-day", "8.6"], "--interval-minutes"),  # free saves: no Young/Daly
        (
            [
                "simulate",
                "--interruptions-per-day",
                "8.6",
                "--interval-minutes",
                "1",
                "--commit-delay-seconds",
                "61",
            ],
            "--commit-delay-seconds",
        ),  # fmt: skip
        (
            ["plan-table", "--save-stall-seconds", "0.1", "--restart-seconds", "-9", "--afr", "0.01"],
            "--restart-seconds",
        ),  # fmt: skip
    ],
)
def test_cli_bad_input_exits_2_naming_the_flag(capsys, args: list[str], flag: str) -> None:
    with pytest.raises(SystemExit) as e:
        main([*args, "--json"])
    out = capsys.readouterr()
    assert e.value.code == 2 and f"argument {flag}" in out.err and out.out == ""


def test_python_m_and_the_entry_point() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "goodput.calculator"]
    out = subprocess.run([*cmd, "failure", "--gpus", "1024", "--days", "30", "--afr", "0.01", "--json"],
                         cwd=REPO, env=env, capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["probability"] == pytest.approx(0.57, abs=0.005)
    bad = subprocess.run([*cmd, "failure", "--gpus", "-3", "--days", "30", "--afr", "0.01"],
                         cwd=REPO, env=env, capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "argument --gpus" in bad.stderr
    # The console script named in pyproject.toml resolves to this same main().
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["goodput-plan"].split(":")
    assert getattr(import_module(module), func) is main


def test_cli_human_and_tables(capsys) -> None:
    assert main(["goodput", "--interruptions-per-day", "8.6", "--interval-minutes", "30"]) == 0
    out = capsys.readouterr().out
    assert "Goodput 91.0%" in out and "8.6 interruptions/day" in out
    assert main(["tables"]) == 0
    assert capsys.readouterr().out == calculator.markdown(calculator.article_tables())


@pytest.mark.parametrize("kind", ["regular", "rescue", None])
def test_attempt_records_keep_what_a_restart_resumed_from(tmp_path, kind) -> None:
    from goodput.resilience.accounting import Attempts, check_attempt
    from goodput.storage.remote import Storage

    n = Attempts(Storage(str(tmp_path))).begin(7 if kind else None, resumed_kind=kind)
    data = (tmp_path / "attempts" / f"{n:04d}.json").read_bytes()
    assert check_attempt(data, f"{n:04d}.json", n)["resumed_kind"] == kind


def test_attempt_record_with_another_resumed_kind_is_refused_naming_the_file(tmp_path) -> None:
    from goodput.resilience.accounting import Attempts, check_attempt
    from goodput.storage.remote import Storage
    from goodput.untrusted import RecordError

    record = {"attempt": 3, "start": 1.0, "step": 5, "resumed_from": 5, "resumed_kind": "lucky"}
    with pytest.raises(RecordError, match=r"^attempts/0003\.json: 'resumed_kind' is 'lucky'"):
        check_attempt(json.dumps(record).encode(), "0003.json", 3)
    with pytest.raises(RecordError, match="attempts/0003.json: 'resumed_kind' is 1"):
        check_attempt(json.dumps({**record, "resumed_kind": 1}).encode(), "0003.json", 3)
    del record["resumed_kind"]  # records written before the field: a first start's, or unknown
    assert check_attempt(json.dumps(record).encode(), "0003.json", 3).get("resumed_kind") is None
    with pytest.raises(ValueError, match="resumed_kind"):
        Attempts(Storage(str(tmp_path))).begin(5, resumed_kind="lucky")


@pytest.mark.parametrize(
    ("p", "per_failure", "lost_hours"),
    [(0, 900, 2.15), (0.5, 0.5 * 900 + 0.5 * 10, 8.6 * 455 / 3600), (1, 10, 8.6 * 10 / 3600)],
)
def test_a_rescue_loses_one_step_instead_of_half_an_interval(p, per_failure, lost_hours) -> None:
    # 30 min interval: half of it is 900 s; a rescued failure loses one 10 s step.
    assert calculator.lost_work_per_failure_seconds(30, 0, p, 10) == pytest.approx(per_failure)
    r = goodput(8.6, 30, rescue_probability=p, step_seconds=10)
    assert r["lost_hours_per_day"] == pytest.approx(lost_hours)
    assert r["goodput"] == pytest.approx(1 - lost_hours / 24)
    # A commit delay is paid only by the failures a rescue does not cover: (1 - p) * (900 + 36) + p * 10.
    late = goodput(8.6, 30, commit_delay_seconds=36, rescue_probability=p, step_seconds=10)
    assert late["lost_hours_per_day"] == pytest.approx(8.6 * ((1 - p) * 936 + p * 10) / 3600)


def test_young_daly_with_rescue() -> None:
    # Only (1 - p) of failures pay half an interval: T = sqrt(2 * C * MTBF / (1 - p)).
    c, mtbf = 2.0, 86400.0
    assert optimal_interval(2, 24, rescue_probability=0)["interval_minutes"] == pytest.approx(587.878 / 60)
    half = optimal_interval(2, 24, 1, rescue_probability=0.5, step_seconds=1)
    t = math.sqrt(2 * c * mtbf / 0.5)
    assert t == pytest.approx(831.384, abs=1e-3)  # sqrt(691,200) s: sqrt(2) x the 587.9 s without rescue
    assert half["interval_minutes"] == pytest.approx(t / 60)
    assert half["goodput"] == pytest.approx(1 - c / t - (0.5 * t / 2 + 0.5 * 1 + 60) / mtbf)
    # p = 1: every failure costs one step at any interval, so failures set none; goodput 1 - (step + R)/MTBF.
    every = optimal_interval(2, 24, 1, rescue_probability=1, step_seconds=1)
    assert every["interval_minutes"] is None and "every failure is rescued" in every["note"]
    assert every["goodput"] == pytest.approx(1 - 61 / mtbf)
    for p in (0.2, 0.5, 0.9):  # still the optimum of the first-order model it comes from
        best = optimal_interval(5, 12, rescue_probability=p, step_seconds=1)
        for factor in (0.5, 0.8, 1.25, 2.0):
            m = best["interval_minutes"] * factor
            r = goodput(2, m, save_stall_seconds=5, rescue_probability=p, step_seconds=1)
            assert r["goodput"] < best["goodput"]


def test_simulated_rescue_matches_the_closed_form() -> None:
    # Failures rare within an interval (2/day at 5 min), no restarts: the first-order form is exact
    # to well within the sampling error of ~120,000 failures.
    p, step, a = 0.5, 2.0, 300.0
    r = simulate(2, 5, trials=2000, seed=1, rescue_probability=p, step_seconds=step)
    assert r["rescue_probability"] == p and r["lost_work_per_failure_seconds"] == pytest.approx(76)
    failures = r["failures_mean"] * r["trials"]
    per_failure = r["redone_hours_mean"] * 3600 / r["failures_mean"]
    # A loss is uniform on [0, a) without rescue, one step with: the mixture's variance.
    var = (1 - p) * a**2 / 3 + p * step**2 - ((1 - p) * a / 2 + p * step) ** 2
    assert abs(per_failure - r["lost_work_per_failure_seconds"]) < 4 * math.sqrt(var / failures)
    assert abs(r["goodput_mean"] - r["closed_form_goodput"]) < 4 * r["goodput_sem"] + 1e-6
    assert r["renewal_goodput"] is None  # the renewal form knows no rescue
    # Rescues come from a stream of their own: the same seed, the same failures at any p.
    plain = simulate(2, 5, trials=2000, seed=1)
    assert r["failures_mean"] == plain["failures_mean"] and r["goodput_mean"] > plain["goodput_mean"]
    assert plain["rescue_probability"] == 0 and plain["lost_work_per_failure_seconds"] == 150
    every = simulate(2, 5, trials=200, seed=1, rescue_probability=1, step_seconds=step)
    assert every["redone_hours_mean"] * 3600 / every["failures_mean"] == pytest.approx(step, rel=0.01)


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: goodput(8.6, 30, rescue_probability=-0.1, step_seconds=1), "rescue_probability"),
        (lambda: goodput(8.6, 30, rescue_probability=1.5, step_seconds=1), "rescue_probability"),
        (lambda: goodput(8.6, 30, rescue_probability=float("nan"), step_seconds=1), "rescue_probability"),
        (lambda: goodput(8.6, 30, rescue_probability=0.5), "step_seconds"),
        (lambda: goodput(8.6, 30, rescue_probability=0.5, step_seconds=0), "step_seconds"),
        (lambda: goodput(8.6, 1, rescue_probability=0.5, step_seconds=61), "step_seconds"),  # no room
        (lambda: optimal_interval(2, 24, rescue_probability=2, step_seconds=1), "rescue_probability"),
        (lambda: optimal_interval(2, 24, rescue_probability=0.5), "step_seconds"),
        (lambda: simulate(8.6, 30, rescue_probability=0.5), "step_seconds"),
        (lambda: simulate(8.6, 30, rescue_probability=-1, step_seconds=1), "rescue_probability"),
    ],
)
def test_invalid_rescue_names_the_argument(call, argument: str) -> None:
    with pytest.raises(ValueError, match=f"^{argument} "):
        call()


def test_cli_rescue_flags(capsys) -> None:
    rate = ["--interruptions-per-day", "8.6"]
    r = run_json(capsys, "goodput", *rate, "--interval-minutes", "30", "--rescue-probability", "0.5",
                 "--step-seconds", "10")  # fmt: skip
    assert r["rescue_probability"] == 0.5 and r["lost_hours_per_day"] == pytest.approx(8.6 * 455 / 3600)
    assert r["renewal_goodput"] is None  # the exact form knows no rescue
    assert run_json(capsys, "goodput", *rate, "--interval-minutes", "30")["rescue_probability"] == 0
    r = run_json(capsys, "optimal-interval", "--save-stall-seconds", "2", "--mtbf-hours", "24",
                 "--rescue-probability", "0.5", "--step-seconds", "1")  # fmt: skip
    assert r["interval_minutes"] == pytest.approx(math.sqrt(2 * 2 * 86400 / 0.5) / 60)
    r = run_json(capsys, "optimal-interval", "--save-stall-seconds", "2", "--mtbf-hours", "24",
                 "--rescue-probability", "1", "--step-seconds", "1")  # fmt: skip
    assert r["interval_minutes"] is None and r["note"] and r["rescue_probability"] == 1
    sim = ["simulate", *rate, "--save-stall-seconds", "1", "--trials", "200"]
    r = run_json(capsys, *sim, "--rescue-probability", "0.9", "--step-seconds", "2")
    yd = optimal_interval(1, 24 / 8.6, rescue_probability=0.9, step_seconds=2)["interval_minutes"]
    assert r["interval_minutes"] == pytest.approx(yd)  # Young/Daly with rescue: sqrt(10) x longer
    assert r["lost_work_per_failure_seconds"] == pytest.approx(0.1 * yd * 60 / 2 + 0.9 * 2)
    assert main([*sim, "--rescue-probability", "0.9", "--step-seconds", "2"]) == 0
    assert "90.0% of failures lose one 2 s step" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "flag", "also"),
    [
        (["goodput", "--interval-minutes", "30", "--rescue-probability", "1.5", "--step-seconds", "1"],
         "--rescue-probability", "between 0 and 1"),
        (["goodput", "--interval-minutes", "30", "--rescue-probability", "nan", "--step-seconds", "1"],
         "--rescue-probability", "finite"),
        (["goodput", "--interval-minutes", "30", "--rescue-probability", "0.5"],
         "--step-seconds", "--rescue-probability"),
        (["goodput", "--interval-minutes", "30", "--rescue-probability", "0.5", "--step-seconds", "-1"],
         "--step-seconds", "> 0"),
        (["optimal-interval", "--save-stall-seconds", "2", "--rescue-probability", "0.5"],
         "--step-seconds", "--rescue-probability"),
        (["simulate", "--save-stall-seconds", "2", "--rescue-probability", "-0.5", "--step-seconds", "1"],
         "--rescue-probability", "got -0.5"),
        (["simulate", "--save-stall-seconds", "2", "--rescue-probability", "1", "--step-seconds", "1"],
         "--interval-minutes", "every failure is rescued"),
        (["advise", "no-such-run", "--rescue-probability", "2"], "--rescue-probability", "between 0 and 1"),
    ],
)  # fmt: skip
def test_cli_bad_rescue_exits_2_naming_the_flag(capsys, args: list[str], flag: str, also: str) -> None:
    rate = [] if args[0] == "advise" else ["--mtbf-hours", "24"]
    with pytest.raises(SystemExit) as e:
        main([*args, *rate, "--json"])
    out = capsys.readouterr()
    assert e.value.code == 2 and f"argument {flag}" in out.err and also in out.err and out.out == ""


def _advised_run(tmp_path, monkeypatch, kinds: list[str | None]) -> str:
    """A checkpoint dir with one attempt record per start (`kinds`: what each restart resumed from)
    beside an MLflow run that measured a 0.3 s stall, commits 1 s later and 0.5 s steps."""
    from types import ModuleType, SimpleNamespace

    from goodput.calculator import advise
    from goodput.resilience.accounting import Attempts
    from goodput.storage.remote import Storage

    for i, kind in enumerate([None, *kinds]):
        Attempts(Storage(str(tmp_path))).begin(10 * i if kind else None, resumed_kind=kind)
    history = {"ckpt/blocking_seconds": [0.2, 0.3, 0.4], "ckpt/total_seconds": [1.3, 1.3, 1.3],
               "goodput/productive_seconds": [100.0]}  # fmt: skip
    metrics = {"goodput/startup_seconds": 5.0, "goodput/productive_seconds": 100.0}

    class Client:  # the two calls `measured` makes, without an MLflow store
        def __init__(self, uri: str) -> None:
            pass

        def get_run(self, rid: str):
            return SimpleNamespace(data=SimpleNamespace(metrics=metrics))

        def get_metric_history(self, rid: str, key: str):
            return [SimpleNamespace(value=v, step=200) for v in history.get(key, [])]

    fake = ModuleType("mlflow.tracking")
    fake.MlflowClient = Client
    monkeypatch.setitem(sys.modules, "mlflow", ModuleType("mlflow"))
    monkeypatch.setitem(sys.modules, "mlflow.tracking", fake)
    monkeypatch.setattr(advise, "run_id", lambda run: "a" * 32)  # no commits here: test_checkpoint's part
    return str(tmp_path)


def test_advise_measures_the_rescue_probability_from_the_attempt_records(tmp_path, monkeypatch, capsys):
    run = _advised_run(tmp_path, monkeypatch, ["rescue", "regular", "rescue", None])
    args = ["advise", run, "--gpus", "1024", "--afr", "0.01", "--trials", "200"]
    r = run_json(capsys, *args)
    # 2 of the 4 restarts resumed from a rescue; a step is 100 s / 200 steps of productive compute.
    assert r["rescue_probability"] == 0.5 and r["rescue_restarts"] == 4
    assert "2 of 4 restarts" in r["rescue_source"] and r["step_seconds"] == pytest.approx(0.5)
    mtbf = mtbf_hours_from_afr(1024, 0.01)
    yd = optimal_interval(0.3, mtbf, r["restart_seconds"] / 60, 1.0, rescue_probability=0.5, step_seconds=0.5)
    assert r["interval_minutes"] == pytest.approx(yd["interval_minutes"])
    assert r["closed_form_goodput"] == pytest.approx(yd["goodput"], abs=1e-6)
    # An explicit probability (and step time) overrides the measured one, and says so.
    r = run_json(capsys, *args, "--rescue-probability", "0", "--step-seconds", "2")
    assert r["rescue_probability"] == 0 and r["rescue_source"].startswith("--rescue-probability")
    assert "measured 0.5" in r["rescue_source"]
    plain = optimal_interval(0.3, mtbf, r["restart_seconds"] / 60, 1.0)["interval_minutes"]
    assert r["interval_minutes"] == pytest.approx(plain)
    r = run_json(capsys, *args, "--step-seconds", "2")
    assert r["step_seconds"] == 2 and r["lost_work_per_failure_seconds"] == pytest.approx(
        0.5 * (r["interval_minutes"] * 30 + 1.0) + 0.5 * 2
    )
    assert main(args) == 0
    assert "Rescue probability 0.5 from attempt records: 2 of 4 restarts" in capsys.readouterr().out


def test_advise_when_every_restart_was_rescued(tmp_path, monkeypatch, capsys) -> None:
    run = _advised_run(tmp_path, monkeypatch, ["rescue", "rescue"])
    r = run_json(capsys, "advise", run, "--trials", "200")
    assert r["rescue_probability"] == 1 and r["interval_minutes"] is None and "goodput_mean" not in r
    assert main(["advise", run]) == 0
    assert "Young/Daly sets no interval" in capsys.readouterr().out


def test_advise_without_restarts_or_records_assumes_no_rescue(tmp_path, monkeypatch, capsys) -> None:
    from goodput.calculator.advise import rescued

    run = _advised_run(tmp_path, monkeypatch, [])
    r = run_json(capsys, "advise", run, "--trials", "200")
    assert r["rescue_probability"] == 0 and "no restarts" in r["rescue_source"]
    assert r["interval_minutes"] == pytest.approx(
        optimal_interval(0.3, mtbf_hours_from_afr(1024, 0.01), r["restart_seconds"] / 60)["interval_minutes"]
    )
    assert rescued("0" * 32, [])["rescue_source"].startswith("no attempt records (RUN is a run id")
