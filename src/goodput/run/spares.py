"""parallel.spares: warm spare processes, and recovery onto one without a restart.

Under torch's elastic agent a dead worker stops the whole group. So with spares each elastic worker
is a *host* (`host`): a small supervisor that forks the training process of its rank (and, on some
hosts, spare processes) and waits for them. The agent never sees a rank die; the host does, at
once (its child), and decides with the other processes through the agent's store
(goodput.resilience.spares.Roster):

1. Rank r is killed. Its host reports the death. The survivors' collectives fail (gloo raises as
   soon as the peer's socket closes); each reports the step boundary its state stands at
   (Rescue.noted: the last finished step, noted by the loop for rescue checkpoints) and waits.
2. Once all have reported at the same step, the host picks a registered spare, writes the plan
   (generation g+1: the spare takes rank r) and forks a new spare in the background.
3. Survivors put back what the step in flight changed (Rescue.rewind: the loader's position, the
   buffers), leave the broken group without waiting on it and form generation g+1's on the same
   store (goodput.parallel.join_generation); DDP's wrapper moves to it (Strategy.regroup). FSDP2's
   cannot (its DTensors are bound to the old mesh): under hsdp every member builds the model half
   again on the new mesh (Trainer.regroup) and a survivor loads its own boundary state into it.
4. The spare (built, its DataLoader workers forked, DDP's buckets settled, waiting on the store
   without using the CPU) learns rank r and the step, starts decoding that step's batch, joins the
   group, and receives the boundary state from the lowest survivor holding it (Strategy.holders:
   any under ddp, the dead rank's shard peer under hsdp): the same state dict a rescue
   would write (Rescue.state: model with the boundary's buffers, optimizer, EMA, scaler, the
   loader's position, the schedule, the monitors; the ledger), one buffer over the group.
5. Every rank runs the loop again from that step: the step in flight is redone, nothing else.

Anything else falls back to what parallel.spares=0 does: the survivors write a rescue of the same
boundary and exit, the host exits, the agent restarts the group from the rescue (no spare left,
two ranks lost at once, a survivor inside a save, an evaluation or an update, a rank that exited
by its own error or was ended as hung, a spare that dies on the way, any phase past
parallel.recovery_timeout_s). docs/parallelism.md, "In-process recovery onto a spare".
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from goodput.resilience.signals import PREEMPT_SIGNALS
from goodput.resilience.spares import BEAT_S, LOST_S, PHASES, Roster, prefix, record_name

log = logging.getLogger("goodput")

WAIT_S = 3600.0  # a waiting spare's store wait, renewed: one C++ wait, no polling


@dataclass(frozen=True)
class Spares:
    """What the processes of a job with spares need from its config (read here, once)."""

    count: int
    timeout_s: float


def settings(c) -> Spares | None:
    """parallel.spares and parallel.recovery_timeout_s. None: no spares (0), or none can help here
    (said once): under an outside launcher other than torchrun (srun alone has no store the ranks
    share before their group exists), and for a layout where no survivor holds a dead rank's shard
    (fsdp; hsdp with one replica group)."""
    n, timeout_s = c.parallel.spares, c.parallel.recovery_timeout_s
    if not n:
        return None
    if "RANK" in os.environ and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        log.warning("parallel.spares=%d: not started under this launcher (RANK is set, and no torchrun agent "
                    "shares its store); failures take the rescue and restart path", n)  # fmt: skip
        return None
    from hydra.utils import instantiate

    target = c.parallel.strategy["_target_"]
    world = int(os.environ.get("WORLD_SIZE", c.parallel.nproc_per_node))  # (torchrun: all its nodes')
    strategy = instantiate(c.parallel.strategy)
    if not any(strategy.holders(r, world) for r in range(world)):
        log.warning("parallel.spares=%d: not started under parallel.strategy %s on %d ranks: no survivor "
                    "holds a dead rank's shard; failures take the rescue and restart path",
                    n, target, world)  # fmt: skip
        return None
    collective_s = c.parallel.collective_timeout_s
    if world > 2 and collective_s >= timeout_s and not torch.cuda.is_available():
        log.warning(
            "parallel.spares=%d on CPU (gloo) with %d ranks: a survivor whose collective waits on another "
            "survivor, not on the dead rank, notices the failure only after "
            "parallel.collective_timeout_s=%gs "
            "(a gloo collective cannot be aborted); not below parallel.recovery_timeout_s=%gs, such a "
            "recovery falls back to the restart. Lower parallel.collective_timeout_s (above the slowest "
            "step) to keep it in-process", n, world, collective_s, timeout_s,
        )  # fmt: skip
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:  # torchrun on several nodes
        if timeout_s <= LOST_S:
            log.warning(
                "parallel.spares=%d on several nodes: a lost node is declared lost after %gs without its "
                "heartbeat; parallel.recovery_timeout_s=%gs is not above that, so its rank always takes the "
                "restart path", n, LOST_S, timeout_s,
            )  # fmt: skip
        elif collective_s >= timeout_s - LOST_S and not torch.cuda.is_available():
            log.warning(
                "parallel.spares=%d on several nodes on CPU (gloo): a node lost without closing its "
                "connections (power, network) is noticed by a survivor's collective only after "
                "parallel.collective_timeout_s=%gs (a gloo collective cannot be aborted), not within "
                "parallel.recovery_timeout_s=%gs less the %gs a lost node takes to be declared: such a loss "
                "takes the restart path", n, collective_s, timeout_s, LOST_S,
            )  # fmt: skip
    return Spares(n, timeout_s)


def connect(timeout_s: float):
    """This process's own connection to the job's store (the elastic agent's), under the spares'
    prefix for this restart round. A connection is used by one thread at a time."""
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    base = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=max(timeout_s, 60.0)))
    return dist.PrefixStore(_prefix(), base), base


def _prefix() -> str:
    from goodput.parallel import ROUND_ENV
    from goodput.resilience.accounting import restart_round

    return prefix(int(os.environ.get(ROUND_ENV, restart_round())))  # (ROUND_ENV: set by the host)


# -- the host: one elastic worker, its children -------------------------------------------------
@dataclass
class Child:
    pid: int
    member: int
    rank: int | None  # None: a spare (until it says which rank it became)
    pipe: int  # read end: the child writes "rank <r>" when it takes a rank's place

    def rank_now(self) -> int | None:
        try:
            os.set_blocking(self.pipe, False)
            data = os.read(self.pipe, 4096)
        except (BlockingIOError, OSError):
            data = b""
        for line in data.decode(errors="replace").split("\n"):
            if line.startswith("rank "):
                self.rank = int(line[5:])
        return self.rank


class Host:
    """One elastic worker with spares: the training process of its rank and `spares` spare
    processes, each forked from here and waited for. Returns (or exits with) what they leave: 0 when
    the run ended (the summary if its rank-0 process ran here), else the status of the process
    that failed, so that the agent restarts the group as it would have."""

    def __init__(self, c, ctx, s: Spares, rank: int, world: int, local_rank: int, local_world: int):
        self.c, self.ctx, self.s = c, ctx, s
        self.rank, self.world, self.local_rank, self.local_world = rank, world, local_rank, local_world
        self.store, self._base = connect(s.timeout_s)
        self.roster = Roster(self.store, world, s.timeout_s)
        from hydra.utils import instantiate

        self.strategy = instantiate(c.parallel.strategy)  # who holds a dead rank's state (no groups made)
        self.children: dict[int, Child] = {}
        self.stopping = False
        self.status, self.summary = 0, None
        self._spare_slot = 0
        self.id = rank  # hosts are numbered by the rank they start with (a ring of `world` hosts)
        self._forking = threading.Lock()  # a fork and its entry in `children`, against the wait loop
        self._done = threading.Event()

    def start(self, rank: int | None, after: str | None = None, roster: Roster | None = None) -> None:
        """Fork one child: the process of `rank`, or a spare (None); one that replaces a spare taken
        builds `after` that key is in the store (the taken spare's first step: the build would take
        the CPU from the recovery). `roster`: the calling thread's (a store connection per thread)."""
        with self._forking:
            self._fork(rank, after, roster or self.roster)

    def _fork(self, rank: int | None, after: str | None, roster: Roster) -> None:
        member = roster.member()
        if rank is None:
            roster.place_spare(member, self.id)
        else:
            roster.place_rank(rank, self.id)
        r, w = os.pipe()
        local = self.local_rank if rank is not None else self.local_world + self._spare_slot
        if rank is None:
            self._spare_slot += 1
        old = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPT_SIGNALS)  # no handler of ours in the child
        pid = os.fork()
        if pid == 0:
            os.close(r)
            for sig in PREEMPT_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
            code = 1
            try:
                code = _child(self.c, self.ctx, self.s, rank, member, w, self.world, local, after)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                for h in logging.getLogger().handlers:
                    h.flush()
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        os.close(w)
        self.children[pid] = Child(pid, member, rank, r)

    def _forward(self, signum, frame) -> None:
        self.stopping = True  # a notice, or the agent stopping the group: no recovery from now on
        for pid in list(self.children):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def _fail(self, status: int, why: str) -> None:
        """Fall back: the agent restarts the group (it sees this worker fail), the others stop."""
        if not self.status:
            self.status = status
            log.warning("%s: the group restarts (the rescue and restart path)", why)
            try:  # the error file the agent reports (what torch's @record leaves)
                from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

                ErrorHandler().record_exception(RuntimeError(why))
            except Exception:
                pass
        self._forward(signal.SIGTERM, None)

    def run(self) -> dict | None:
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._forward)
        self.start(self.rank)
        for _ in range(self.local_rank, self.s.count, self.local_world):  # a node's spares over its hosts
            self.start(None)
        for target, name in ((self._beat, "host-beat"), (self._watch_hosts, "host-watch")):
            threading.Thread(target=target, name=name, daemon=True).start()
        while self.children:
            pid, st = os.waitpid(-1, 0)
            with self._forking:  # (a fork on the watcher's thread: its entry is made first)
                child = self.children.pop(pid, None)
            if child is not None:
                self._ended(child, st)
                os.close(child.pipe)
        self._done.set()
        try:
            self.roster.leave(self.id)
        except Exception:  # (the store's host is gone with its node: nothing is watched any more)
            pass
        if not self.status and self.stopping and not self._ended_normally():
            self.status = 1  # the agent tears the group down (another worker failed): not a return
        if self.status:  # (a worker that returns waits for the agent to read its value: it never does here)
            for h in logging.getLogger().handlers:
                h.flush()
            os._exit(self.status)
        return self.summary

    # -- the hosts watch each other: a lost node records no deaths of its own ----------------------
    def _beat(self) -> None:
        """This host's heartbeat, and its fence: a host declared lost (it stalled past LOST_S) ends
        its processes at once, the ranks the others are replacing among them. So does a host that
        loses the store while the run is on: silent, it is declared lost by the others."""
        store, _ = connect(self.s.timeout_s)
        roster = Roster(store, self.world, self.s.timeout_s)
        over = False
        while not self._done.wait(BEAT_S):
            try:
                roster.beat(self.id)
                lost = roster.lost(self.id)
                over = over or roster.closed()
            except Exception as e:
                if over:  # the store's node ended its part after the run: nothing to beat for
                    return
                lost = f"the store is unreachable ({_short(e)})"
            if lost:
                why = lost if isinstance(lost, str) else f"its heartbeat stood still {LOST_S:g}s"
                log.error("host %d was declared lost (%s): ending its processes", self.id, why)
                self._end_children()
                os._exit(1)

    def _end_children(self) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for h in logging.getLogger().handlers:
            h.flush()

    def _watch_hosts(self) -> None:
        """The next host in the ring: when its heartbeat stands still for LOST_S, its node is lost.
        The first host to see it records the deaths of the ranks it held and decides in its place
        (its spares are never handed out); a new spare is started here. This thread never ends
        while the host has children: a child forked here dies with it (PR_SET_PDEATHSIG, which the
        training processes set, fires when the forking *thread* ends), so errors are retried."""
        store, _ = connect(self.s.timeout_s)
        roster = Roster(store, self.world, self.s.timeout_s)
        seen: dict[int, tuple[int, float]] = {}  # a host's last count, and since when
        while not self._done.wait(BEAT_S):
            try:
                if self.stopping or roster.closed():
                    continue
                w = roster.watched(self.id, self.world)
                n = roster.beats(w) if w is not None else 0
                now = time.monotonic()
                if w is None or n == 0 or seen.get(w, (None,))[0] != n:  # (0: not started yet)
                    seen[w] = (n, now)
                    continue
                if now - seen[w][1] >= LOST_S and roster.declare_lost(w, self.id):
                    self._host_lost(roster, w, now - seen[w][1])
            except Exception as e:  # (the store's node is gone: the beat thread fences this host)
                log.warning("host %d: watching the next host failed: %s", self.id, _short(e))
                seen.clear()

    def _host_lost(self, roster: Roster, w: int, silent_s: float) -> None:
        detected = time.time()
        gen = roster.generation()
        ranks = roster.ranks_of(w)
        cause = f"node lost: host {w}'s heartbeat stood still {silent_s:.1f}s"
        log.warning("host %d: host %d is lost (ranks %s with it; seen %.1fs without a heartbeat)", self.id, w,
                    ranks, silent_s)  # fmt: skip
        if not ranks:  # spares only: they are gone with it, never handed out
            return
        if max(roster.death(gen, r, cause) for r in ranks) > 1:
            decision = roster.abort(gen, "two ranks lost at once")
        else:
            holders = self.strategy.holders(ranks[0], self.world)
            decision = roster.decide(gen, ranks[0], cause, detected, holders)
        plan = decision.get("plan")
        if plan is not None and plan["gen"] == gen + 1:
            if not self.stopping:  # the next spare
                self.start(None, after=f"gen{plan['gen']}/mark/loader_ready/{plan['rank']}", roster=roster)
            return
        log.warning("ranks %s lost with host %d; no in-process recovery: %s", ranks, w, decision.get("abort"))

    def _ended_normally(self) -> bool:
        """After a stop signal, with every child gone without an error: did the run end (a notice:
        rank 0 closed it after its checkpoint), or is the agent tearing the group down? Asked of
        the store, at most parallel.recovery_timeout_s (the abort of a fallback answers at once)."""
        deadline = time.monotonic() + self.s.timeout_s
        while time.monotonic() < deadline:
            if self.roster.closed():
                return True
            if "abort" in self.roster.decision(self.roster.generation()):
                return False
            time.sleep(0.05)
        return False

    def _ended(self, child: Child, st: int) -> None:
        rank = child.rank_now()
        sig = os.WTERMSIG(st) if os.WIFSIGNALED(st) else None
        code = os.WEXITSTATUS(st) if os.WIFEXITED(st) else 128 + (sig or 0)
        if rank is None:  # a spare that waited
            if sig is None and code == 0:
                return  # told to exit: the run is over, or stopping
            self.roster.gone(child.member)
            if sig is not None and not self.stopping:
                log.warning("spare %d died (%s): starting another", child.member, signal.Signals(sig).name)
                self.start(None)
            elif sig is None:  # its own error (its log says which): the ranks train on, one spare fewer
                log.warning("spare %d failed (exit status %d): not replaced", child.member, code)
            return
        if sig is None:  # the rank ended: the run's end (0), or its own failure (a rescue is written)
            if code == 0:
                if rank == 0:
                    self.summary = _read_summary(self.ctx.run_dir)
                return
            if not self.stopping:
                self.roster.abort(self.roster.generation(), f"rank {rank} exited with status {code}")
            self._fail(code, f"rank {rank} exited with status {code}")
            return
        cause = signal.Signals(sig).name
        if self.stopping:
            self._fail(code, f"rank {rank} was ended by {cause} while the job stops")
            return
        detected = time.time()
        gen = self.roster.generation()
        if self.roster.death(gen, rank, cause) > 1:
            decision = self.roster.abort(gen, "two ranks lost at once")
        else:
            decision = self.roster.decide(gen, rank, cause, detected, self.strategy.holders(rank, self.world))
        plan = decision.get("plan")
        if plan is not None and plan["rank"] == rank and plan["gen"] == gen + 1:
            self.start(None, after=f"gen{plan['gen']}/mark/loader_ready/{rank}")  # the next spare
            return
        self._fail(code, f"rank {rank} died ({cause}); no in-process recovery: {decision.get('abort')}")


