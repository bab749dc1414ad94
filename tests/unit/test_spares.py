"""parallel.spares: the decision a host makes when its rank dies (goodput.resilience.spares.Roster),
on a real TCP store in this process; what falls back, and within which bound; a waiting spare's
CPU; a spare built for another rank made the rank it takes (Trainer.rebind); the loader that
redoes the step in flight without new workers. The end-to-end drills: tests/e2e/test_spares_runs.py."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from goodput.resilience.spares import Recoveries, Roster, check_record, record_name
from goodput.storage.remote import Storage
from goodput.untrusted import RecordError


@pytest.fixture
def store():
    """A TCP store of its own (what the elastic agent's is), with a prefix like the job's."""
    base = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield dist.PrefixStore("goodput/restart0/spares/", base)


def _roster(store, world=3, timeout_s=5.0) -> Roster:
    return Roster(store, world, timeout_s)


def _spare(roster: Roster) -> int:
    member = roster.member()
    assert roster.register(member)
    return member


def test_a_plan_hands_a_spare_the_dead_ranks_place_at_the_survivors_step(store):
    r = _roster(store)
    spare = _spare(r)
    r.report(0, 0, 7)
    r.report(0, 2, 7)
    assert r.death(0, 1, "SIGKILL") == 1
    decision = r.decide(0, 1, "SIGKILL", detected=123.0)
    plan = decision["plan"]
    assert (plan["gen"], plan["rank"], plan["spare"], plan["step"], plan["sender"]) == (1, 1, spare, 7, 0)
    assert json.loads(store.get(Roster.assignment(spare)))["rank"] == 1  # the spare is told
    assert r.generation() == 1
    assert r.await_decision(0) == decision  # what every survivor reads


def test_the_decision_waits_for_a_survivor_that_reports_late(store):
    r = _roster(store)
    _spare(r)
    r.report(0, 0, 7)
    late = threading.Timer(0.3, r.report, args=(0, 2, 7))  # rank 2 was computing: its collective fails later
    late.start()
    assert "plan" in r.decide(0, 1, "SIGKILL", detected=0.0)
    late.join()


@pytest.mark.parametrize(
    "case, why",
    [
        ("no spare", "no spare left"),
        ("spare gone", "no spare left"),
        ("in a save", "rank 2: inside a checkpoint save"),
        ("different steps", "the survivors stand at different steps [7, 8]"),
        ("two deaths", "two ranks lost at once"),
        ("no report", "rank(s) [2] did not report within parallel.recovery_timeout_s=0.5s"),
    ],
)
def test_what_does_not_fit_is_aborted_naming_why(store, case, why):
    """Each of these falls back to the rescue and restart path: the survivors read the abort."""
    r = _roster(store, timeout_s=0.5)
    if case != "no spare":
        member = _spare(r)
        if case == "spare gone":  # it died while it waited: never handed out
            r.gone(member)
    r.report(0, 0, 7)
    if case == "in a save":
        r.report(0, 2, None, "inside a checkpoint save")
    elif case == "different steps":
        r.report(0, 2, 8)
    elif case != "no report":
        r.report(0, 2, 7)
    first = r.death(0, 1, "SIGKILL")
    if case == "two deaths":
        assert r.death(0, 2, "SIGKILL") == 2  # the second host aborts; the first one's decide sees it too
    t0 = time.monotonic()
    assert r.decide(0, 1, "SIGKILL", detected=0.0) == {"abort": why}
    assert time.monotonic() - t0 < 2.0  # within the bound (0.5 s) and the poll
    assert first == 1 and r.await_decision(0) == {"abort": why}
    assert not any(store.check([Roster.assignment(m)]) for m in range(3) if case != "no spare")


def test_a_survivor_that_waits_past_the_bound_aborts_and_a_late_plan_loses(store):
    r = _roster(store, timeout_s=0.3)
    spare = _spare(r)
    t0 = time.monotonic()
    assert r.await_decision(0) == {"abort": "no decision within parallel.recovery_timeout_s=0.3s"}
    assert time.monotonic() - t0 < 2.0
    r.report(0, 0, 7)
    r.report(0, 2, 7)
    r.death(0, 1, "SIGKILL")
    assert "abort" in r.decide(0, 1, "SIGKILL", detected=0.0)  # the abort stood: nobody joins a new group
    assert not store.check([Roster.assignment(spare)])


def test_the_end_of_the_run_tells_every_waiting_spare_to_exit(store):
    r = _roster(store)
    a, b = _spare(r), _spare(r)
    r.report(0, 0, 3)
    r.report(0, 2, 3)
    r.death(0, 1, "SIGKILL")
    assert r.decide(0, 1, "SIGKILL", 0.0)["plan"]["spare"] == a
    r.close("the run is over")
    assert json.loads(store.get(Roster.assignment(b))) == {"exit": "the run is over"}
    late = r.member()
    assert not r.register(late)  # one that registers after the end sees it


def _record(n=1, **change) -> dict:
    rec = {"kind": "in_process", "attempt": 0, "n": n, "dead_rank": 1, "spare": 2, "step": 10,
           "lost_steps": 0, "failure_source": "fault_marker", "at": {"failure": 1.0, "first_step": 1.3},
           "seconds": {"first_step": 0.3}, "total_seconds": 0.3}  # fmt: skip
    return {**rec, **change}


def test_recovery_records_are_read_as_untrusted_input(tmp_path, caplog):
    store = Storage(str(tmp_path))
    store.write_bytes(record_name(0, 1), json.dumps(_record()).encode())
    store.write_bytes(record_name(0, 2), json.dumps(_record(n=2, seconds={"first_step": "x"})).encode())
    store.write_bytes(record_name(1, 3), json.dumps(_record(n=4)).encode())  # the name says 3
    assert [r["n"] for r in Recoveries(store).records()] == [1]
    assert sorted(os.listdir(tmp_path / "recoveries"))[0] == "attempt0000-001.json"
    assert sum(".malformed-" in n for n in os.listdir(tmp_path / "recoveries")) == 2
    with pytest.raises(RecordError, match="'kind'"):
        check_record(json.dumps(_record(kind="restart")).encode(), "x")
