"""Process groups and model wrapping. One class per `parallel=` option; the loop sees a plain module.

A run always has a process group, even with one process (a 1-rank gloo group on an in-memory
store), so checkpointing and metrics use one code path for every world size.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

from goodput.resilience.accounting import restart_round

if TYPE_CHECKING:
    import torch
    from torch import nn

# torch is imported where it is used: ParallelConfig, the schema below, is imported whenever Hydra
# composes the config (`--help`, the compose API), which must not pay seconds for torch.

log = logging.getLogger(__name__)


# What torchrun, the elastic agent and srun wrappers set: a process that sees them joins that world
# (init_distributed would wait for peers). A child that must start its own world gets an env without them.
LAUNCHER_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
)  # fmt: skip


def without_launcher_env(env=None, *also: str) -> dict:
    """A copy of `env` (default: os.environ) without the launcher's variables and the names in `also`."""
    drop = set(LAUNCHER_ENV) | set(also)
    return {k: v for k, v in (os.environ if env is None else env).items() if k not in drop}


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    ckpt_pg: object  # gloo group used only by checkpoint collectives (async saves run on it)
    init_timeout_s: float = 600.0  # the bound on collectives until the first step is done
    start_timeout_s: float | None = None  # the training groups' bound until then, where it is not
    # init_timeout_s (a generation joined after a failure: parallel.recovery_timeout_s)

    @property
    def group_timeout(self) -> timedelta:
        """The bound a training group made now gets, until the first step (set_collective_timeout)."""
        return timedelta(seconds=self.start_timeout_s or self.init_timeout_s)


