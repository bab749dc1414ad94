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
