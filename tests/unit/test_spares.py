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
def tcp():
    """A TCP store of its own (what the elastic agent's is)."""
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)


@pytest.fixture
def store(tcp):
    """The spares' part of it, with the job's prefix."""
    return dist.PrefixStore("goodput/restart0/spares/", tcp)


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


def test_a_shard_comes_from_its_replica_and_a_shard_without_one_falls_back(store):
    """hsdp, 2 replica groups x 2 shards: rank 3's shard is held by rank 1 (its column of the mesh),
    not by rank 0, the lowest survivor; under fsdp no survivor holds it: the fall back, at once."""
    from goodput.parallel import FSDP, HSDP

    r = _roster(store, world=4)
    _spare(r)
    for rank in (0, 1, 2):
        r.report(0, rank, 7)
    assert r.decide(0, 3, "SIGKILL", 0.0, HSDP(shard_size=2).holders(3, 4))["plan"]["sender"] == 1
    t0 = time.monotonic()
    none = r.decide(1, 3, "SIGKILL", 0.0, FSDP().holders(3, 4))
    assert none == {"abort": "no survivor holds rank 3's shard"}
    assert time.monotonic() - t0 < 0.5  # no wait for the reports


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


def test_a_lost_hosts_spares_are_never_handed_out_and_its_rank_goes_to_a_live_hosts_spare(store):
    """Two hosts (nodes), a spare on each; host 1's registered first. Host 1 is lost: the first
    host to say so wins (it records the deaths and decides), a host that left cannot be declared
    lost, and the plan hands rank 1 to host 0's spare, not host 1's dead one; rank 1 lives on host 0
    from then on (its next loss is host 0's)."""
    r = _roster(store, world=2)
    r.place_rank(0, 0)
    r.place_rank(1, 1)
    on_lost, on_live = r.member(), r.member()
    r.place_spare(on_lost, 1)
    r.place_spare(on_live, 0)
    assert r.register(on_lost) and r.register(on_live)
    assert r.ranks_of(1) == [1]
    assert r.declare_lost(1, by=0) and not r.declare_lost(1, by=0)  # (the second sees it done)
    r.leave(0)
    assert not r.declare_lost(0, by=1) and not r.lost(0)
    r.report(0, 0, 9)
    assert r.death(0, 1, "node lost") == 1
    plan = r.decide(0, 1, "node lost", detected=0.0)["plan"]
    assert (plan["rank"], plan["spare"], plan["step"], plan["sender"]) == (1, on_live, 9, 0)
    assert r.ranks_of(0) == [0, 1] and r.ranks_of(1) == []


def test_hosts_watch_the_next_live_one_in_a_ring(store):
    r = _roster(store, world=4)
    assert [r.watched(h, 4) for h in range(4)] == [1, 2, 3, 0]
    assert r.declare_lost(1, by=0)
    r.leave(2)
    assert r.watched(0, 4) == 3 and r.watched(3, 4) == 0
    assert r.declare_lost(3, by=0) and r.watched(0, 4) is None


def _host(store_port: int, host_id: int, world: int):
    """A Host as launch's worker makes it, without its children: for its watcher and its fence."""
    import threading as th

    from goodput.parallel import DDP
    from goodput.run.spares import Host, Spares

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port))
    h = Host.__new__(Host)
    h.s, h.id, h.rank, h.world, h.strategy = Spares(1, 5.0), host_id, host_id, world, DDP()
    h.children, h.stopping, h._done, h._forking = {}, False, th.Event(), th.Lock()
    return h


