"""Fault injection for drills. Each fault fires once per run: a marker beside the checkpoints
records that it fired, so relaunching the same command (or an elastic restart) runs on."""

from __future__ import annotations

import logging
import os
import signal

from goodput.storage import Storage

log = logging.getLogger(__name__)


class Faults:
    def __init__(
        self, storage: Storage, rank: int, kill_at_step=None, kill_during_save=None, target_rank: int = 0
    ):
        self.storage, self.rank, self.target_rank = storage, rank, target_rank
        self.kill_at_step, self.kill_during_save = kill_at_step, kill_during_save

    def _fire(self, name: str) -> None:
        marker = f"faults/{name}.fired"
        if self.storage.exists(marker):
            return
        self.storage.write_bytes(marker, b"")
        log.warning("fault injection: SIGKILL rank %d (%s)", self.rank, name)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def at_step(self, step: int) -> None:
        if self.kill_at_step is not None and step == self.kill_at_step and self.rank == self.target_rank:
            self._fire(f"kill_at_step-{step}")

    def during_save(self, step: int) -> None:
        if (
            self.kill_during_save is not None
            and step == self.kill_during_save
            and self.rank == self.target_rank
        ):
            self._fire(f"kill_during_save-{step}")