def _read_summary(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def host(c, ctx, s: Spares) -> dict | None:
    """The elastic worker's function with spares (goodput.run.launch)."""
    from goodput import logs

    env = os.environ
    logs.setup(f"host{env['RANK']}")  # (its children set their own: a rank's, a spare's)
    if int(env.get("GROUP_WORLD_SIZE", "1")) > 1:  # several nodes: the round every host agrees on
        import torch.distributed as dist

        from goodput.parallel import ROUND_ENV, agree_round

        bound = c.parallel.init_timeout_s
        base = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), None, False,
                             timeout=timedelta(seconds=bound))  # fmt: skip
        env[ROUND_ENV] = str(agree_round(base, int(env["RANK"]), int(env["WORLD_SIZE"]), bound))
    h = Host(c, ctx, s, int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
             int(env["LOCAL_WORLD_SIZE"]))  # fmt: skip
    return h.run()


def under_agent(c, ctx, s: Spares, preload) -> dict | None:
    """A torchrun worker with spares: the host of its rank runs in a process of its own, forked from
    a clean forkserver (this process ran the job's preparation: on rank 0 it holds the run lock, its
    heartbeat thread, the MLflow run; its children must not inherit that). This one waits for it,
    passes on the stop signals, and fails as the host did, so that the agent restarts as before.
    `preload`: what the forkserver imports before it forks (goodput.run.launch.preload_forkserver)."""
    import multiprocessing

    preload()
    mp = multiprocessing.get_context("forkserver")
    reader, writer = mp.Pipe(duplex=False)
    p = mp.Process(target=_hosted, args=(c, ctx, s, writer), name=f"goodput-host{os.environ['RANK']}")
    p.start()
    writer.close()

    def forward(signum, frame) -> None:
        try:
            os.kill(p.pid, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in PREEMPT_SIGNALS}
    try:
        return _result(p, reader, os.environ["RANK"])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class HostFailed(RuntimeError):
    pass


