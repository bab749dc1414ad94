"""In-process recovery onto a warm spare, the store's side: who died, where the survivors stand,
what was decided, which spares wait. The processes themselves are goodput.run.spares'.

Everything goes through one key-value store every process of the job reaches (the elastic
agent's TCP store), under `goodput/restart<round>/spares/`:

    members                       a counter: every process's member id (ranks and spares)
    spares/n, spares/<i>          the i-th spare that registered: its member id
    spares/taken                  a counter: spares handed out so far
    spares/gone/<member>          a registered spare that died while it waited
    closed                        the run is over (or stopping): a spare that sees it exits 0
    gen                           the current generation of the process group (absent: 0)
    gen<g>/dead, gen<g>/dead/<n>  the deaths hosts saw in generation g: rank, cause, time
    gen<g>/state/<rank>           a survivor's report: at which step boundary it stands, or why not
    gen<g>/decision               {"plan": ...} or {"abort": why}: the first writer wins (compare_set)
    gen<g>/pg/...                 the next generation's process group (torch's own keys)
    gen<g>/mark/<phase>/<rank>    when each member got through each phase (the recovery record)
    spare/<member>/assign         the plan handed to a spare, or {"exit": why}
    spare/<member>/host           the host that started spare <member>
    host/<h>/beat                 host h's heartbeat: a counter it adds to (no clocks compared)
    host/<h>/lost, host/<h>/left  host h was declared lost (by the host named), or ended its part
    host/<h>/declared             a counter: the first host to declare h lost is the one that acts
    rank/<r>/host                 the host whose process is rank r now

A host is one elastic worker (goodput.run.spares.Host): the process of one rank and some spares,
on one node. The host that saw its rank die decides (`Roster.decide`). A lost node takes its hosts
with it, so nobody there records the deaths: each host watches the next one's heartbeat (a ring),
and the first to see one stand still for `LOST_S` declares it lost, records the deaths of the ranks
it held, never hands out its spares, and decides in its place. A host declared lost that still
lives (a stall, not a death) ends its processes as soon as it reads that. The decision: once every
other rank of the generation has reported (a gloo collective fails in a survivor as soon as its
peer's socket closes), a plan if they all stand at the same finished step and a spare is free,
else an abort. Every wait is bounded by `timeout_s` (parallel.recovery_timeout_s); a survivor that
waits longer aborts itself. An abort is today's path: the survivors write a rescue of that step and
the group restarts.
"""

from __future__ import annotations

import json
import logging
import re
import time
from datetime import timedelta

from goodput.untrusted import RecordError, field, parse_record, set_aside

log = logging.getLogger(__name__)

BEAT_S = 0.2  # a host's heartbeat period
LOST_S = 5.0  # a host whose heartbeat stood still this long is lost (and with it its node's processes)
POLL_S = 0.005  # the decider's look at the reports: a few ms, only while a recovery is decided
RECORDS = "recoveries"  # beside the checkpoints: one record per in-process recovery
# the phases of an in-process recovery, in order (docs/goodput.md, the recovery record)
PHASES = ("failure", "detected", "group_rebuilt", "state_sent", "loader_ready", "first_step")


def prefix(round_: int) -> str:
    return f"goodput/restart{round_}/spares/"


def _json(data: bytes | str) -> dict:
    value = json.loads(data)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


