"""What a test leaves behind in its xdist worker: the rules tests/conftest.py applies to each test."""

from __future__ import annotations

import gc

import pytest
from helpers import collector_left_as_found


def test_a_test_that_leaves_the_collector_frozen_fails_itself_and_hands_on_a_working_one():
    with pytest.raises(pytest.fail.Exception, match="left the collector frozen"), collector_left_as_found():
        gc.freeze()
    assert gc.get_freeze_count() == 0


def test_a_test_that_freezes_and_unfreezes_passes():
    with collector_left_as_found():
        gc.freeze()
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_an_in_process_run_that_raised_gives_back_the_preemption_handlers(monkeypatch):
    """A run that raised keeps its StopSignal handlers (a SIGTERM must not kill its rescue write);
    the in-process `run` fixture's process_state_kept() puts the worker's own back."""
    import signal

    from helpers import process_state_kept

    from goodput.resilience.preemption import PREEMPT_SIGNALS, StopSignal
    from goodput.resilience.signals import HELPER_ENV

    monkeypatch.setenv(HELPER_ENV, "")
    monkeypatch.delenv(HELPER_ENV)  # StopSignal sets it; the test's end removes it again
    before = {sig: signal.getsignal(sig) for sig in PREEMPT_SIGNALS}
    with pytest.raises(RuntimeError), process_state_kept():
        stop = StopSignal(grace_s=5.0)
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        raise RuntimeError("a step failed")  # no stop.restore(), as in loop.train
    assert {sig: signal.getsignal(sig) for sig in PREEMPT_SIGNALS} == before
