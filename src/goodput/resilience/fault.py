"""Fault injection for drills. Each fault fires once per run: a marker beside the checkpoints
records that it fired, so relaunching the same command (or an elastic restart) runs on."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass

from goodput.storage.remote import Storage
from goodput.untrusted import RecordError, field, parse_record, set_aside

log = logging.getLogger(__name__)


HANG_SITES = ("step", "collective", "storage_read", "storage_write", "dataloader", "update")
_STORAGE_OPS = {"storage_read": ("read", "download"), "storage_write": ("write", "upload")}


def hang_forever() -> None:
    while True:
        time.sleep(3600)


@dataclass
class FaultConfig:
    """Schema of the `fault` group: kills for drills. All off by default; each fires once per run."""

    kill_at_step: int | None = None
    """SIGKILL the process after this step (first attempt only): a crash drill."""

    kill_during_save: int | None = None
    """SIGKILL while the checkpoint of this step is being uploaded (once): the partial save must
    never be loaded."""

    rank: int = 0
    """Which rank the kills at a step or a save hit (kill_at_step, kill_during_save, kill_in_step)."""

    mtbf_seconds: float | None = None
    """Random SIGKILLs with this mean time between failures (seeded by `seed` and the attempt)."""

    max_kills: int = 2
    """At most this many random kills per run (mtbf_seconds and chaos_p)."""

    chaos_p: float = 0.0
    """SIGKILL with this probability at each step / save / upload / commit / retention point."""

    chaos_seed: int = 0
    """Seed of the chaos draws."""

    kill_in_step: int | None = None
    """SIGKILL inside this step, between its first and second micro-batch (first attempt only;
    needs gradient accumulation, trainer.micro_batch_size): the half-accumulated step must be redone."""

    raise_at_step: int | None = None
    """Raise an error in this step on fault.rank, after its forward (first attempt only): the rank's
    own failure, as a bad batch or an out-of-memory error would be, which leaves the process
    alive (a rescue writes the step before)."""

    hang_at_step: int | None = None
    """Hang drill: from this step on, `hang_rank` stops making progress at `hang_site`, forever
    (once per run). Only the hang watchdog (trainer.hang_timeout_s) or a collective timeout
    (parallel.collective_timeout_s) ends it."""

    hang_rank: int = 0
    """Which rank hangs."""

    hang_site: str = "step"
    """Where: `step` (the main thread sleeps after the step), `collective` (it waits in a gloo
    receive no peer sends: stuck in C++), `storage_read` (inside the next read from the data
    root), `storage_write` (inside the next write to the checkpoint dir: the next save),
    `dataloader` (a DataLoader worker stops inside a read; needs data.num_workers > 0), `update`
    (inside the optimizer update of the step after hang_at_step: no rescue may be written there)."""

    slow_rank: int | None = None
    """A straggler drill: this rank sleeps slow_seconds in every step (after the gradient sync, so
    its own step time shows it), every attempt; null = off. The straggler warning must name it."""

    slow_seconds: float = 0.2
    """The slow rank's extra seconds per step (fault.slow_rank)."""

    hang_mtbf_seconds: float | None = None
    """Random hangs: each attempt, `hang_rank` hangs at `hang_site` after an exponential time with
    this mean (seeded by `seed` and the attempt, like mtbf_seconds' kills), `max_hangs` per run at
    most. Not at the `dataloader` site (its workers start before the attempt's schedule is drawn)."""

    max_hangs: int = 1
    """At most this many random hangs (hang_mtbf_seconds) per run, counted by their markers."""

    def __post_init__(self):
        e = []
        if self.slow_rank is not None and not (isinstance(self.slow_rank, int) and self.slow_rank >= 0):
            e.append(f"fault.slow_rank must be a rank >= 0 or null, got {self.slow_rank!r}")
        if self.slow_seconds < 0:
            e.append(f"fault.slow_seconds must be >= 0, got {self.slow_seconds}")
        if self.raise_at_step is not None and self.raise_at_step < 1:
            e.append(f"fault.raise_at_step must be >= 1 or null, got {self.raise_at_step}")
        if self.kill_in_step is not None and self.kill_in_step < 1:
            e.append(f"fault.kill_in_step must be >= 1 or null, got {self.kill_in_step}")
        if self.mtbf_seconds is not None and self.mtbf_seconds < 0:
            e.append(f"fault.mtbf_seconds must be >= 0 or null (0 = off), got {self.mtbf_seconds}")
        if self.max_kills < 0:
            e.append(f"fault.max_kills must be >= 0, got {self.max_kills}")
        if not 0.0 <= self.chaos_p <= 1.0:
            e.append(f"fault.chaos_p must be in [0, 1], got {self.chaos_p}")
        if self.hang_site not in HANG_SITES:
            e.append(f"fault.hang_site must be one of {list(HANG_SITES)}, got {self.hang_site!r}")
        if self.hang_at_step is not None and self.hang_at_step < 1:
            e.append(f"fault.hang_at_step must be >= 1 or null, got {self.hang_at_step}")
        if self.hang_mtbf_seconds is not None and self.hang_mtbf_seconds <= 0:
            e.append(f"fault.hang_mtbf_seconds must be > 0 or null, got {self.hang_mtbf_seconds}")
        if self.hang_mtbf_seconds is not None and self.hang_site == "dataloader":
            e.append("fault.hang_mtbf_seconds does not work with hang_site=dataloader (use hang_at_step)")
        if self.max_hangs < 0:
            e.append(f"fault.max_hangs must be >= 0, got {self.max_hangs}")
        if e:
            raise ValueError("\n  - ".join(e))