class Roster:
    """The protocol on `store` (a PrefixStore of the job's store, see the module's docstring) for
    a job of `world` ranks. Methods named for who calls them: hosts (`death`, `decide`, `gone`),
    survivors (`report`, `await_decision`), spares (`register`, then a wait on `assignment(member)`),
    rank 0 at the end (`close`)."""

    def __init__(self, store, world: int, timeout_s: float):
        self.store, self.world, self.timeout_s = store, world, timeout_s

    # -- identity and generations ----------------------------------------------------------------
    def member(self) -> int:
        """A new member id, unique across the job's processes."""
        return self.store.add("members", 1) - 1

    def generation(self) -> int:
        return int(self.store.get("gen")) if self.store.check(["gen"]) else 0

    def mark(self, gen: int, phase: str, rank: int, when: float | None = None) -> None:
        self.store.set(f"gen{gen}/mark/{phase}/{rank}", repr(time.time() if when is None else when))

    def marks(self, gen: int, phase: str, ranks) -> list[float]:
        keys = [f"gen{gen}/mark/{phase}/{r}" for r in ranks]
        return [float(self.store.get(k)) for k in keys if self.store.check([k])]

    # -- spares ---------------------------------------------------------------------------------
    def register(self, member: int) -> bool:
        """A spare ready to take a rank's place. False: the run is over already (exit)."""
        i = self.store.add("spares/n", 1) - 1
        self.store.set(f"spares/{i}", str(member))
        return not self.closed()  # read after the registration: close() then sees this one

    def closed(self) -> bool:
        return self.store.check(["closed"])

    def gone(self, member: int) -> None:
        """A registered spare died while it waited: never hand it out."""
        self.store.set(f"spares/gone/{member}", "1")

    @staticmethod
    def assignment(member: int) -> str:
        """The key of what spare `member` is handed: a plan, or {"exit": why}."""
        return f"spare/{member}/assign"

    def _claim_spare(self) -> int | None:
        while True:
            i = self.store.add("spares/taken", 1) - 1
            if i >= self.store.add("spares/n", 0):
                return None
            member = int(self.store.get(f"spares/{i}"))
            if self.store.check([f"spares/gone/{member}"]):
                continue
            host = self.spare_host(member)
            if host is None or not self.lost(host):
                return member

    # -- hosts ----------------------------------------------------------------------------------
    def place_rank(self, rank: int, host: int) -> None:
        self.store.set(f"rank/{rank}/host", str(host))

    def place_spare(self, member: int, host: int) -> None:
        """Before the spare registers: a spare of a lost host is never handed out."""
        self.store.set(f"spare/{member}/host", str(host))

    def spare_host(self, member: int) -> int | None:
        key = f"spare/{member}/host"
        return int(self.store.get(key)) if self.store.check([key]) else None

    def ranks_of(self, host: int) -> list[int]:
        keys = [f"rank/{r}/host" for r in range(self.world)]
        return [r for r, k in enumerate(keys) if self.store.check([k]) and int(self.store.get(k)) == host]

    def beat(self, host: int) -> int:
        return self.store.add(f"host/{host}/beat", 1)

    def beats(self, host: int) -> int:
        return self.store.add(f"host/{host}/beat", 0)

    def lost(self, host: int) -> bool:
        return self.store.check([f"host/{host}/lost"])

    def leave(self, host: int) -> None:
        """Host `host` ends its part (its processes are done): not watched from now on."""
        self.store.set(f"host/{host}/left", "1")

    def watched(self, host: int, hosts: int) -> int | None:
        """The host that `host` watches: the next one in the ring of `hosts` that neither was declared
        lost nor left (None: no other). A lost one's successor is watched in its place."""
        for k in range(1, hosts):
            h = (host + k) % hosts
            if not self.store.check([f"host/{h}/lost"]) and not self.store.check([f"host/{h}/left"]):
                return h
        return None

    def declare_lost(self, host: int, by: int) -> bool:
        """Host `by` saw host `host`'s heartbeat stand still. True: `by` is the first to say so (it
        records the deaths and decides); False: another host did, or `host` left meanwhile."""
        if self.store.check([f"host/{host}/left"]) or self.store.add(f"host/{host}/declared", 1) != 1:
            return False
        self.store.set(f"host/{host}/lost", str(by))
        return True

    def close(self, why: str) -> None:
        """The run is over: every spare still waiting is told to exit (one registering meanwhile
        reads `closed` after its registration)."""
        self.store.set("closed", why)
        n, taken = self.store.add("spares/n", 0), self.store.add("spares/taken", 0)
        for i in range(taken, n):
            member = int(self.store.get(f"spares/{i}"))
            self.store.set(self.assignment(member), json.dumps({"exit": why}))

    # -- a failure ------------------------------------------------------------------------------
    def death(self, gen: int, rank: int, cause: str) -> int:
        """A host saw rank `rank` of generation `gen` die. Returns how many deaths that generation
        has seen (1: this host decides)."""
        n = self.store.add(f"gen{gen}/dead", 1)
        self.store.set(f"gen{gen}/dead/{n}", json.dumps({"rank": rank, "cause": cause, "time": time.time()}))
        return n

    def report(self, gen: int, rank: int, step: int | None, why: str | None = None) -> None:
        """A survivor: its state is whole at the end of `step` (None: it is not, `why`)."""
        state = {"ok": step is not None, "step": step, "why": why, "time": time.time()}
        self.store.set(f"gen{gen}/state/{rank}", json.dumps(state))

    def abort(self, gen: int, why: str) -> dict:
        """Ask for the fall back; returns the decision that stands (a plan written first stays)."""
        return _json(self.store.compare_set(f"gen{gen}/decision", "", json.dumps({"abort": why})))

    def decide(
        self, gen: int, dead: int, cause: str, detected: float, holders: list[int] | None = None
    ) -> dict:
        """The host of dead rank `dead` (the first death of generation `gen`): wait for every other
        rank's report, at most `timeout_s`, then write the decision. `holders`: the ranks that hold
        all of `dead`'s state (Strategy.holders: under hsdp its shard's replicas; None: every other
        rank); the lowest sends it to the spare. Returns the decision that stands."""
        deadline = time.monotonic() + self.timeout_s
        others = [r for r in range(self.world) if r != dead]
        senders = others if holders is None else [r for r in holders if r in others]
        if not senders:
            return self.abort(gen, f"no survivor holds rank {dead}'s shard")
        states: dict[int, dict] = {}
        while True:
            if self.store.add(f"gen{gen}/dead", 0) > 1:
                return self.abort(gen, "two ranks lost at once")
            for r in others:
                key = f"gen{gen}/state/{r}"
                if r not in states and self.store.check([key]):
                    states[r] = _json(self.store.get(key))
            bad = [(r, s["why"]) for r, s in states.items() if not s["ok"]]
            if bad:
                return self.abort(gen, "; ".join(f"rank {r}: {why}" for r, why in bad))
            if len(states) == len(others):
                break
            if self.store.check([f"gen{gen}/decision"]):  # a survivor gave up waiting
                return _json(self.store.get(f"gen{gen}/decision"))
            if time.monotonic() > deadline:
                missing = sorted(set(others) - set(states))
                return self.abort(gen, f"rank(s) {missing} did not report within parallel.recovery_timeout_s="
                                       f"{self.timeout_s:g}s")  # fmt: skip
            time.sleep(POLL_S)
        steps = sorted({s["step"] for s in states.values()})
        if len(steps) > 1:  # one survivor finished a step the others did not: no common state
            return self.abort(gen, f"the survivors stand at different steps {steps}")
        spare = self._claim_spare()
        if spare is None:
            return self.abort(gen, "no spare left")
        host = self.spare_host(spare)
        plan = {"gen": gen + 1, "world": self.world, "rank": dead, "spare": spare, "step": steps[0],
                "sender": min(senders), "cause": cause, "detected": detected}  # fmt: skip
        decision = _json(self.store.compare_set(f"gen{gen}/decision", "", json.dumps({"plan": plan})))
        if "plan" in decision:
            if host is not None:
                self.place_rank(dead, host)
            self.store.set("gen", str(gen + 1))
            self.store.set(self.assignment(spare), json.dumps(decision["plan"]))
        return decision

    def decision(self, gen: int) -> dict:
        """Generation `gen`'s decision so far ({} while there is none)."""
        key = f"gen{gen}/decision"
        return _json(self.store.get(key)) if self.store.check([key]) else {}

    def await_decision(self, gen: int) -> dict:
        """A survivor, after its report: the decision, or an abort of its own after `timeout_s`."""
        key = f"gen{gen}/decision"
        try:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
        except RuntimeError:
            return self.abort(gen, f"no decision within parallel.recovery_timeout_s={self.timeout_s:g}s")
        return _json(self.store.get(key))


