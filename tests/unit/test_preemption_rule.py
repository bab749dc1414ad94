"""The preemption rule (signals.Preemption) and the two handlers built on it, in process: the end-to-end
drills with real signals are tests/e2e/test_preemption.py (slow)."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException

from goodput.resilience import preemption
from goodput.resilience.preemption import LeaveStopToWorkers, StopSignal
from goodput.resilience.signals import Action, Preemption

TERM, INT = signal.SIGTERM, signal.SIGINT


def test_the_same_signal_inside_the_window_counts_once():
    p = Preemption(dup_s=2.0)
    assert p.state == "idle"
    assert p.notify(TERM, 100.0) is Action.FIRST
    assert [p.notify(TERM, t) for t in (100.0, 101.0, 101.99)] == [Action.DUPLICATE] * 3
    assert p.state == "notified" and p.first == (TERM, 100.0)


@pytest.mark.parametrize(
    "sig, at", [(INT, 100.1), (TERM, 102.0), (TERM, 250.0)], ids=["other", "at the edge", "later"]
)
def test_a_different_signal_or_one_after_the_window_escalates(sig, at):
    p = Preemption(dup_s=2.0)
    p.notify(TERM, 100.0)
    assert p.notify(sig, at) is Action.ESCALATE
    assert p.state == "escalated"
    assert p.notify(TERM, 100.5) is Action.DUPLICATE  # the first notice's copies still count once


def test_the_window_runs_from_the_first_signal_not_the_last_copy():
    p = Preemption(dup_s=2.0)
    p.notify(TERM, 0.0)
    assert p.notify(TERM, 1.5) is Action.DUPLICATE
    assert p.notify(TERM, 2.5) is Action.ESCALATE


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_stop_signal_takes_the_first_notice_and_ignores_its_copy(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(preemption, "time", clock)
    exits = []
    monkeypatch.setattr(preemption.os, "_exit", exits.append)
    stop = StopSignal(grace_s=30.0)
    try:
        stop._handle(TERM, None)
        clock.now += 1.0
        stop._handle(TERM, None)
        assert stop.received == "SIGTERM" and exits == []
        clock.now += 1.5  # 2.5 s after the first: a second notice
        stop._handle(TERM, None)
        assert exits == [128 + TERM] and stop.received == "SIGTERM"
    finally:
        stop.restore()


def test_the_agent_forwards_once_then_hands_over_to_its_teardown(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(preemption, "time", clock)
    sent = []
    monkeypatch.setattr(preemption.os, "kill", lambda pid, sig: sent.append((pid, sig)))

    class Child:
        pid = 4242

    monkeypatch.setattr(preemption.multiprocessing, "active_children", lambda: [Child()])
    h = LeaveStopToWorkers()
    h._handle(TERM, None)
    clock.now += 1.9
    h._handle(TERM, None)  # the same notice by the process group: not forwarded again
    assert sent == [(4242, TERM)]
    with pytest.raises(SignalException) as e:
        h._handle(INT, None)
    assert e.value.sigval == INT and sent == [(4242, TERM)]


def test_the_agent_restarts_failed_workers_only_before_a_notice(monkeypatch):
    restarts = []
    monkeypatch.setattr(SimpleElasticAgent, "_restart_workers", lambda agent, wg: restarts.append(wg))
    monkeypatch.setattr(preemption.multiprocessing, "active_children", lambda: [])
    previous = {sig: signal.getsignal(sig) for sig in (TERM, INT)}
    with LeaveStopToWorkers() as h:
        SimpleElasticAgent._restart_workers(None, "round 1")
        h._handle(TERM, None)
        with pytest.raises(SignalException):
            SimpleElasticAgent._restart_workers(None, "round 2")
    assert restarts == ["round 1"]
    SimpleElasticAgent._restart_workers(None, "after")  # put back on exit, with the handlers
    assert restarts == ["round 1", "after"]
    assert {sig: signal.getsignal(sig) for sig in (TERM, INT)} == previous


def test_a_notice_the_agent_got_before_its_workers_listened_reaches_them(tmp_path, monkeypatch):
    """Under parallel=ddp a SIGTERM during the start-up came while the agent had no worker yet (or
    one still ignoring signals, as forked from the forkserver): forwarded to nobody, it was lost and
    the job trained to the end. The agent notes it; a worker reads it when it starts listening."""
    monkeypatch.setattr(preemption.multiprocessing, "active_children", lambda: [])  # no worker yet
    notice = preemption.notice_file(str(tmp_path))
    with LeaveStopToWorkers(notice=notice) as h:
        h._handle(TERM, None)
    stop = StopSignal(grace_s=30.0, notice=notice)
    try:
        assert stop.received == "SIGTERM"
        stop._handle(TERM, None)  # the agent's forwarded copy, later: not a second notice
        assert stop.received == "SIGTERM"
    finally:
        stop.restore()
    preemption.clear_notice(notice)  # the next launch in this run dir: no notice
    (tmp_path / "elastic" / preemption.NOTICE).write_text("os.system")  # only a signal's name counts
    for path in (notice, str(tmp_path / "nothing")):
        stop = StopSignal(grace_s=30.0, notice=path)
        stop.restore()
        assert stop.received is None