def _result(p, reader, rank: str) -> dict | None:
    """What the host process `p` sent on `reader` once it ended: its summary (None: not rank 0's
    host), or HostFailed with its exit status (a host that fails exits without sending)."""
    try:
        summary = reader.recv()
    except (EOFError, OSError):
        summary = None
    p.join()
    if p.exitcode:
        raise HostFailed(f"the host of rank {rank} ended with status {p.exitcode} (its log says why); "
                         "the agent restarts the group from the rescue")  # fmt: skip
    return summary


def _hosted(c, ctx, s: Spares, conn) -> None:
    from goodput.data.loader import die_with_parent

    die_with_parent(0)  # the agent stopping its worker stops the host (and the host its children)
    summary = host(c, ctx, s)  # (a host that fails exits with the status here)
    conn.send(summary)
    conn.close()


def _child(
    c, ctx, s: Spares, rank: int | None, member: int, pipe: int, world: int, local_rank: int, after=None
) -> int:
    from goodput.data.loader import die_with_parent
    from goodput.run.worker import worker

    die_with_parent(0)  # a host killed by the agent takes its children with it
    if rank is None:  # a spare: a process group of its own until it takes a rank's place
        for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE"):
            os.environ.pop(k, None)
        os.environ["LOCAL_RANK"] = str(local_rank)
        if torch.cuda.is_available():  # a device of its own, after the ranks' (nproc_per_node + i)
            torch.cuda.set_device(local_rank)
    if torch.cuda.is_available():  # a failed NCCL collective is ours to abort, not the watchdog's to end
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    worker(c, ctx, Member(s, member, pipe, world, waiting=rank is None, after=after))
    return 0