# -- the records ----------------------------------------------------------------------------------
_RECORD = re.compile(r"attempt([0-9]{4,})-([0-9]{3,})\.json")


def record_name(attempt: int, n: int) -> str:
    return f"{RECORDS}/attempt{attempt:04d}-{n:03d}.json"


def check_record(data: bytes, what: str) -> dict:
    """An in-process recovery's record (goodput.run.spares), every field the summary reads checked."""
    rec = parse_record(data, what)
    if field(rec, "kind", str, what) != "in_process":
        raise RecordError(f"{what}: 'kind' is {rec['kind'][:40]!r}, expected 'in_process'")
    field(rec, "attempt", int, what, minimum=0)
    field(rec, "n", int, what, minimum=1)
    field(rec, "dead_rank", int, what, minimum=0)
    field(rec, "spare", int, what, minimum=0)
    field(rec, "step", int, what, minimum=0)
    field(rec, "lost_steps", int, what, minimum=0)
    field(rec, "failure_source", str, what)
    for part in ("seconds", "at"):
        values = field(rec, part, dict, what)
        for k in values:
            field(values, k, (int, float), f"{what} {part}")
    field(rec, "total_seconds", (int, float), what, default=0.0)
    return rec


class Recoveries:
    """The in-process recovery records beside the checkpoints, each read as untrusted input; a
    malformed one is moved aside with a warning naming it."""

    def __init__(self, storage):
        self.storage = storage

    def records(self) -> list[dict]:
        listing = sorted(self.storage.ls(RECORDS).items())
        names = [k for k, size in listing if _RECORD.fullmatch(k) and size >= 0]
        out = []
        for k, data in zip(names, self.storage.read_each(f"{RECORDS}/{k}" for k in names)):
            if data is None:  # gone since the listing
                continue
            try:
                rec = check_record(data, f"{RECORDS}/{k}")
                m = _RECORD.fullmatch(k)
                if (rec["attempt"], rec["n"]) != (int(m.group(1)), int(m.group(2))):
                    raise RecordError(f"{RECORDS}/{k}: attempt and number differ from the file name")
                out.append(rec)
            except RecordError as e:
                set_aside(self.storage, f"{RECORDS}/{k}", e)
        return sorted(out, key=lambda r: r["n"])
