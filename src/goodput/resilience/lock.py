"""One job per run: a lock file beside the checkpoints, taken by an exclusive create.

Two jobs writing the same checkpoint dir would interleave commits and retention. The lock names its
holder (host, pid, start time, a token of its own) and is never rewritten: `LOCK.json` is only ever
created with `Storage.create_exclusive` (link(2) on a local or POSIX store, a conditional PUT on S3),
so of two jobs that start together exactly one creates it, however late the other's write lands. The
holder's heartbeat is a file of its own, `LOCK.beat-<token>`, refreshed every `heartbeat_seconds`.

A lock whose process is gone (same host) or whose heartbeat is older than `stale_seconds` is taken
over, so a crashed job never blocks its own relaunch. Of the jobs that find it stale at once, one
wins: each first creates `LOCK.takeover-<the stale holder's token>` exclusively, and only its
creator removes the stale `LOCK.json` and creates its own. A taker that died half way is itself
taken over by the same rule (its claim goes stale).

The holder checks the lock before each heartbeat and, through `check_held`, before every commit: a
job that finds another job's token in `LOCK.json` (a takeover after its heartbeat went stale: a
frozen VM, a store that did not answer) has lost the lock and stops before its next commit
(`LockLost`, one line naming the other holder). A `LOCK.json` written by an earlier version (its
heartbeat inside it) is understood: its `heartbeat` field counts as a heartbeat.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid

from goodput.errors import UserError
from goodput.storage.remote import Storage
from goodput.untrusted import RecordError, field, parse_record, printable

log = logging.getLogger(__name__)

NAME = "LOCK.json"
BEAT = "LOCK.beat-"  # + the holder's token: its heartbeat
CLAIM = "LOCK.takeover-"  # + a stale holder's token: the one job taking it over
_WARNED: set[str] = set()  # stores told once that their lock is best effort


class RunLocked(RuntimeError):
    pass


class LockLost(UserError, RuntimeError):
    """Another job holds this run's lock now: this job stops before its next commit."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_lock(data: bytes, what: str) -> dict:
    """A lock record with the fields the lock reads, of the right types (RecordError naming the file)."""
    rec = parse_record(data, what)
    field(rec, "host", str, what)
    if not 1 <= field(rec, "pid", int, what) < 1 << 31:  # os.kill overflows on larger ones
        raise RecordError(f"{what}: pid {rec['pid']} is not a process id")
    if not re.fullmatch(r"[0-9A-Za-z_-]{1,64}", field(rec, "token", str, what)):  # it names the lock's files
        raise RecordError(f"{what}: token {rec['token'][:80]!r} is not a plain name")
    field(rec, "started", (int, float), what)
    field(rec, "heartbeat", (int, float), what, default=rec["started"])  # an earlier version's
    return rec


def owns(name: str) -> bool:
    """Whether an entry of a run's dir is the lock's (LOCK.json, a heartbeat, a takeover claim)."""
    return name == NAME or name.startswith((BEAT, CLAIM))