def test_a_host_whose_heartbeat_stands_still_is_declared_lost_and_its_rank_replaced_in_its_place(
    tcp, store, monkeypatch
):
    """Host 0's watcher (its own thread and store connection, as in a job): host 1 beats, then
    stops (its node is gone, nobody there reports rank 1's death). After LOST_S without a beat,
    host 0 declares it lost, records rank 1's death, decides with rank 0's report (a plan for host
    0's spare) and starts the next spare. A host that has not beaten yet is not declared lost."""
    import goodput.run.spares as rs

    monkeypatch.setattr(rs, "LOST_S", 0.6)
    monkeypatch.setattr(rs, "_prefix", lambda: "goodput/restart0/spares/")
    r = _roster(store, world=2)
    host = _host(tcp.port, 0, 2)
    started = []
    host.start = lambda rank, after=None, roster=None: started.append((rank, after))
    r.place_rank(0, 0)
    r.place_rank(1, 1)
    spare = r.member()
    r.place_spare(spare, 0)
    r.register(spare)
    watcher = threading.Thread(target=host._watch_hosts, daemon=True)
    watcher.start()
    try:
        time.sleep(1.5)  # host 1 has not beaten yet: starting, not lost
        assert not r.lost(1)
        for _ in range(5):
            r.beat(1)
            time.sleep(0.1)
        r.report(0, 0, 4)  # rank 0's collective failed when rank 1's socket closed
        t0 = time.monotonic()
        store.wait(["gen0/decision"], timedelta(seconds=10))
        assert time.monotonic() - t0 >= 0.5  # not before LOST_S
        plan = r.decision(0)["plan"]
        assert (plan["rank"], plan["spare"], plan["step"]) == (1, spare, 4)
        assert plan["cause"].startswith("node lost: host 1's heartbeat stood still")
        assert store.get("host/1/lost") == b"0" and r.ranks_of(0) == [0, 1]
        deadline = time.monotonic() + 5
        while not started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert started == [(None, "gen1/mark/loader_ready/1")]
    finally:
        host._done.set()
        watcher.join(5)


def test_a_lost_node_that_held_two_ranks_falls_back(tcp, store, monkeypatch):
    """Host 1 held ranks 1 and 2 (a node of two ranks): both deaths are recorded, the decision is
    the fall back (two ranks lost at once), and no spare is taken or started."""
    import goodput.run.spares as rs

    monkeypatch.setattr(rs, "_prefix", lambda: "goodput/restart0/spares/")
    r = _roster(store, world=3)
    host = _host(tcp.port, 0, 3)
    started = []
    host.start = lambda rank, after=None, roster=None: started.append(rank)
    for rank, h in [(0, 0), (1, 1), (2, 1)]:
        r.place_rank(rank, h)
    spare = _spare(r)
    r.report(0, 0, 4)
    assert r.declare_lost(1, by=0)
    host._host_lost(r, 1, 5.0)
    assert r.decision(0) == {"abort": "two ranks lost at once"}
    assert store.add("gen0/dead", 0) == 2 and not store.check([Roster.assignment(spare)]) and not started


def test_a_rank_whose_host_was_declared_lost_does_not_join_as_a_survivor(tcp, store, monkeypatch):
    """A stall, not a death: rank 1's host was declared lost and a plan hands rank 1 to a spare.
    Rank 1 itself, alive, reads that plan when its collective fails: it falls back (its host's
    fence ends it) instead of joining the new group as rank 1 beside the spare."""
    import contextlib
    from types import SimpleNamespace

    import goodput.run.spares as rs

    monkeypatch.setattr(rs, "_prefix", lambda: "goodput/restart0/spares/")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(tcp.port))
    r = _roster(store, world=2)
    spare = _spare(r)
    r.report(0, 0, 4)
    r.death(0, 1, "node lost")
    assert r.decide(0, 1, "node lost", 0.0)["plan"]["spare"] == spare
    rewound = []
    t = SimpleNamespace(
        dist=SimpleNamespace(rank=1),
        rescue=SimpleNamespace(noted=lambda: (4, None), rewind=lambda: rewound.append(1)),
        ckpt=SimpleNamespace(saving=lambda: False),
        watchdog=SimpleNamespace(phase=lambda what: contextlib.nullcontext()),
    )
    member = rs.Member(rs.Spares(1, 5.0), member=9, pipe=-1, world=2, waiting=False)
    assert member.recover(t, RuntimeError("gloo/transport: Connection closed by peer")) is False
    assert not rewound and member.gen == 0


