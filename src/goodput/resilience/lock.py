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

from goodput.storage import Storage

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

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.storage.read_bytes(self.NAME))
        except (FileNotFoundError, ValueError):
            return None

    def _stale(self, h: dict) -> str | None:
        if h["host"] == socket.gethostname() and not _pid_alive(h["pid"]):
            return f"process {h['pid']} is gone"
        age = time.time() - h.get("heartbeat", h["started"])
        if age > self.stale_seconds:
            return f"no heartbeat for {age:.0f}s"
        return None

    def acquire(self) -> None:
        h = self._holder()
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
