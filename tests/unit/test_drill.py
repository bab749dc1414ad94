"""scripts/drill.py's arithmetic: the wall time failures cost, each run measured against its own
steady step speed (docs/goodput.md, "Drills"; docs/benchmarks.md, "A failure a minute, each run
against its own step speed"). The figures come from crafted summaries, so each case knows its
answer; the e2e drill test runs it on real jobs."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from helpers import REPO


@pytest.fixture(scope="module")
def drill():
    sys.path.insert(0, str(REPO / "scripts"))  # drill imports its sibling benchlib, as when run
    try:
        spec = importlib.util.spec_from_file_location("drill", REPO / "scripts" / "drill.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(REPO / "scripts"))


def summary(steps: int, step_s: float, overhead_s: float, restarts: int = 0, lost_steps: int = 0) -> dict:
    """A run of `steps` steps at `step_s` each, plus `overhead_s` of everything else (start, evals,
    restarts), as summary.json and the drill's steady step figure have it."""
    wall = (steps + lost_steps) * step_s + overhead_s
    return {
        "steps": steps,
        "steady_step_s": step_s,
        "goodput": {"wall_seconds": wall, "restarts": restarts, "lost_steps": lost_steps},
    }


def test_a_slower_machine_is_not_charged_to_the_failures(drill):
    clean = summary(1500, 0.150, overhead_s=30.0)
    # the same overheads, no failure cost at all, on a machine 6 % slower: raw wall says 0.94
    faulty = summary(1500, 0.159, overhead_s=30.0, restarts=5)
    raw = clean["goodput"]["wall_seconds"] / faulty["goodput"]["wall_seconds"]
    assert raw < 0.95
    got = drill.steady_cost(faulty, clean)
    assert got["steady_vs_clean"] == pytest.approx(1.0, abs=1e-4)
    assert got["failure_s"] == pytest.approx(0.0, abs=1e-3)
    assert got["at_60s"] == pytest.approx(1.0, abs=1e-4)


def test_what_each_restart_cost_is_found_through_a_speed_change(drill):
    clean = summary(1500, 0.150, overhead_s=30.0)
    # 5 restarts of 0.8 s each, 12 steps redone, on a machine 3 % faster
    faulty = summary(1500, 0.1455, overhead_s=30.0 + 5 * 0.8, restarts=5, lost_steps=12)
    got = drill.steady_cost(faulty, clean)
    redone = 12 * 0.150 / 5  # the redone steps, at the clean speed, are part of each failure's cost
    assert got["failure_s"] == pytest.approx(0.8 + redone, abs=1e-3)
    assert got["at_60s"] == pytest.approx(60 / (60 + 0.8 + redone), abs=1e-4)
    expect = clean["goodput"]["wall_seconds"] / (clean["goodput"]["wall_seconds"] + 5 * (0.8 + redone))
    assert got["steady_vs_clean"] == pytest.approx(expect, abs=1e-4)


def test_without_a_steady_figure_or_a_restart_there_is_nothing_to_say(drill):
    clean = summary(100, 0.1, overhead_s=5.0)
    no_mlflow = {**summary(100, 0.1, overhead_s=6.0, restarts=1), "steady_step_s": None}
    assert drill.steady_cost(no_mlflow, clean) == {"steady_vs_clean": None, "failure_s": None, "at_60s": None}
    got = drill.steady_cost(summary(100, 0.1, overhead_s=5.0), clean)  # a clean run against another
    assert got["steady_vs_clean"] == pytest.approx(1.0) and got["failure_s"] is None and got["at_60s"] is None


def test_the_steady_figure_is_read_where_the_runs_log(drill, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert drill.tracking_uri("/r", ["seed=1"]) == "sqlite:////r/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert drill.tracking_uri("/r", ["seed=1"]) == "http://mlflow:5000"
    assert drill.tracking_uri("/r", ["mlflow.tracking_uri=sqlite:////x/m.db"]) == "sqlite:////x/m.db"


def test_a_store_that_cannot_answer_leaves_the_figure_out_not_the_drill(drill, capsys, monkeypatch):
    import mlflow.tracking

    class Down:  # a tracking server that is gone by the time the drill reads it
        def __init__(self, uri):
            self.uri = uri

        def get_metric_history(self, run_id, key):
            raise ConnectionError(f"{self.uri} refused the connection")

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", Down)
    assert drill.steady_step_seconds("http://mlflow:5000", {"mlflow_run_id": "abc"}) is None
    assert "no steady step time for run abc in http://mlflow:5000" in capsys.readouterr().err
    assert drill.steady_step_seconds("http://mlflow:5000", {"mlflow_run_id": None}) is None