@pytest.mark.parametrize("ends", ["left", "closed"])
def test_a_host_that_ended_its_part_or_a_run_that_is_over_is_not_a_lost_node(tcp, store, monkeypatch, ends):
    """Host 1 beats, then stops: because it ended its part (its processes are done) or because the
    run is over. Past LOST_S, host 0's watcher declares nothing and records no death."""
    import goodput.run.spares as rs

    monkeypatch.setattr(rs, "LOST_S", 0.4)
    monkeypatch.setattr(rs, "_prefix", lambda: "goodput/restart0/spares/")
    r = _roster(store, world=2)
    host = _host(tcp.port, 0, 2)
    r.place_rank(1, 1)
    watcher = threading.Thread(target=host._watch_hosts, daemon=True)
    watcher.start()
    try:
        for _ in range(3):
            r.beat(1)
            time.sleep(0.1)
        r.leave(1) if ends == "left" else r.close("the run is over")
        time.sleep(1.5)
        assert not r.lost(1) and not store.check(["gen0/dead"])
    finally:
        host._done.set()
        watcher.join(5)


def test_a_failed_host_under_torchrun_fails_its_worker_naming_the_status():
    """The torchrun worker waits for its host process: one that exits 3 without a result (a host
    that fell back) raises HostFailed with that status, not the pipe's EOFError."""
    import multiprocessing as mp

    from goodput.run.spares import HostFailed, _result

    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    p = ctx.Process(target=os._exit, args=(3,))
    p.start()
    writer.close()
    with pytest.raises(HostFailed, match="the host of rank 1 ended with status 3"):
        _result(p, reader, "1")


def _fenced_host(port: int, sleeper: int) -> None:
    import goodput.run.spares as rs

    rs._prefix = lambda: "goodput/restart0/spares/"
    h = _host(port, 1, 2)
    h.children = {sleeper: None}
    h._beat()


def test_a_host_that_loses_the_store_while_the_run_is_on_ends_its_processes():
    """Silent, it would be declared lost by the others: it fences itself as if it had been."""
    import multiprocessing as mp
    import subprocess

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=2), wait_for_workers=False)
    sleeper = subprocess.Popen(["sleep", "60"])
    proc = mp.get_context("fork").Process(target=_fenced_host, args=(server.port, sleeper.pid))
    try:
        proc.start()
        r = _roster(dist.PrefixStore("goodput/restart0/spares/", server), world=2)
        deadline = time.monotonic() + 10
        while r.beats(1) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.beats(1) >= 2 and proc.is_alive()
        del r, server  # the store's process (its node) is gone
        proc.join(15)
        assert proc.exitcode == 1
        assert sleeper.wait(5) == -9
    finally:
        if proc.is_alive():
            proc.kill()
        if sleeper.poll() is None:
            sleeper.kill()


def test_a_host_declared_lost_that_still_lives_ends_its_processes(tcp, store):
    """A stall, not a death: the others replace its rank, so the host ends its own processes (its
    rank would otherwise train on beside the spare that took its place) and exits 1."""
    import multiprocessing as mp
    import subprocess

    sleeper = subprocess.Popen(["sleep", "60"])
    proc = mp.get_context("fork").Process(target=_fenced_host, args=(tcp.port, sleeper.pid))
    try:
        proc.start()
        r = _roster(store, world=2)
        deadline = time.monotonic() + 10
        while r.beats(1) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.beats(1) >= 2, "the host never beat"
        assert sleeper.poll() is None and proc.is_alive()
        assert r.declare_lost(1, by=0)
        proc.join(5)
        assert proc.exitcode == 1
        assert sleeper.wait(5) == -9  # SIGKILLed by the host
    finally:
        if proc.is_alive():
            proc.kill()
        if sleeper.poll() is None:
            sleeper.kill()


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