def describe(h: dict) -> str:
    """The holder a record names, for a message (its strings escaped: the record is input)."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"]))
    return f"pid {h['pid']} on {printable(h['host'])}, started {started}"


def _holder(storage: Storage, set_aside: bool = False) -> dict | None:
    """The lock record, checked as untrusted input, or None when there is none. A malformed one (a
    hand edit) is no one's lock: with `set_aside` it is moved aside with a warning (kept for a
    look), else treated as absent."""
    try:
        data = storage.read_bytes(NAME)
    except FileNotFoundError:
        return None
    try:
        return check_lock(data, storage.url(NAME))
    except RecordError as e:
        if set_aside:
            aside = f"{NAME}.malformed-{int(time.time())}"
            log.warning("%s: not a lock, moving it to %s", e, storage.url(aside))
            try:
                storage.mv(NAME, aside)
            except FileNotFoundError:  # another job moved it first
                pass
        return None


def check_held(storage: Storage, token: str) -> None:
    """LockLost unless `storage`'s LOCK.json names `token`: what a job checks before each commit
    (goodput.checkpoint.manager). A store that does not answer raises its own error (the save fails
    as it would at its first write)."""
    h = _holder(storage)
    if h is not None and h["token"] == token:
        return
    if h is None:
        raise LockLost(
            f"the run lock {storage.url(NAME)} is gone or no longer a lock record: this job stops before "
            f"its next commit (another job may be using {storage.url()}; relaunch to take the lock again)"
        )
    raise LockLost(
        f"another job took over the run lock of {storage.url()}: {describe(h)}; this job stops before its "
        f"next commit (its heartbeat was older than run.lock_stale_seconds for that job: was this one "
        f"frozen, or its store unreachable?)"
    )


class RunLock:
    NAME = NAME

    def __init__(self, storage: Storage, stale_seconds: float = 120.0, heartbeat_seconds: float = 10.0):
        self.storage, self.stale_seconds, self.heartbeat_seconds = storage, stale_seconds, heartbeat_seconds
        self.token = uuid.uuid4().hex
        self.record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "token": self.token,
        }
        self.lost: str | None = None  # why, once the heartbeat found another job's token
        self._claims: list[str] = []  # takeover claims this job created (removed once it is done)
        self._dead: list[str] = []  # the tokens of the stale holders it takes over
        self._stop = threading.Event()
        self._thread = None

    @staticmethod
    def owns(name: str) -> bool:
        return owns(name)

    def _bytes(self) -> bytes:
        return json.dumps(self.record).encode()  # the same bytes each time: a retried create finds its own

    def _last_beat(self, h: dict) -> float:
        """The newest heartbeat of holder `h`: its beat file, or the one inside an earlier version's
        LOCK.json, or its start."""
        last = h.get("heartbeat", h["started"])
        try:
            rec = parse_record(self.storage.read_bytes(f"{BEAT}{h['token']}"), f"{BEAT}{h['token']}")
            last = max(last, field(rec, "heartbeat", (int, float), "beat"))
        except (FileNotFoundError, RecordError):
            pass  # none yet (it has only just created LOCK.json), or a malformed one: not a heartbeat
        return last

    def _stale(self, h: dict) -> str | None:
        if h["host"] == socket.gethostname() and h["pid"] == os.getpid():
            # Not this lock (its token differs), yet this process's PID: a container restarted with
            # the same PID, or a record copied over. The holder is gone either way.
            return f"it names this process (pid {h['pid']}) with another token"
        if h["host"] == socket.gethostname() and not _pid_alive(h["pid"]):
            return f"process {h['pid']} is gone"
        age = time.time() - self._last_beat(h)
        if age > self.stale_seconds:
            return f"no heartbeat for {age:.0f}s"
        return None

    def acquire(self) -> None:
        """Take the lock or raise RunLocked naming its holder; then start the heartbeat."""
        if not self.storage.exclusive and self.storage.root not in _WARNED:
            _WARNED.add(self.storage.root)
            log.warning(
                "the run lock of %s is best effort: this store has no create-if-absent (only local "
                "paths and s3:// do), so two jobs started at the same moment could both take it",
                self.storage.url(),
            )
        self.record["started"] = time.time()
        for _ in range(5):  # a lock released or set aside between two looks: look again
            if self.storage.create_exclusive(NAME, self._bytes()):
                break
            h = _holder(self.storage, set_aside=True)
            if h is None:
                continue
            why = self._stale(h)
            if why is None:
                raise RunLocked(
                    f"another job is using {self.storage.url()}: {describe(h)}. Wait for it, stop it, or "
                    f"use another run.name. A crashed job's lock is taken over at once on its own host, "
                    f"elsewhere after {self.stale_seconds:.0f}s without heartbeat."
                )
            log.warning("taking over a stale lock of %s (%s): %s", self.storage.url(), describe(h), why)
            self._take_over(h)
            break
        else:
            raise RunLocked(f"the lock of {self.storage.url()} kept changing hands: try again")
        self._write_beat()
        self._thread = threading.Thread(target=self._beat, name="run-lock", daemon=True)
        self._thread.start()

    def _claim(self, token: str, depth: int = 0) -> dict | None:
        """Win the exclusive claim of taking over the holder `token`: None when this job won it,
        else the record of the live job that did. A claimant that is itself stale (it died half way
        through its takeover) is taken over by the same rule, one winner."""
        name = f"{CLAIM}{token}"
        for _ in range(3):
            if self.storage.create_exclusive(name, self._bytes()):
                self._claims.append(name)
                return None
            try:
                other = check_lock(self.storage.read_bytes(name), self.storage.url(name))
            except FileNotFoundError:
                continue  # its winner finished and removed it: try again
            except RecordError as e:  # not a claim: no one's
                log.warning("%s: not a takeover claim, removing it", e)
                self.storage.rm(name)
                continue
            why = self._stale(other) if depth < 8 else None
            if why is None:
                return other
            log.warning("a job that was taking over the lock died (%s): %s", describe(other), why)
            self._dead.append(other["token"])
            return self._claim(other["token"], depth + 1)
        return other

    def _take_over(self, h: dict) -> None:
        """Replace the stale lock `h`: this job alone (its claim), or RunLocked."""
        self._claims, self._dead = [], [h["token"]]
        try:
            other = self._claim(h["token"])
            if other is not None:
                raise RunLocked(
                    f"another job is taking over the stale lock of {self.storage.url()} at this moment: "
                    f"{describe(other)}"
                )
            now = _holder(self.storage)
            if now is not None and now["token"] != h["token"]:  # taken meanwhile (not through a claim
                raise RunLocked(  # of ours: a job that found no lock at all)
                    f"another job took the lock of {self.storage.url()} at this moment: {describe(now)}"
                )
            if now is not None:
                self.storage.rm(NAME)
            if not self.storage.create_exclusive(NAME, self._bytes()):
                now = _holder(self.storage)
                raise RunLocked(
                    f"another job took the lock of {self.storage.url()} at this moment: "
                    f"{describe(now) if now else 'gone again'}"
                )
        finally:  # a lost race leaves nothing of this job's behind
            for name in self._claims:
                self.storage.rm(name)
        for token in self._dead:  # the stale holders' heartbeats, the claims of takers that died
            self.storage.rm(f"{BEAT}{token}")
            self.storage.rm(f"{CLAIM}{token}")

    def check(self) -> None:
        """LockLost unless the lock is still this job's (read now, not at the last heartbeat)."""
        if self.lost is not None:
            raise LockLost(self.lost)
        check_held(self.storage, self.token)

    def _write_beat(self) -> None:
        beat = {"token": self.token, "heartbeat": time.time()}
        self.storage.write_bytes(f"{BEAT}{self.token}", json.dumps(beat).encode())

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                check_held(self.storage, self.token)  # never refresh a heartbeat for a lock not ours
                self._write_beat()
            except LockLost as e:
                self.lost = str(e)
                log.error("%s", e)
                return
            except Exception as e:
                log.warning("could not refresh the run lock: %s", e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)  # a beat in flight lands before the lock goes
        try:
            h = _holder(self.storage)
            if h is not None and h["token"] == self.token:
                self.storage.rm(NAME)
            self.storage.rm(f"{BEAT}{self.token}")
        except Exception as e:  # the job's own end must not fail on it: the lock goes stale instead
            log.warning("could not release the run lock of %s: %s", self.storage.url(), e)