class InjectedFailure(RuntimeError):
    """fault.raise_at_step: an error inside a step, from the drill."""


class Faults:
    def __init__(
        self,
        storage: Storage,
        rank: int,
        kill_at_step=None,
        kill_during_save=None,
        target_rank: int = 0,
        kill_in_step=None,
        slow_rank=None,
        slow_seconds: float = 0.0,
        raise_at_step=None,
    ):
        self.storage, self.rank, self.target_rank = storage, rank, target_rank
        self.slow_s = slow_seconds if slow_rank == rank else 0.0
        self.kill_at_step, self.kill_during_save = kill_at_step, kill_during_save
        self.kill_in_step, self.raise_at_step = kill_in_step, raise_at_step
        self._random_kill_at, self._attempt = None, 0
        self._chaos, self._chaos_p, self._chaos_seen = None, 0.0, {}
        self._chaos_lock = threading.Lock()
        self.step = 0
        self.hang_at_step, self.hang_site, self.hang_rank = None, "step", 0
        self._hang_mtbf, self._max_hangs, self._hang_at_time = None, 0, None
        self._pid = os.getpid()
        self._worker_reads = 0

    def arm_hang(
        self, at_step, site: str, rank: int, mtbf_seconds: float | None = None, max_hangs: int = 0
    ) -> None:
        self.hang_at_step, self.hang_site, self.hang_rank = at_step, site, rank
        self._hang_mtbf, self._max_hangs = mtbf_seconds, max_hangs

    def _hang_due(self, site: str) -> str | None:
        """The marker of the hang due here now (None: none is): the step's, or the random one's."""
        if self.hang_site != site or self.rank != self.hang_rank:
            return None
        if self.hang_at_step is not None and self.step >= self.hang_at_step:
            return f"hang-{site}-{self.hang_at_step}"
        if self._hang_at_time is not None and time.monotonic() >= self._hang_at_time:
            return f"hang-random-attempt{self._attempt}-{site}"
        return None

    def _hang(self, site: str, name: str) -> None:
        """Mark the hang as done for this run (a restart runs on), then never return."""
        marker = f"faults/{name}.fired"
        self.hang_at_step = self._hang_at_time = None  # also keeps the marker's own write from hanging here
        if self.storage.exists(marker):
            return
        info = {"time": time.time(), "rank": self.rank, "attempt": self._attempt, "step": self.step}
        self.storage.write_bytes(marker, json.dumps(info).encode())
        log.warning("fault injection: rank %d hangs at %s (step %d)", self.rank, site, self.step)
        for h in logging.getLogger().handlers:
            h.flush()
        if site == "collective":
            import torch
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_world_size() > 1:  # a receive nobody sends
                dist.recv(torch.zeros(1), src=(self.rank + 1) % dist.get_world_size(), tag=4_242)
        hang_forever()

    def storage_op(self, kind: str) -> None:
        """Storage calls this before each remote operation (`kind`: read, write, upload, ls...)."""
        if os.getpid() != self._pid:  # a DataLoader worker (it got a copy of the Storage)
            if self.hang_site == "dataloader" and self.rank == self.hang_rank and kind == "read":
                self._worker_reads += 1
                if self.hang_at_step is not None and self._worker_reads > self.hang_at_step:
                    # after hang_at_step reads: well into the run
                    self._hang("dataloader", f"hang-dataloader-{self.hang_at_step}")
            return
        for site, kinds in _STORAGE_OPS.items():
            if kind in kinds and (name := self._hang_due(site)):
                self._hang(site, name)

    def _fire(self, name: str) -> None:
        marker = f"faults/{name}.fired"
        if self.storage.exists(marker):
            return
        # the kill time, so a restart can measure its recovery from the failure itself
        info = {"time": time.time(), "rank": self.rank, "attempt": self._attempt}
        self.storage.write_bytes(marker, json.dumps(info).encode())
        log.warning("fault injection: SIGKILL rank %d (%s)", self.rank, name)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def fired(self) -> dict[str, dict]:
        """The markers of the faults fired so far and the watchdog's hang records: name -> {time,
        rank, attempt, ...} (empty for old markers), each checked (check_marker). A malformed one is
        moved aside with a warning naming it: a marker is no reason to crash every start. (The
        marker of a drill is what keeps it from firing again: one moved aside fires once more.)"""
        out = {}
        names = [name for name in self.storage.ls("faults") if name.endswith(".fired")]
        for name, data in zip(names, self.storage.read_each(f"faults/{n}" for n in names)):
            rel = f"faults/{name}"
            try:
                if data is not None:  # (None: gone since the listing)
                    out[name] = check_marker(data or b"{}", name, self.storage.url(rel))
            except RecordError as e:
                set_aside(self.storage, rel, e)
        return out

    def at_step(self, step: int) -> None:
        self.step = step
        for site in ("step", "collective"):
            if name := self._hang_due(site):
                self._hang(site, name)
        if self.rank != self.target_rank:
            return
        if self.kill_at_step is not None and step == self.kill_at_step:
            self._fire(f"kill_at_step-{step}")
        if self._random_kill_at is not None and time.monotonic() >= self._random_kill_at:
            self._random_kill_at = None
            self._fire(f"random-kill-attempt{self._attempt}")

    def slow_step(self) -> None:
        """fault.slow_rank: this rank's extra sleep, inside the step's timed span."""
        if self.slow_s:
            time.sleep(self.slow_s)

    def in_step(self, step: int) -> None:
        """Between two micro-batches of the step after `step` (goodput.run.step): kill_in_step, and
        the chaos site `micro_step`."""
        if self.rank == self.target_rank and self.kill_in_step is not None and step + 1 == self.kill_in_step:
            self._fire(f"kill_in_step-{step + 1}")
        self.site("micro_step")

    def after_forward(self, step: int) -> None:
        """After the forward of the step after `step` (goodput.run.step): raise_at_step."""
        due = self.raise_at_step is not None and step + 1 == self.raise_at_step
        if due and self.rank == self.target_rank:
            marker = f"faults/raise_at_step-{step + 1}.fired"
            if not self.storage.exists(marker):
                info = {"time": time.time(), "rank": self.rank, "attempt": self._attempt, "step": step}
                self.storage.write_bytes(marker, json.dumps(info).encode())
                raise InjectedFailure(f"fault injection: rank {self.rank} fails in step {step + 1}")

    def in_update(self) -> None:
        """Inside the optimizer update (goodput.run.step): the `update` hang site."""
        if name := self._hang_due("update"):
            self._hang("update", name)

    def site(self, name: str) -> None:
        """Chaos drills: at each named point (step, save, staged, upload, commit, retention) die with
        probability `chaos_p`. The n-th visit of a site in an attempt draws from its own RNG, seeded
        by (chaos_seed, attempt, site, n): one shared stream would make the loop's draws depend on
        how far an async save's thread had got, and the kill points vary from run to run."""
        if self._chaos is None:  # no drill (or its kill is done): no lock on every step
            return
        with self._chaos_lock:  # the loop and an async save's thread both reach sites
            if self._chaos is None:
                return
            n = self._chaos_seen[name] = self._chaos_seen.get(name, 0) + 1
            if random.Random(f"{self._chaos}:{name}:{n}").random() >= self._chaos_p:
                return
            self._chaos = None  # one kill per attempt
        self._fire(f"chaos-attempt{self._attempt}-{name}")

    def arm_chaos(self, p: float, seed: int, max_kills: int, attempt: int) -> None:
        self._attempt = attempt
        if p and attempt < max_kills and self.rank == self.target_rank:
            self._chaos, self._chaos_p, self._chaos_seen = f"chaos:{seed}:{attempt}", p, {}

    def arm_random(self, mtbf_seconds: float | None, max_kills: int, seed: int, attempt: int) -> None:
        """Kill this attempt after an exponential time with mean `mtbf_seconds`, seeded by (seed,
        attempt), so a drill is repeatable; at most `max_kills` kills over the run."""
        self._attempt = attempt
        self._arm_random_hang(seed, attempt)
        if not mtbf_seconds or attempt >= max_kills or self.rank != self.target_rank:
            return
        delay = random.Random(seed * 1_000_003 + attempt).expovariate(1.0 / mtbf_seconds)
        self._random_kill_at = time.monotonic() + delay
        log.warning("fault drill: this attempt will be killed in %.1fs (mtbf %.1fs)", delay, mtbf_seconds)

    def _arm_random_hang(self, seed: int, attempt: int) -> None:
        """fault.hang_mtbf_seconds: this attempt hangs after an exponential delay seeded by (seed,
        attempt), unless the run's markers already hold max_hangs random hangs."""
        self._hang_at_time = None
        if not self._hang_mtbf or self.rank != self.hang_rank:
            return
        done = sum(n.startswith("hang-random-") for n in self.storage.ls("faults"))
        if done >= self._max_hangs:
            return
        delay = random.Random(f"hang:{seed}:{attempt}").expovariate(1.0 / self._hang_mtbf)
        self._hang_at_time = time.monotonic() + delay
        log.warning("fault drill: this attempt will hang (%s) in %.1fs (hang mtbf %.1fs)",
                    self.hang_site, delay, self._hang_mtbf)  # fmt: skip

    def during_save(self, step: int) -> None:
        if (
            self.kill_during_save is not None
            and step == self.kill_during_save
            and self.rank == self.target_rank
        ):
            self._fire(f"kill_during_save-{step}")


def check_marker(data: bytes, name: str, what: str) -> dict:
    """A fault marker (time, rank, attempt, step: Faults._fire, _hang) or, for `hung-*`, a hang record
    of the watchdog (attempt, detected, hung_seconds: goodput.resilience.watchdog), with every field
    that goodput.resilience.recovery.failure_time and watchdog.hung_seconds read checked; RecordError
    naming `what` otherwise."""
    rec = parse_record(data, what)
    field(rec, "time", (int, float), what, default=0.0)
    field(rec, "rank", int, what, default=0, minimum=0)
    field(rec, "attempt", int, what, default=0, minimum=0)
    field(rec, "step", (int, type(None)), what, default=None)
    if name.startswith("hung-"):
        field(rec, "attempt", int, what, minimum=0)
        field(rec, "detected", (int, float), what)
        field(rec, "hung_seconds", (int, float), what, minimum=0)
    return rec