# -- a spare process ------------------------------------------------------------------------------
def _spare_process(c, ctx, port: int, pipe: int) -> None:
    """A spare as a host forks it (goodput.run.spares._child), in a spawned process."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for k in ("RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)
    from goodput.run.spares import Member, Spares
    from goodput.run.worker import worker

    worker(c, ctx, Member(Spares(1, 10.0), member=5, pipe=pipe, world=2, waiting=True))


def _cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and its children alive now (its DataLoader workers), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return total


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_a_waiting_spare_costs_no_cpu_and_exits_when_the_run_ends(tmp_path, tcp, store):
    """Built (model, optimizer, DDP's buckets settled, two DataLoader workers forked), a spare waits
    on the store: over 2 s it and its workers use under 2 % of one core. Told the run is over, it
    exits 0 without ending the MLflow run (it never was a rank)."""
    import multiprocessing as mp

    from helpers import compose_train, process_state_kept

    from goodput.run import job

    port = tcp.port
    cfg = compose_train(["experiment=smoke", f"paths.root={tmp_path}", "parallel=ddp", "data.num_workers=2"])
    with process_state_kept():
        c, ctx, lock = job.prepare(cfg, str(tmp_path / "run"))
    r, w = os.pipe()
    proc = mp.get_context("spawn").Process(target=_spare_process, args=(c, ctx, port, w))
    try:
        proc.start()
        roster = Roster(store, 2, 10.0)
        deadline = time.monotonic() + 120
        while not store.check(["spares/0"]) and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.check(["spares/0"]) and int(store.get("spares/0")) == 5, "the spare never got ready"
        time.sleep(1.0)  # settled: what the build left behind (its workers' start) is done
        before, t0 = _cpu_seconds(proc.pid), time.monotonic()
        assert len(_children(proc.pid)) >= 2  # its DataLoader workers, forked and parked
        time.sleep(2.0)
        used = _cpu_seconds(proc.pid) - before
        assert used < 0.02 * (time.monotonic() - t0), f"a waiting spare used {used:.3f} CPU seconds in 2 s"
        roster.close("the run is over")
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        lock.release()
        if proc.is_alive():
            proc.kill()
        os.close(r)
        os.close(w)


def _ranks(t) -> dict:
    """Every `rank` a component of the Trainer holds, and what else follows the rank."""
    out = {name: part.rank for name, part in vars(t).items() if hasattr(part, "rank")}
    out["dist"] = t.dist.rank
    out["val_batches"] = list(t.val_loader.batch_sampler)
    out["tracker"] = t.tracker.enabled
    out["rescue"] = (t.rescue.rank, t.step.guard.rescue is t.rescue)
    out["profiler"] = t.profiler.rank
    out["slow_s"] = t.faults.slow_s
    return out


def test_a_spare_built_for_one_rank_takes_another_as_if_built_for_it(tmp_path, dist1):
    """Trainer.rebind: whatever was built for a rank is rebuilt for the rank the spare takes, as
    a Trainer built for that rank has it (a part added to the Trainer later that holds a rank and
    is left out of rebind fails here)."""
    from helpers import compose_train, process_state_kept

    from goodput.parallel import Dist
    from goodput.run import job
    from goodput.run.build import Trainer

    cfg = compose_train(["experiment=smoke", f"paths.root={tmp_path}", "parallel=ddp", "fault.slow_rank=0"])
    with process_state_kept():
        c, ctx, lock = job.prepare(cfg, str(tmp_path / "run"))
        try:
            at = lambda r: Dist(r, 2, 0, dist1.device, dist1.ckpt_pg, dist1.init_timeout_s)  # noqa: E731
            built, spare = Trainer(c, ctx, at(0)), Trainer(c, ctx, at(1))
            assert _ranks(spare) != _ranks(built)
            spare.rebind(at(0))
            assert _ranks(spare) == _ranks(built)
            for t in (built, spare):
                t.close()
                t.tracker.close("KILLED", None)
        finally:
            lock.release()


def test_a_new_rescue_keeps_the_attempts_start_and_is_what_every_caller_asks(tmp_path, dist1):
    """After a rank change (rebind) or a rebuild (regroup), the Trainer's rescue is new: it keeps
    the step the attempt started from and the newest reached (else a failure in the first step
    after a recovery rescues nothing: `nothing_new`), and it is the one the step's guard, the
    watchdog and the preemption grace timer call (else the grace timer writes the old model's)."""
    from helpers import compose_train, process_state_kept

    from goodput.parallel import Dist
    from goodput.run import job
    from goodput.run.build import Trainer

    class Stop:
        last_words = None

        def rescuing(self, last_words):
            self.last_words = last_words
            return self

    cfg = compose_train(["experiment=smoke", f"paths.root={tmp_path}", "parallel=ddp"])
    with process_state_kept():
        c, ctx, lock = job.prepare(cfg, str(tmp_path / "run"))
        try:
            at = lambda r: Dist(r, 2, 0, dist1.device, dist1.ckpt_pg, dist1.init_timeout_s)  # noqa: E731
            t = Trainer(c, ctx, at(1))
            t.stop = Stop().rescuing(t.rescue.request)
            t.rescue.boundary(3)
            t.rescue.boundary(7)
            old = t.rescue
            t.rebind(at(0))
            assert t.rescue is not old and (t.rescue.since, t.rescue.reached) == (3, 7)
            assert t.step.guard.rescue is t.rescue
            assert t.watchdog.last_words.func == t.rescue.request
            assert t.stop.last_words == t.rescue.request
            t.close()
            t.tracker.close("KILLED", None)
        finally:
            lock.release()


def test_a_spare_of_a_sharded_strategy_allocates_no_weights_while_it_waits(tmp_path, dist1):
    """parallel=hsdp: a spare cannot shard before it knows its rank (its mesh coordinates depend on
    it), so it builds model, EMA and optimizer on the meta device: no weight allocated (a model
    that needs sharding may not fit one device). Trainer.regroup builds them again on the mesh it
    joins (through the entry point: e2e/test_hsdp_runs.py); a ddp spare builds on its device."""
    from helpers import compose_train, process_state_kept

    from goodput.parallel import Dist
    from goodput.run import job
    from goodput.run.build import Trainer

    hsdp = ["parallel=hsdp", "parallel.nproc_per_node=4", "parallel.shard_size=2",
            "parallel.oversubscribe=true"]  # fmt: skip
    for layout, meta in ((hsdp, True), (["parallel=ddp"], False)):
        cfg = compose_train(["experiment=smoke", f"paths.root={tmp_path}", *layout, "trainer.ema_decay=0.9"])
        with process_state_kept():
            c, ctx, lock = job.prepare(cfg, str(tmp_path / "run"))
            try:
                d = Dist(1, c.parallel.nproc_per_node, 0, dist1.device, dist1.ckpt_pg, dist1.init_timeout_s)
                t = Trainer(c, ctx, d, unsharded=True)
                weights = [*t.model.parameters(), *t.step.ema.parameters()]
                assert weights and all(w.is_meta == meta for w in weights), layout
                assert t.regroups_in_place is not meta  # hsdp: built again when it joins
                t.close()
                t.tracker.close("KILLED", None)
            finally:
                lock.release()


def _loader(folder, cache_dir, rank=0, world=1, workers=2):
    import torch

    from goodput.data.config import DataConfig
    from goodput.data.loader import ResumableLoader

    cfg = DataConfig(
        source={"_target_": "goodput.data.sources.CachedSource"}, root=folder, cache_dir=str(cache_dir),
        image_size=16, num_workers=workers, prefetch_factor=2, prefetch_steps=3,
    )  # fmt: skip
    return ResumableLoader(cfg, Storage(folder), 5, 4, 6, rank, world, torch.device("cpu"))


def test_a_parked_loader_delivers_what_a_started_one_does_on_the_workers_it_forked(folder, tmp_path):
    """A spare's loader forks its workers with no position (park); given the rank and step it
    learns later, it delivers the same batches as a loader started there, on the same workers (its
    first batch made by both of them, a sample each: merged, it is the same batch)."""
    import torch

    ref = _loader(folder, tmp_path / "a", rank=1, world=2)
    ref.step = 2
    want = [next(ref) for _ in range(2)]
    ref.close()
    spare = _loader(folder, tmp_path / "b", rank=0, world=2)  # built for another rank
    spare.park()
    workers = spare._dl
    assert len(_children(os.getpid())) >= 1 and workers is not None
    spare.rank = 1
    spare.start_at(2)
    spare.step = 2
    got = [next(spare) for _ in range(2)]
    assert spare._dl is workers  # no new DataLoader: the parked workers took the position
    for a, b in zip(want, got):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["image"], b["image"])
    spare.close()


def test_the_step_in_flight_is_delivered_again_without_new_workers(folder, tmp_path):
    """keep_last: the loader's state one step back (the survivors' rewind) delivers the same batch
    again from the copy it kept; the order hash is the one of a loader that never went back."""
    import torch

    ref = _loader(folder, tmp_path / "a")
    for _ in range(3):
        next(ref)
    chain = ref.chain.hexdigest
    ref.close()
    ld = _loader(folder, tmp_path / "b")
    ld.keep_last = True
    next(ld)
    boundary = ld.state_dict()  # the end of step 1
    workers = ld._dl
    in_flight = next(ld)  # step 2's batch: its step fails
    ld.load_state_dict(boundary)
    again = next(ld)
    assert ld._dl is workers  # the same workers: none restarted
    assert torch.equal(again["index"], in_flight["index"]) and torch.equal(again["image"], in_flight["image"])
    next(ld)
    assert ld.chain.hexdigest == chain
    ld.close()


def test_the_planner_counts_in_process_recoveries_as_failures_that_lost_the_step_in_flight(tmp_path):
    """advise (given the checkpoint dir): each in-process recovery's failure-to-first-step is a
    measured restart cost beside the attempt records' gaps, and a failure that lost one step."""
    from goodput.calculator.advise import in_process, rescued, restart_cost

    store = Storage(str(tmp_path))
    for n, total in ((1, 0.3), (2, 0.5)):
        store.write_bytes(record_name(0, n), json.dumps(_record(n=n, total_seconds=total)).encode())
    store.write_bytes(record_name(0, 3), b"{not json")  # left out, not moved: the planner only reads
    spared = in_process(str(tmp_path))
    assert [r["n"] for r in spared] == [1, 2] and (tmp_path / record_name(0, 3)).exists()
    records = [{"attempt": 0, "start": 0.0, "startup": 1.0, "last_seen": 50.0},
               {"attempt": 1, "start": 51.0, "startup": 1.1, "resumed_kind": "rescue"}]  # fmt: skip
    m = {"goodput/restarts": 3, "goodput/lost_seconds": 3.0, "goodput/productive_seconds": 100.0}
    r = restart_cost(m, steps=200, records=records, spared=spared)
    assert r["restart_seconds"] == pytest.approx((2.1 + 0.3 + 0.5) / 3)
    assert "in-process recoveries onto a spare: failure to first step (2)" in r["restart_source"]
    p = rescued(str(tmp_path), records, spared)
    assert p["rescue_probability"] == 1.0 and p["rescue_restarts"] == 3


def test_spares_are_refused_or_left_out_where_they_cannot_help(monkeypatch, caplog):
    """At compose time: no spare without the rescue's boundary or without survivors. At launch:
    none under an outside launcher (its agent stops every rank) or a layout where no survivor holds
    a dead rank's shard (fsdp, hsdp with one replica group), each said once; the run goes on
    without. hsdp with two replica groups starts them; on gloo with more than two ranks, a
    collective timeout not below the recovery bound is said."""
    from types import SimpleNamespace

    from helpers import check_config_change, compose_train
    from omegaconf import OmegaConf

    from goodput.parallel import LAUNCHER_ENV
    from goodput.run.spares import Spares, settings

    for k in LAUNCHER_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    c = OmegaConf.to_container(
        compose_train(["paths.root=/x", "experiment=smoke", "parallel=ddp"]), resolve=True
    )
    check_config_change(c, {"parallel": {"spares": 1}}, None)
    check_config_change(c, {"parallel": {"spares": 1}, "checkpoint": {"rescue": False}},
                        "parallel.spares=1 needs checkpoint.rescue=true")  # fmt: skip
    check_config_change(c, {"parallel": {"spares": 1, "nproc_per_node": 1}},
                        "a spare takes a dead rank's place among survivors")  # fmt: skip
    check_config_change(c, {"parallel": {"spares": -1}}, "parallel.spares must be an int >= 0, got -1")

    def par(target, nproc=2, collective_s=120.0, **options):
        node = {"spares": 1, "recovery_timeout_s": 5.0, "strategy": {"_target_": target, **options},
                "nproc_per_node": nproc, "collective_timeout_s": collective_s}  # fmt: skip
        return SimpleNamespace(parallel=SimpleNamespace(**node))

    assert settings(par("goodput.parallel.DDP")) == Spares(1, 5.0)
    # hsdp: a dead rank's shard has a replica in the other replica group
    assert settings(par("goodput.parallel.HSDP", nproc=4, collective_s=2.0, shard_size=2)) == Spares(1, 5.0)
    assert "gloo" not in caplog.text
    for target, options in [("goodput.parallel.FSDP", {}), ("goodput.parallel.HSDP", {}),
                            ("goodput.parallel.HSDP", {"shard_size": 4})]:  # fmt: skip
        assert settings(par(target, nproc=4, **options)) is None  # (one replica group: fsdp's layout)
        assert f"not started under parallel.strategy {target} on 4 ranks: no survivor holds" in caplog.text
    # on gloo a survivor waiting on another survivor fails only at the collective timeout: said
    assert settings(par("goodput.parallel.HSDP", nproc=4, collective_s=5.0, shard_size=2)) == Spares(1, 5.0)
    assert "notices the failure only after parallel.collective_timeout_s=5s" in caplog.text
    assert settings(par("goodput.parallel.DDP", nproc=3)) == Spares(1, 5.0)  # a ring waits on neighbours
    assert "on CPU (gloo) with 3 ranks" in caplog.text
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert settings(par("goodput.parallel.DDP")) is None  # srun alone: no store before the group
    assert "not started under this launcher (RANK is set, and no torchrun agent" in caplog.text
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun: hosts on every node
    caplog.clear()
    assert settings(par("goodput.parallel.HSDP", nproc=2, collective_s=2.0, shard_size=2)) == Spares(1, 5.0)
    assert "no survivor holds" not in caplog.text  # 4 ranks over the nodes: 2 replica groups
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")  # two nodes: a lost one is declared after LOST_S
    assert settings(par("goodput.parallel.DDP")) == Spares(1, 5.0)
    assert "recovery_timeout_s=5s is not above that, so its rank always takes the restart path" in caplog.text
    wide = par("goodput.parallel.DDP")
    wide.parallel.recovery_timeout_s = 30.0
    assert settings(wide) == Spares(1, 30.0)
    assert "a node lost without closing its connections (power, network)" in caplog.text
    caplog.clear()
    wide.parallel.collective_timeout_s = 20.0
    settings(wide)
    assert "power, network" not in caplog.text


def test_a_member_that_never_joins_the_new_group_costs_the_bound_not_a_hang(tcp):
    """The survivors form the next generation's group with a spare that died on its way (or any
    member that never comes): joining it fails after parallel.recovery_timeout_s, and the survivor
    falls back (its rescue of the same boundary). A process of its own: the group is process-wide."""
    import subprocess
    import sys

    code = (
        "import sys, time, torch.distributed as dist\n"
        "from datetime import timedelta\n"
        "from goodput.parallel import join_generation\n"
        f"base = dist.TCPStore('127.0.0.1', {tcp.port}, None, False, timeout=timedelta(seconds=30))\n"
        "store = dist.PrefixStore('goodput/restart0/spares/gen1/pg/', base)\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    join_generation(store, 0, 2, 0, 2.0, 60.0)\n"
        "except Exception as e:\n"
        "    print('failed after %.1f s: %s' % (time.monotonic() - t0, type(e).__name__))\n"
        "    sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    took = float(p.stdout.split("failed after ")[1].split(" s")[0])
    assert 1.5 <= took < 10.0