def init_distributed(timeout_s: float = 600, trace_dir: str | None = None) -> Dist:
    """The job's process groups, every collective bounded by `timeout_s` (rendezvous, restore and
    the first step are slow; `set_collective_timeout` shortens it once training runs). On CUDA,
    NCCL's Flight Recorder keeps the last collectives of each rank and, when one times out, dumps
    them to `<trace_dir>/rank_<r>` (read them with `python -m torch.distributed.flight_recorder.fr_trace`)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda and trace_dir:
        flight_recorder_env(trace_dir)
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if cuda:
            torch.cuda.set_device(local_rank)
        # NCCL for compute, gloo as the CPU side for checkpoint and object collectives.
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        dist.init_process_group(
            backend, store=_store(rank, world, timeout_s), rank=rank, world_size=world, timeout=timeout
        )
    else:  # (a spare of parallel.spares: on the device its host set, goodput.run.spares)
        rank, world, local_rank = 0, 1, torch.cuda.current_device() if cuda else 0
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    # Checkpoint collectives keep the long timeout: an async save's run on a background thread,
    # waiting for the slowest rank's write, which the loop's short one must not cut.
    ckpt_pg = dist.new_group(backend="gloo", timeout=timeout)
    return Dist(rank, world, local_rank, device, ckpt_pg, timeout_s)


def set_collective_timeout(seconds: float, groups=()) -> None:
    """After the first step: a collective on the training groups (the default one, and `groups`:
    the strategy's, Strategy.collective_groups) that waits longer than this for a peer fails (a
    hung or dead rank then costs seconds, not gloo's 30 min default)."""
    import torch.distributed as dist

    for group in (None, *groups):
        dist.set_timeout(timedelta(seconds=seconds), group)


def join_generation(
    store, rank: int, world: int, local_rank: int, timeout_s: float, init_timeout_s: float
) -> Dist:
    """Leave this process's groups and form the next generation's (in-process recovery onto a
    spare, goodput.run.spares): a fresh default group on `store` (a prefix of the job's store that
    names the generation, so no key of an earlier one is read) and a fresh checkpoint group. Every
    collective on the new groups is bounded by `timeout_s` until the first step after it
    (set_collective_timeout shortens it then); the checkpoint group keeps `init_timeout_s`.

    The old groups are left without waiting: gloo has no communicator to abort (its collectives
    with a dead peer have already failed: its socket closed), NCCL's is aborted (the CUDA context
    stays). `destroy_process_group` also resets torch's group counter, so the new generation's
    checkpoint group gets the same name on every member, old or new."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if dist.is_initialized():
        if cuda:  # a collective with a dead NCCL peer never ends: abort it (not written for gloo)
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    ckpt_pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=init_timeout_s))
    return Dist(rank, world, local_rank, device, ckpt_pg, init_timeout_s, timeout_s)


def flight_recorder_env(trace_dir: str) -> None:
    """NCCL's Flight Recorder (read when the NCCL group starts): a ring of the last collectives per
    rank, dumped to `<trace_dir>/rank_<r>` when a collective times out. Explicit settings win."""
    os.makedirs(trace_dir, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(trace_dir, "rank_"))
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(trace_dir, "rank_"))  # older name


def _store(rank: int, world: int, timeout_s: float):
    """The env:// store, with keys prefixed by the round of workers (job_round). The elastic agent
    keeps one store for the whole job; without a prefix, workers of restart k read the addresses
    that the dead workers of restart k-1 published there and hang connecting to them."""
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host,
        port,
        world,
        is_master=(rank == 0 and not agent_store),
        timeout=timedelta(seconds=timeout_s),
        multi_tenant=not agent_store,
    )
    return dist.PrefixStore(f"goodput/restart{job_round(store, rank, world, timeout_s)}", store)


ROUND_ENV = "GOODPUT_ROUND"  # the round a host agreed on, for the processes it forks


def job_round(store, rank: int, world: int, timeout_s: float) -> int:
    """Which start of the job's workers this process belongs to, the same number in every one of
    them: the key prefix of this round's store keys. On one node, the agent's restart count. On
    several (torchrun), the agents' counts differ: one counts a restart only where its own worker
    failed, not where it restarted because another node re-joined; so there the round is agreed on
    the store (agree_round). A process forked by a host that agreed already reads it from ROUND_ENV."""
    if ROUND_ENV in os.environ:
        return int(os.environ[ROUND_ENV])
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) <= 1:
        return restart_round()
    return agree_round(store, rank, world, timeout_s)


def agree_round(store, rank: int, world: int, timeout_s: float, poll_s: float = 0.01) -> int:
    """A round number that every live process of ranks 0..world-1 gets, new at each start, whatever
    the store holds from earlier starts (their processes are dead: an agent stops its workers before
    it re-joins). Each process says hello under its rank with a fresh nonce; rank 0 takes the next
    number and answers every nonce it sees until each rank acknowledged this round (a stale hello of
    a dead process is answered too, and nobody reads it). Bounded by `timeout_s`."""
    import uuid

    nonce = uuid.uuid4().hex
    base = "goodput/rounds"
    store.set(f"{base}/hello/{rank}", nonce)
    if rank != 0:
        store.wait([f"{base}/welcome/{nonce}"], timedelta(seconds=timeout_s))
        n = int(store.get(f"{base}/welcome/{nonce}"))
        store.set(f"{base}/{n}/ack/{rank}", "1")
        return n
    import time

    n = store.add(f"{base}/n", 1) - 1
    answered: dict[int, bytes] = {}
    pending = set(range(1, world))
    deadline = time.monotonic() + timeout_s
    while pending:
        for r in sorted(pending):
            if store.check([f"{base}/{n}/ack/{r}"]):
                pending.discard(r)
                continue
            key = f"{base}/hello/{r}"
            said = store.get(key) if store.check([key]) else None
            if said is not None and answered.get(r) != said:
                store.set(f"{base}/welcome/{said.decode()}", str(n))
                answered[r] = said
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"rank(s) {sorted(pending)} did not join round {n} of the job's workers "
                               f"within {timeout_s:g}s")  # fmt: skip
        time.sleep(poll_s if pending else 0)
    return n


def free_port() -> int:
    """A free TCP port on loopback (rendezvous and stores of single-machine runs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class Single:
    """One process: nothing to wrap or synchronise. A strategy of your own: a subclass, selected by
    `parallel.strategy._target_` (its options are the node's other keys)."""

    distributed = False
    """Whether it runs more than one process (False: the world size must be 1)."""

    shards_parameters = False
    """Whether parameters are split over the processes (needs more than one; contiguous ones only)."""

    def wrap(self, model: nn.Module, d: Dist, param_dtype: torch.dtype | None = None) -> nn.Module:
        """The module the optimizer trains. `param_dtype`: the compute dtype of mixed precision
        (autocast does the casting here; FSDP casts its parameters itself). A strategy that shards
        parameters (`shards_parameters`) also takes `plan=`: the model's shard plan
        (goodput.recipe.models; None: the model class's own), here and in `replica` and `compile`."""
        return model

    def replica(self, module: nn.Module, d: Dist, param_dtype: torch.dtype | None = None) -> nn.Module:
        """A copy that is never trained (the EMA weights), laid out like the model's parameters."""
        return module

    def no_sync(self, model: nn.Module):
        """Accumulate gradients locally (all micro-steps but the last)."""
        return contextlib.nullcontext()

    def compile(self, model: nn.Module, **options) -> nn.Module:
        """torch.compile the wrapped `model` in place (`options`: torch.compile's), compiled on the
        first call. In place (`nn.Module.compile`): the state-dict keys stay the plain module's,
        without `_orig_mod.`. Here and under DDP the module the strategy returned is compiled whole
        (the DDP wrapper: DDPOptimizer splits the graph at the gradient buckets, as torch asks)."""
        model.compile(**options)
        return model

    def grad_scaler(self, device: torch.device, enabled: bool):
        import torch

        return torch.amp.GradScaler(device.type, enabled=enabled)

    # -- in-process recovery onto a spare (parallel.spares, goodput.run.spares) ------------------
    def holders(self, rank: int, world: int) -> list[int]:
        """The other ranks that hold everything `rank` holds of the training state (its parameters,
        optimizer state and EMA, or its shard of them): one of them can hand it to a spare that
        takes `rank`'s place. Here every rank holds the whole state. []: none (a failure of `rank`
        takes the rescue or commit path)."""
        return [r for r in range(world) if r != rank]

    regroups_in_place = True
    """Whether `regroup` can move what `wrap` built onto the next generation's process groups. False
    (FSDP2: parameters and optimizer state are DTensors bound to the device mesh, whose groups end
    with their generation): the Trainer builds model, EMA and optimizer again on the new mesh and
    loads the boundary state into them (goodput.run.build.Trainer.regroup)."""

    def collective_groups(self) -> list:
        """The process groups `wrap` made for the training collectives, beside the default group
        (their collectives get the same bounds: set_collective_timeout)."""
        return []

    def regroup(self, model: nn.Module) -> None:
        """The job's process groups were made again (a spare took a dead rank's place): point what
        `wrap` built at the new default group. Nothing is wrapped here."""

    def ready_spare(self, model: nn.Module, forward) -> None:
        """On a spare, before it waits (its process group: itself alone): whatever the wrapper
        settles in its first steps, settled now the way the ranks settled it. `forward()` runs the
        model on a stand-in batch and returns its output."""

    def layout_errors(self, world: int, local_world: int) -> list[str]:
        """What keeps this strategy from running `world` ranks, `local_world` of them per node:
        one message per problem, naming the key (goodput.config.validate, before any work)."""
        return []

    # -- replica groups: which ranks hold a whole copy of the training state (no collective) ----
    def replica_group(self, rank: int, world: int) -> list[int]:
        """The ranks that together hold one whole copy of the model and optimizer state, `rank`
        among them: the rank alone where every rank holds all of it (single, ddp)."""
        return [rank]

    def replica_groups(self, world: int) -> list[list[int]]:
        """Every replica group, lowest ranks first; each rank is in exactly one."""
        return [g for r in range(world) if (g := self.replica_group(r, world))[0] == r]

    def whole_replica(self, alive, world: int) -> list[int] | None:
        """The first replica group whose ranks are all in `alive`: the job's state survives there
        whole, and writing that group's state (its shards) saves all of it. None: no group is whole."""
        return next((g for g in self.replica_groups(world) if set(g) <= set(alive)), None)


class DDP(Single):
    """A full replica per process; gradients all-reduced in the backward of the last micro-step."""

    distributed = True

    def wrap(self, model: nn.Module, d: Dist, param_dtype: torch.dtype | None = None) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        ids = [d.local_rank] if d.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def no_sync(self, model: nn.Module):
        return model.no_sync()

    def regroup(self, model: nn.Module) -> None:
        # The same wrapper and reducer on the new group: the reducer's state (a backward cut short
        # by the failure) is reset, its gradient buckets kept (see ready_spare).
        import torch.distributed as dist

        model._update_process_group(dist.group.WORLD)

    def ready_spare(self, model: nn.Module, forward) -> None:
        """DDP lays its gradient buckets out anew after the first backward, in the order the
        gradients became ready; the ranks did that at their first step. A spare's reducer must hold
        the same layout when it joins (each bucket is all-reduced as one buffer: different layouts
        mix up parameters, or abort on a size mismatch), so it runs one forward and backward and the
        next forward (which rebuilds the buckets) on its own one-rank group now. What it changed
        (gradients, BatchNorm statistics) is overwritten by the state it receives."""
        _sum(forward()).backward()
        forward()
        model.zero_grad(set_to_none=True)


def _sum(out):
    """One scalar from a model's output (a tensor, or a structure of them)."""
    import torch

    if torch.is_tensor(out):
        return out.float().sum()
    items = out.values() if isinstance(out, dict) else out
    return sum(_sum(o) for o in items)


class FSDP(Single):
    """FSDP2: fully_shard each block, then the root. Mixed precision is FSDP's: parameters are
    all-gathered in `param_dtype`, gradients reduced in fp32 (a low-precision sum over ranks loses bits)."""

    distributed = True
    shards_parameters = True
    regroups_in_place = False
    _mesh = None  # built once (model and EMA share it): see device_mesh

    def holders(self, rank: int, world: int) -> list[int]:
        return []  # a rank's shard exists nowhere else

    def collective_groups(self) -> list:
        return [] if self._mesh is None else self._mesh.get_all_groups()

    def device_mesh(self, d: Dist):
        """The ranks the parameters are sharded over: all of them, a 1-D mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        if self._mesh is None:
            self._mesh = _bounded(init_device_mesh(d.device.type, (d.world,)), d)
        return self._mesh

    def replica_group(self, rank: int, world: int) -> list[int]:
        return list(range(world))  # every rank holds a shard of the one copy

    def _shard(self, model: nn.Module, d: Dist, param_dtype: torch.dtype | None, plan) -> nn.Module:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.device_mesh(d)
        reduce = torch.float32 if param_dtype is not None else None
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce)
        for unit in _units(model, plan):
            fully_shard(unit, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model

    def wrap(self, model: nn.Module, d: Dist, param_dtype: torch.dtype | None = None, plan=None) -> nn.Module:
        return self._shard(model, d, param_dtype, plan)

    def replica(self, module: nn.Module, d: Dist, param_dtype: torch.dtype | None = None, plan=None):
        return self._shard(module, d, param_dtype, plan)  # sharded like the model: saved, resharded alike

    def compile(self, model: nn.Module, plan=None, **options) -> nn.Module:
        """Per block, as torchtitan does: the `forward` of each unit fully_shard wrapped (of the
        root when there is none). FSDP2's all-gather and reshard are module hooks around
        `forward`, so they stay outside the compiled code. Compiling the root, or a unit in place
        (`nn.Module.compile`, before or after fully_shard), puts the hooks inside, where dynamo
        skips them (torch._dynamo.config.skip_fsdp_hooks) and, on torch 2.14, then compiles no
        graph at all: the run trains eagerly (docs/compile.md). What is outside the units (a
        ResNet's stem, a head) runs eagerly. State-dict keys are unchanged."""
        import torch

        for unit in _units(model, plan) or [model]:
            unit.forward = torch.compile(unit.forward, **options)
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        model.set_requires_gradient_sync(False)  # no reduce-scatter: unsharded gradients accumulate
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def grad_scaler(self, device: torch.device, enabled: bool):
        # Each rank sees only its gradient shard: an inf found on one rank must skip the step on all
        # (ShardedGradScaler all-reduces found_inf; the plain scaler would let the ranks diverge).
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, enabled=enabled)


def _bounded(mesh, d: Dist):
    """`mesh`, its groups bounded as the default group is until the first step (a group made by
    init_device_mesh gets the backend's default instead: 30 min for gloo)."""
    import torch.distributed as dist

    for group in mesh.get_all_groups():
        dist.set_timeout(d.group_timeout, group)
    return mesh


def _units(model: nn.Module, plan) -> list[nn.Module]:
    """The blocks of the model's shard plan (goodput.recipe.models): `plan` as the Trainer resolved
    it, or None for the model class's own."""
    from goodput.recipe.models import shard_plan, shard_units

    return shard_units(model, shard_plan(model, None) if plan is None else tuple(plan))


class HSDP(FSDP):
    """Hybrid sharding: FSDP2 inside each replica group of `shard_size` consecutive ranks (one node
    by default), a whole replica per group. A 2-D mesh (replicate, shard): rank r sits at
    (r // shard_size, r % shard_size). Parameters, gradients and optimizer state are DTensors
    placed (Replicate(), Shard(0)); gradients are reduce-scattered inside the group (the fast
    intra-node links), then all-reduced between groups over the slower network, one shard each.

    Everything else is FSDP's (gradient-sync switch, sharded grad scaler, mixed precision, EMA
    sharded like the model). DCP saves each shard once: the replicas' copies carry the same chunk
    index and its planner keeps one of them."""

    def __init__(self, shard_size: int | None = None):
        """`shard_size`: parallel.shard_size (ranks per replica group); None: the ranks of one node."""
        if shard_size is not None and (isinstance(shard_size, bool) or shard_size < 1):
            raise ValueError(f"parallel.shard_size must be >= 1 or null, got {shard_size!r}")
        self.shard_size = shard_size
        self.replica_pg = None  # this rank's replica group as a gloo group (device_mesh builds it)

    def group_size(self, world: int, local_world: int | None = None) -> int:
        """Ranks per replica group: parallel.shard_size, else the ranks of one node (`local_world`,
        or the launcher's LOCAL_WORLD_SIZE; all `world` ranks when neither is known)."""
        if self.shard_size is not None:
            return self.shard_size
        return local_world or int(os.environ.get("LOCAL_WORLD_SIZE", world))

    def layout_errors(self, world: int, local_world: int) -> list[str]:
        size = self.group_size(world, local_world)
        if world % size == 0:
            return []
        what = "" if self.shard_size is not None else f" (null: the {size} ranks of one node)"
        return [f"parallel.shard_size={size}{what} does not divide the world size {world}: hsdp "
                f"needs whole replica groups (world size = replicas x parallel.shard_size)"]  # fmt: skip

    def replica_group(self, rank: int, world: int) -> list[int]:
        size = self.group_size(world)
        return list(range(rank - rank % size, rank - rank % size + size))

    def shard_peers(self, rank: int, world: int) -> list[int]:
        """The ranks holding the same shard as `rank`, one per replica group: its gradients are
        all-reduced among them (a column of the mesh; the replica group is its row)."""
        return list(range(rank % self.group_size(world), world, self.group_size(world)))

    def holders(self, rank: int, world: int) -> list[int]:
        return [r for r in self.shard_peers(rank, world) if r != rank]  # its replicas in the other groups

    def device_mesh(self, d: Dist):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if self._mesh is not None:
            return self._mesh
        size = self.group_size(d.world)
        if d.world % size:  # compose time refuses this (validate); an outside launcher can still differ
            raise ValueError(self.layout_errors(d.world, size)[0])
        shape = (d.world // size, size)
        mesh = init_device_mesh(d.device.type, shape, mesh_dim_names=("replicate", "shard"))
        self._mesh = _bounded(mesh, d)
        # One gloo group per replica group, made now while every rank is alive (making a group is a
        # collective): the group's own channel for checkpoint I/O, which a failure elsewhere leaves whole.
        timeout = timedelta(seconds=d.init_timeout_s)
        for group in self.replica_groups(d.world):
            pg = dist.new_group(group, backend="gloo", timeout=timeout)
            if d.rank in group:
                self.replica_pg = pg
        if d.rank == 0:
            log.info("hsdp: %d replica group(s) x %d shard(s) (mesh replicate x shard)%s", *shape,
                     _DEGENERATE.get((shape[0] == 1, size == 1), ""))  # fmt: skip
        return self._mesh


# A mesh with one dimension of size 1: allowed (an elastic relaunch on fewer nodes, or nodes with
# one GPU, lead there), and said: the layout is another strategy's, run through FSDP2.
_DEGENERATE = {
    (True, False): ": one replica group, the layout of parallel=fsdp",
    (False, True): ": shard_size 1, whole replicas on every rank, the layout of parallel=ddp",
    (True, True): ": one rank",
}


@dataclass
class ParallelConfig:
    """Schema of the `parallel` group: how many processes, and how the model is spread over them."""

    strategy: Any = MISSING
    """A `_target_` node (the strategy class, built with hydra.utils.instantiate), one option file
    each: `single` (goodput.parallel.Single, one process), `ddp` (DDP, a full replica per process,
    gradients all-reduced), `fsdp` (FSDP, parameters, gradients and optimizer state sharded: less
    memory per process, more communication) or `hsdp` (HSDP: sharded inside replica groups of
    parallel.shard_size ranks, replicated across them); or a subclass of Single of your own."""

    shard_size: int | None = None
    """parallel=hsdp: ranks per replica group (the model is sharded over them; the world size must
    be a multiple). null = the ranks of one node (nproc_per_node, or an outside launcher's
    LOCAL_WORLD_SIZE; without one, all ranks): shard over the fast links inside a node, replicate
    across nodes. Equal to the world size it is fsdp's layout, 1 ddp's. Only parallel=hsdp reads it."""

    nproc_per_node: int = 1
    """Worker processes per node (GPUs per node on a cluster). Under an external launcher (torchrun,
    srun) its WORLD_SIZE is used instead."""

    oversubscribe: bool = False
    """CPU only: allow more worker processes per node than CPU cores (they share the cores, each
    slower), for trying multi-rank layouts on a small machine (parallel=hsdp on 4 ranks on 2 cores).
    false: nproc_per_node above the CPU count is refused before any work. No effect on GPUs, where
    the limit is the number of GPUs."""

    max_restarts: int = 0
    """> 0: run under the elastic agent, which restarts all workers from the newest commit when one
    dies (at most this often). 0 = a crash ends the job; relaunching the command resumes it."""

    rdzv_endpoint: str | None = None
    """host:port of the rendezvous for multi-node jobs; null = a free port on 127.0.0.1."""

    rdzv_timeout_s: int = 300
    """Give up joining the rendezvous after this long (a node that never comes up)."""

    init_timeout_s: float = 600.0
    """Bound on every collective until the first step is done (process group start, restore, the
    first step with its compilation and warm-up), and always on the checkpoint group."""

    shard_units: list[str] | None = None
    """parallel=fsdp|hsdp: the blocks FSDP wraps one by one, as patterns over the model's module names
    (`["layer*"]`, `["encoder.layers.*"]`; one `*` per name part); null = the model's own shard plan
    (goodput.recipe.models: the class's `shard_units`, or SHARD_PLANS for torchvision's). A model
    without one is refused under fsdp/hsdp (sharded as one unit, all its parameters would be
    gathered at once)."""

    collective_timeout_s: float = 120.0
    """Bound on every training collective after the first step: a peer that hung or died fails
    the waiting ranks after this long (then the elastic restart takes over). Longer than the
    slowest step and evaluation, or a slow one is cut; shorter than trainer.hang_timeout_s makes
    the collective the first to notice a hung peer."""

    spares: int = 0
    """Warm spare processes per node beside the ranks (they do not count in nproc_per_node). A
    spare builds the model, optimizer and loader, then waits without using the CPU; when a rank is
    killed, the survivors keep their processes, a spare takes its place in a new process group and
    one survivor sends it the state of the last finished step (goodput.run.spares, docs/parallelism.md).
    Under hsdp the dead rank's shard comes from its replica in another replica group. Under
    torchrun, a lost node's rank too (a spare on another node, once 5 s pass without the lost
    host's heartbeat). What does not fit (no spare left, two ranks lost at once, a failure inside
    a save or an evaluation, a hang, fsdp or hsdp with one replica group: no survivor holds the
    dead rank's shard) goes the way it goes with 0: a rescue and a restart.
    0 = no spares."""

    recovery_timeout_s: float = 30.0
    """Bound on each phase of an in-process recovery (parallel.spares): the survivors' reports and
    the decision, the new group, the state sent to the spare. Past it the recovery falls back to a
    rescue and a restart."""

    def __post_init__(self):
        e = []
        if not (isinstance(self.strategy, dict) and "_target_" in self.strategy):
            e.append(f"parallel.strategy must be a node with a _target_ (a class), got {self.strategy!r}")
        if self.nproc_per_node < 1:
            e.append(f"parallel.nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if self.max_restarts < 0:
            e.append(f"parallel.max_restarts must be >= 0, got {self.max_restarts}")
        if isinstance(self.spares, bool) or self.spares < 0:
            e.append(f"parallel.spares must be an int >= 0, got {self.spares!r}")
        if self.rdzv_timeout_s <= 0:
            e.append(f"parallel.rdzv_timeout_s must be > 0, got {self.rdzv_timeout_s}")
        for key in ("init_timeout_s", "collective_timeout_s", "recovery_timeout_s"):
            if getattr(self, key) <= 0:
                e.append(f"parallel.{key} must be > 0, got {getattr(self, key)}")
        if e:
            raise ValueError("\n  - ".join(e))