# -- a process's side: a rank that recovers, or a spare --------------------------------------------
class Member:
    """parallel.spares' side of one training process (goodput.run.worker): a rank whose loop
    recovers onto a spare when a peer dies (`attach`, `train`), or a spare (`waiting`) that builds,
    waits, and takes a dead rank's place (`take_place`)."""

    def __init__(
        self, s: Spares, member: int, pipe: int, world: int, waiting: bool, after: str | None = None
    ):
        self.s, self.member, self.pipe, self.world, self.waiting = s, member, pipe, world, waiting
        self.after = after  # a spare that replaces a taken one: the key it builds after
        self.name = f"spare{member}"
        self.store, self._base = connect(s.timeout_s)
        self.roster = Roster(self.store, world, s.timeout_s)
        self.gen = 0
        self._recording: threading.Thread | None = None

    # -- a rank ---------------------------------------------------------------------------------
    def attach(self, t) -> None:
        """A rank, once it is ready to train (a spare: once it took a rank's place)."""
        t.loader.keep_last = True  # the step in flight's batch, delivered again after a recovery
        threading.Thread(target=self._watch, args=(t,), name="spares-watch", daemon=True).start()

    def _watch(self, t) -> None:
        """A death in this rank's generation, seen in the store as soon as its host reports it
        (one C++ wait, no CPU meanwhile). A rank inside a save or an evaluation has no collective
        that fails soon: it reports that at once, so that the decider falls back at once instead of
        waiting out parallel.recovery_timeout_s. On CUDA the rank's communicators are aborted: a
        collective with a dead NCCL peer waits (it does not fail as gloo's does), and the abort
        makes it fail, so the main thread recovers (written for NCCL, not run on a GPU here)."""
        store, _ = connect(self.s.timeout_s)
        roster = Roster(store, self.world, self.s.timeout_s)
        while True:
            gen = self.gen
            try:
                store.wait([f"gen{gen}/dead"], timedelta(seconds=WAIT_S))
            except RuntimeError:  # the wait timed out: wait again
                continue
            if self.gen != gen:
                continue
            _, why = t.rescue.noted()  # (inside an update: the main thread reaches its boundary soon)
            if t.ckpt.saving():
                why = "inside a checkpoint save"
            busy = why if why and "update" not in why else None
            if busy is not None:
                roster.report(gen, t.dist.rank, None, busy)
            elif torch.cuda.is_available():
                import torch.distributed as dist

                dist.distributed_c10d._abort_process_group()
            try:  # this generation's decision; after a plan, the next generation is watched
                store.wait([f"gen{gen}/decision"], timedelta(seconds=3 * self.s.timeout_s))
                decided = json.loads(store.get(f"gen{gen}/decision"))
            except (RuntimeError, ValueError):
                return
            deadline = time.monotonic() + 3 * self.s.timeout_s
            while "plan" in decided and self.gen == gen and time.monotonic() < deadline:
                time.sleep(0.05)  # the main thread joins the next generation
            if self.gen == gen:
                return  # an abort: the process falls back and ends

    def train(self, t, train):
        """`train(t)` (the loop), run again from the boundary after each in-process recovery."""
        while True:
            try:
                return train(t)
            except Exception as e:
                if not self.recover(t, e):
                    raise

    def recover(self, t, e: Exception) -> bool:
        """A survivor's side of a peer's death (the module's docstring). False: fall back."""
        if not _peer_lost(e):  # this rank's own error: not a spare's to fix
            return False
        detected = time.time()
        rank, gen = t.dist.rank, self.gen
        step, why = t.rescue.noted()
        if step is not None and t.ckpt.saving():
            step, why = None, "inside a checkpoint save"
        log.warning("rank %d: a peer is lost (%s); this rank stands %s", rank, _short(e),
                    f"at the end of step {step}" if step is not None else why)  # fmt: skip
        self.roster.report(gen, rank, step, why)
        self.roster.mark(gen + 1, "detected", rank, detected)
        with t.watchdog.phase("in-process recovery"):
            decision = self.roster.await_decision(gen)
            if "abort" in decision:
                log.warning("rank %d: no in-process recovery (%s)", rank, decision["abort"])
                return False
            plan = decision["plan"]
            if plan["rank"] == rank:  # this rank's host was declared lost (a stall): its fence ends it
                log.warning("rank %d: declared lost with its host; a spare takes its place", rank)
                return False
            traceback.clear_frames(e.__traceback__)  # the failed step's tensors: not kept (its text is)
            try:
                t.rescue.rewind()  # what the step in flight changed (its batch is delivered again)
                # the boundary state, taken while the old model stands (a rebuild replaces it)
                keep = t.regroups_in_place
                state = t.rescue.state(plan["step"]) if rank == plan["sender"] or not keep else None
                rebuilt = self._join(t, plan, rank, t.dist.local_rank, t.dist.init_timeout_s)
                if rebuilt:  # built again on the new mesh: this rank's own boundary state goes back in
                    t.app.apply(on_mesh(state, _mesh(t)), StateDictOptions(), plan["step"])
                    t.rescue.boundary(plan["step"])  # a failure from here on still rescues it
                if rank == plan["sender"]:
                    header = {"step": plan["step"], "attempt": t.goodput.restarts,
                              "in_process": t.goodput.in_process + 1,
                              "ctx": [t.ctx.mlflow_run_id, t.ctx.run_dir, t.ctx.lock_token]}  # fmt: skip
                    send_state(state, header, plan["rank"])
            except Exception as err:
                log.warning("rank %d: in-process recovery failed: %r", rank, err)
                return False
        t.goodput.in_process += 1
        t.goodput.after_recovery = functools.partial(self._first_step, t, plan)
        return True

    def _join(self, t, plan: dict, rank: int, local_rank: int, init_timeout_s: float) -> bool:
        """Generation plan["gen"]'s process groups, as `rank`; the Trainer moved onto them. True:
        its model half was built again there (Trainer.regroup), with no state in it yet."""
        import torch.distributed as dist

        from goodput.parallel import join_generation

        store = dist.PrefixStore(f"{_prefix()}gen{plan['gen']}/pg/", self._base)
        d = join_generation(store, rank, plan["world"], local_rank, self.s.timeout_s, init_timeout_s)
        rebuilt = t.regroup(d)
        self.gen = plan["gen"]
        self.roster.mark(self.gen, "group_rebuilt", rank)
        return rebuilt

    # -- a spare --------------------------------------------------------------------------------
    def take_place(self, c, ctx, d, stop):
        """A spare's life: build for a provisional rank, settle, wait; on a plan, become its rank
        (the Trainer, at the boundary the survivors stand at). None: told to exit, or a notice."""
        from goodput import logs
        from goodput.parallel import Dist
        from goodput.resilience.recovery import Recovery
        from goodput.run.build import Trainer
        from goodput.run.worker import arm_faults

        if self.after is not None and self._wait_for(self.after, stop, self.s.timeout_s) is None:
            return None  # a notice meanwhile
        t0 = time.time()
        provisional = Dist(self.world - 1, self.world, d.local_rank, d.device, d.ckpt_pg, d.init_timeout_s)
        t = Trainer(c, ctx, provisional, Recovery(), unsharded=True)  # (sharded once it joins: regroup)
        try:
            t.loader.keep_last = True
            # a stand-in of one micro-batch: its first forward and backward (allocations, kernels
            # picked) are not paid by the first step it takes part in
            size, per_rank = t.loader.dataset.image_size, t.loader.order.global_batch_size // self.world
            x = torch.zeros(max(2, per_rank // t.step.n_micro), 3, size, size, device=d.device)
            if t.step.opts.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)

            def forward():
                with t.step.autocast():
                    return t.model(x)

            t.step.strategy.ready_spare(t.model, forward)
            t.loader.park()  # the DataLoader workers forked now, their position unset
            if self.roster.register(self.member):
                log.info("%s (pid %d) ready in %.2fs: waiting to take a rank's place", self.name, os.getpid(),
                         time.time() - t0)  # fmt: skip
                plan = self._wait_for(Roster.assignment(self.member), stop, WAIT_S, renew=True)
            else:
                plan = None
        except BaseException:
            t.close()
            raise
        if plan is None or "exit" in plan:
            t.close()
            return None
        r, step = plan["rank"], plan["step"]
        os.write(self.pipe, f"rank {r}\n".encode())  # the host: this process is rank r now
        self.waiting = False
        t.loader.rank = r
        # the step in flight's batch is made while the group forms and the state comes (the
        # parked workers' restart waits on each of them: on busy cores, a tenth of a second)
        starting = threading.Thread(target=t.loader.start_at, args=(step,), name="spare-loader", daemon=True)
        starting.start()
        self._join(t, plan, r, d.local_rank, d.init_timeout_s)
        logs.setup(r, ctx.run_dir)
        if r != 0:  # rank hygiene, as every rank's (worker._rank0_view)
            logging.getLogger().setLevel(logging.WARNING)
        sd, header = recv_state(plan["sender"], _mesh(t))
        starting.join()  # before the loader's state is set
        mlflow_run_id, run_dir, lock_token = header["ctx"]
        t.ctx = t.ctx.with_rank0(mlflow_run_id, run_dir, lock_token)
        t.app.apply(sd, StateDictOptions(), step)
        self.roster.mark(self.gen, "state_sent", r)
        g = t.goodput
        g.restarts, g.in_process = header["attempt"], header["in_process"]
        g.recovery.mark("first_step")  # this process's own start-up is not a restart's to record
        if r == 0:
            _continue_attempt_record(g)
        t.watchdog.attempt = g.restarts
        t.watchdog.doing(f"its first step as rank {r}")  # (the wait is not a step's: the clock starts now)
        t.watchdog.start()
        t.stop = stop.rescuing(t.rescue.request)
        arm_faults(t, g.restarts + g.in_process)
        g.after_recovery = functools.partial(self._first_step, t, plan)
        self.attach(t)
        log.warning("spare %d is rank %d now, at step %d (%.2fs since the plan)", self.member, r, step,
                    time.time() - plan["detected"])  # fmt: skip
        return t

    def _wait_for(self, key: str, stop, timeout_s: float, renew: bool = False) -> dict | None:
        """The store's value at `key` (a JSON object; {} for another value, or when `timeout_s`
        passed without `renew`), or None on a preemption notice. The store wait is one C++ call on
        a thread of its own with a connection of its own (no CPU while it waits); this thread
        looks at the notice once a second."""
        box: dict = {}
        store, _ = connect(self.s.timeout_s)

        def wait() -> None:
            while "value" not in box:
                try:
                    store.wait([key], timedelta(seconds=timeout_s))
                except RuntimeError:  # the wait timed out
                    if renew:
                        continue
                    box["value"] = b"{}"
                    return
                box["value"] = store.get(key)

        th = threading.Thread(target=wait, name="spare-wait", daemon=True)
        th.start()
        while th.is_alive():
            th.join(1.0)
            if stop.received:
                log.info("%s: %s while waiting: exiting", self.name, stop.received)
                return None
        try:
            value = json.loads(box["value"])
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    # -- after the first step -------------------------------------------------------------------
    def _first_step(self, t, plan: dict, step: int) -> None:
        rank = t.dist.rank
        if rank == plan["rank"]:  # the spare: when its first batch was there
            self.roster.mark(plan["gen"], "loader_ready", rank, t.loader.first_delivery)
        if rank == 0:
            first = time.time()
            self._recording = threading.Thread(
                target=self._record, args=(t, plan, first), name="recovery-record", daemon=True
            )
            self._recording.start()

    def _record(self, t, plan: dict, first: float) -> None:
        """Rank 0, after the first step: the recovery's record beside the checkpoints, in MLflow,
        and one log line naming the dead rank and the spare (its own store connection: a thread)."""
        try:
            store, _ = connect(self.s.timeout_s)
            roster = Roster(store, self.world, self.s.timeout_s)
            gen, r = plan["gen"], plan["rank"]
            store.wait([f"gen{gen}/mark/loader_ready/{r}"], timedelta(seconds=10))
            ranks = range(plan["world"])
            at = {"detected": min([plan["detected"], *roster.marks(gen, "detected", ranks)])}
            at["group_rebuilt"] = max(roster.marks(gen, "group_rebuilt", ranks))
            at["state_sent"] = roster.marks(gen, "state_sent", [r])[0]
            at["loader_ready"] = roster.marks(gen, "loader_ready", [r])[0]
            at["first_step"] = first
            since = at["detected"] - 60.0  # the drill's kill marker of this rank, just before
            kills = [m["time"] for m in t.faults.fired().values()
                     if m.get("rank") == r and since <= m.get("time", 0) <= at["detected"]]  # fmt: skip
            at["failure"], source = (max(kills), "fault_marker") if kills else (at["detected"], "detected")
            known = [p for p in PHASES if p in at]
            n, attempt = t.goodput.in_process, t.goodput.restarts
            rec = {
                "kind": "in_process", "attempt": attempt, "n": n, "dead_rank": r, "spare": plan["spare"],
                "sender": plan["sender"], "step": plan["step"], "cause": plan["cause"],
                "lost_steps": 0,  # the survivors stood at the last finished step: only the one in flight
                "failure_source": source, "at": {p: round(at[p], 4) for p in known},
                "seconds": {b: round(at[b] - at[a], 4) for a, b in zip(known, known[1:])},
                "total_seconds": round(first - at["failure"], 4),
            }  # fmt: skip
            t.ckpt_store.write_bytes(record_name(attempt, n), json.dumps(rec).encode())
            metrics = {f"recovery/{k}_seconds": v for k, v in rec["seconds"].items()}
            metrics["recovery/total_seconds"] = rec["total_seconds"]
            t.tracker.log(metrics, attempt + n)
            t.tracker.set_tags({f"recovery.{n}.replaced": f"rank {r} by spare {plan['spare']}"})
            log.warning(
                "in-process recovery %d: rank %d died (%s), spare %d took its place at step %d with the "
                "state of rank %d: %.2fs from the failure to the first step (%s)", n, r, plan["cause"],
                plan["spare"], plan["step"], plan["sender"], rec["total_seconds"], json.dumps(rec["seconds"]),
            )  # fmt: skip
        except Exception as e:  # measuring must never stop training
            log.warning("could not record the in-process recovery: %r", e)

    def finish(self, t) -> None:
        """The end of the run: the last record written; rank 0 tells the waiting spares to exit."""
        if self._recording is not None:
            self._recording.join(timeout=15.0)
        if t.dist.rank == 0:
            try:
                self.roster.close("the run is over")
            except Exception as e:
                log.warning("could not tell the spares to exit: %r", e)


def _continue_attempt_record(g) -> None:
    """A spare that became rank 0 writes the attempt's record from now on (its heartbeat, the
    summary): the one rank 0 wrote so far, read back."""
    from goodput.resilience.accounting import check_attempt

    name = f"{g.restarts:04d}.json"
    g.attempts.path = f"attempts/{name}"
    g.attempts.record = check_attempt(g.attempts.storage.read_bytes(g.attempts.path), name, g.restarts)


def _peer_lost(e: BaseException) -> bool:
    """The error of a collective whose peer is gone (gloo: its socket closed; a store wait), not
    this rank's own (a bad batch, out of memory)."""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or any(
        s in text for s in ("gloo/transport", "Connection closed by peer", "Connection reset by peer")
    )


def _short(e: BaseException) -> str:
    text = str(e).strip().split("\n")[0]
    return f"{type(e).__name__}: {text[:160]}"


# -- the state, over the group --------------------------------------------------------------------
ALIGN = 16  # each tensor starts at a multiple of this in the buffer (a view as its dtype needs it)


def _flatten(tree: dict, path: tuple = ()):
    for k, v in tree.items():
        if isinstance(v, dict):
            if not v:
                yield (*path, k), None  # an empty part (the optimizer's state before its first step)
            yield from _flatten(v, (*path, k))
        else:
            yield (*path, k), v


def _mesh(t):
    """The device mesh the Trainer's strategy shards over (None: it shards nothing)."""
    strategy = t.step.strategy
    return strategy.device_mesh(t.dist) if strategy.shards_parameters else None


def _layout(x) -> list | None:
    """How a DTensor lies on its mesh, as JSON: [placements, global shape, stride]; None for a
    plain tensor. Placements: "R" (replicated), "S<dim>" (sharded on dim), what FSDP2 makes."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(x, DTensor):
        return None
    places = []
    for p in x.placements:
        if type(p) is Shard:
            places.append(f"S{p.dim}")
        elif isinstance(p, Replicate):
            places.append("R")
        else:  # (a partial sum, a strided shard: not a parameter's or an optimizer state's layout)
            raise ValueError(f"a DTensor placed {p!r}: not one a spare can take over")
    return [places, list(x.shape), list(x.stride())]


def _place(local: torch.Tensor, layout: list, mesh):
    """`local`, this rank's shard, as the DTensor `layout` (see _layout) describes, on `mesh`."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    places, shape, stride = layout
    if mesh is None or len(places) != mesh.ndim:
        raise ValueError(f"a shard laid out {places} cannot go on the mesh {mesh}")
    placements = [Replicate() if p == "R" else Shard(int(p[1:])) for p in places]
    if local.device.type != mesh.device_type:  # (CUDA: this rank's device, set as the current one)
        cuda = mesh.device_type == "cuda"
        local = local.to(torch.device("cuda", torch.cuda.current_device()) if cuda else mesh.device_type)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=tuple(stride))  # fmt: skip


