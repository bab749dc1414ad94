"""One job per run: a lock file beside the checkpoints, with stale-lock detection.

Two jobs writing the same checkpoint dir would interleave commits and retention. The lock names
its holder (host, pid, start time) and is refreshed by a heartbeat; a lock whose process is gone
(same host) or whose heartbeat is older than `stale_seconds` is taken over, so a crashed job
never blocks its own relaunch.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from goodput.storage.remote import Storage
from goodput.untrusted import RecordError, field, parse_record

log = logging.getLogger(__name__)


class RunLocked(RuntimeError):
    pass


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
    field(rec, "token", str, what)
    field(rec, "started", (int, float), what)
    field(rec, "heartbeat", (int, float), what, default=rec["started"])
    return rec


class RunLock:
    NAME = "LOCK.json"

    def __init__(self, storage: Storage, stale_seconds: float = 120.0, heartbeat_seconds: float = 10.0):
        self.storage, self.stale_seconds, self.heartbeat_seconds = storage, stale_seconds, heartbeat_seconds
        self.token = uuid.uuid4().hex
        self.record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "token": self.token,
        }
        self._stop = threading.Event()
        self._thread = None

    def _holder(self, set_aside: bool = False) -> dict | None:
        """The lock record, checked as untrusted input, or None when there is none. A malformed one
        (a hand edit, a torn write) is no one's lock: with `set_aside` it is moved aside with a
        warning (kept for a look), else treated as absent."""
        try:
            data = self.storage.read_bytes(self.NAME)
        except FileNotFoundError:
            return None
        try:
            return check_lock(data, self.storage.url(self.NAME))
        except RecordError as e:
            if set_aside:
                aside = f"{self.NAME}.malformed-{int(time.time())}"
                log.warning("%s: not a lock, moving it to %s", e, self.storage.url(aside))
                self.storage.mv(self.NAME, aside)
            return None

    def _stale(self, h: dict) -> str | None:
        if h["host"] == socket.gethostname() and h["pid"] == os.getpid():
            # Not this lock (its token differs), yet this process's PID: a container restarted with
            # the same PID, or a record copied over. The holder is gone either way.
            return f"it names this process (pid {h['pid']}) with another token"
        if h["host"] == socket.gethostname() and not _pid_alive(h["pid"]):
            return f"process {h['pid']} is gone"
        age = time.time() - h.get("heartbeat", h["started"])
        if age > self.stale_seconds:
            return f"no heartbeat for {age:.0f}s"
        return None

    def acquire(self) -> None:
        h = self._holder(set_aside=True)
        if h is not None and h.get("token") != self.token:
            why = self._stale(h)
            if why is None:
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"]))
                raise RunLocked(
                    f"another job is using {self.storage.url()}: pid {h['pid']} on {h['host']}, "
                    f"started {started}. Wait for it, stop it, or use another run.name. A crashed job's "
                    f"lock is taken over at once on its own host, elsewhere after {self.stale_seconds:.0f}s "
                    "without heartbeat."
                )
            log.warning(
                "taking over a stale lock of %s (pid %s on %s): %s",
                self.storage.url(),
                h["pid"],
                h["host"],
                why,
            )
        self._write()
        time.sleep(0.05)  # object stores have no create-if-absent: write, then check that we won
        h = self._holder()
        if h is None or h.get("token") != self.token:
            raise RunLocked(f"another job took the lock of {self.storage.url()} at the same moment: {h}")
        self._thread = threading.Thread(target=self._beat, name="run-lock", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        self.storage.write_bytes(self.NAME, json.dumps({**self.record, "heartbeat": time.time()}).encode())

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                self._write()
            except Exception as e:
                log.warning("could not refresh the run lock: %s", e)

    def release(self) -> None:
        self._stop.set()
        h = self._holder()
        if h is not None and h.get("token") == self.token:
            self.storage.rm(self.NAME)
