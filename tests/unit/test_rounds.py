"""The round of the job's workers (goodput.parallel.job_round): the key prefix every process of one
start of the workers shares. On several torchrun nodes the agents' restart counts differ (an agent
counts a restart only where its own worker failed), so the round is agreed on the store
(agree_round), on a real TCP store here with one thread per rank; the restart through two torchrun
agents: tests/e2e/test_parallel.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from goodput.parallel import ROUND_ENV, agree_round, job_round


@pytest.fixture
def tcp():
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)


def _start(tcp, ranks, world, out, timeout_s=10.0):
    """Each of `ranks` as a process of its own would: its own connection, agree_round."""

    def one(r):
        store = dist.TCPStore("127.0.0.1", tcp.port, None, False, timeout=timedelta(seconds=10))
        try:
            out[r] = agree_round(store, r, world, timeout_s)
        except Exception as e:
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    return threads


def _join(threads):
    for t in threads:
        t.join(15)


def test_every_start_agrees_on_a_new_round_whoever_comes_first_and_whatever_earlier_starts_left(tcp):
    world = 3
    first: dict = {}
    _join(_start(tcp, range(world), world, first))
    assert first == {0: 0, 1: 0, 2: 0}
    # the next start: the others before rank 0, their hellos of the last start still in the store
    second: dict = {}
    waiting = _start(tcp, [1, 2], world, second)
    time.sleep(0.3)
    assert not second  # no leader yet: they wait
    _join(_start(tcp, [0], world, second) + waiting)
    assert second == {0: 1, 1: 1, 2: 1}
    # and one whose rank 0 answers its stale hello first, then its own when it comes
    third: dict = {}
    leading = _start(tcp, [0, 1], world, third)
    time.sleep(0.3)
    assert third == {1: 2}  # rank 0 waits for rank 2's acknowledgement
    _join(_start(tcp, [2], world, third) + leading)
    assert third == {0: 2, 1: 2, 2: 2}


def test_a_rank_that_never_comes_fails_the_leader_within_its_bound_naming_it(tcp):
    out: dict = {}
    t0 = time.monotonic()
    _join(_start(tcp, [0, 1], 3, out, timeout_s=0.5))
    assert isinstance(out[0], TimeoutError) and "rank(s) [2] did not join round 0" in str(out[0])
    assert out[1] == 0 and time.monotonic() - t0 < 5


def test_one_node_keeps_the_restart_count_several_agree_and_a_hosts_child_reads_its_hosts(tcp, monkeypatch):
    monkeypatch.delenv(ROUND_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "4")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert job_round(tcp, 0, 2, 1.0) == 4 and not tcp.check(["goodput/rounds/n"])
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")  # several nodes: agreed, not the node's own count
    assert job_round(tcp, 0, 1, 1.0) == 0 and job_round(tcp, 0, 1, 1.0) == 1
    monkeypatch.setenv(ROUND_ENV, "7")
    assert job_round(tcp, 0, 2, 1.0) == 7