def on_mesh(sd: dict, mesh) -> dict:
    """`sd` with each DTensor's shard placed on `mesh` the way it lay on its own (a survivor's
    boundary state, noted on the mesh of the groups that just ended, loaded into the model built
    again on the new one). Plain tensors are kept."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = on_mesh(v, mesh)
        else:
            layout = _layout(v) if torch.is_tensor(v) else None
            out[k] = v if layout is None else _place(v.to_local(), layout, mesh)
    return out


def send_state(sd: dict, header: dict, dst: int) -> None:
    """`sd` (a state dict of tensors, nested dicts) and `header` (JSON) to rank `dst`: sizes, the
    header with where each tensor sits, then one buffer of every tensor's bytes. No pickle: the
    receiver rebuilds tensors from the header's dtypes and shapes. A DTensor travels as this rank's
    shard and its layout (the receiver holds the same shard: the sender is its replica)."""
    import torch.distributed as dist

    entries, parts, offset = [], [], 0
    for path, t in _flatten(sd):
        if t is None:
            entries.append([list(path), None, None, 0, 0, None])
            continue
        layout = _layout(t)
        if layout is not None:
            t = t.to_local()
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        pad = -offset % ALIGN
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8))
            offset += pad
        entries.append([list(path), str(t.dtype).removeprefix("torch."), list(t.shape), offset, raw.numel(),
                        layout])  # fmt: skip
        parts.append(raw)
        offset += raw.numel()
    meta = json.dumps({**header, "entries": entries}).encode()
    buf = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    dist.send(torch.tensor([len(meta), buf.numel()], dtype=torch.int64), dst)
    dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), dst)
    dist.send(buf, dst)


def recv_state(src: int, mesh=None) -> tuple[dict, dict]:
    """What send_state sent from rank `src`: (the state dict, the header); a DTensor's shard placed
    on `mesh`, this rank's."""
    import torch.distributed as dist

    sizes = torch.zeros(2, dtype=torch.int64)
    dist.recv(sizes, src)
    meta = torch.zeros(int(sizes[0]), dtype=torch.uint8)
    dist.recv(meta, src)
    header = json.loads(bytes(meta.numpy()).decode())
    buf = torch.zeros(int(sizes[1]), dtype=torch.uint8)
    dist.recv(buf, src)
    sd: dict = {}
    for path, dtype, shape, offset, n, layout in header.pop("entries"):
        node = sd
        for k in path[:-1]:
            node = node.setdefault(k, {})
        if dtype is None:
            node.setdefault(path[-1], {})
            continue
        kind = getattr(torch, dtype, None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"state from rank {src}: {dtype!r} is not a torch dtype")
        # a storage of its own per tensor: what the optimizer keeps must not be a view into one shared
        # buffer (DCP's async stager, copying storages, then fails on the spare's first save)
        local = buf[offset : offset + n].clone().view(kind).reshape(shape)
        node[path[-1]] = local if layout is None else _place(local, layout, mesh)
    return sd, header
