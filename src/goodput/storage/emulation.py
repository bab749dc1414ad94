"""Emulation of what a network volume costs: latency per operation, a bandwidth cap, transient errors.

A laptop has no network between the trainer and its data or checkpoints, so a demo there would
show none of what a cluster pays for them. `Storage` calls `op()` before every remote operation
and `transfer(n)` for every n bytes it moves, and nowhere else: node-local files (the cache,
checkpoint staging) pay nothing, as on a cluster. With the `storage` node's latency_ms,
bandwidth_mb_s and error_rate at 0 (a real cluster's setting) both return at once.
"""

from __future__ import annotations

import random
import time


class InjectedFault(OSError):
    """A transient error injected by `storage.error_rate` (stands in for a 503 / connection reset)."""


class Emulation:
    """One process's emulated costs: latency_ms per operation, bandwidth_mb_s per stream (0 =
    unlimited), and error_rate, the chance that an operation fails with InjectedFault (retried
    like any transient error)."""

    def __init__(self, latency_ms: float, bandwidth_mb_s: float, error_rate: float):
        self.latency_ms, self.bandwidth_mb_s, self.error_rate = latency_ms, bandwidth_mb_s, error_rate
        self.reseed()

    def reseed(self) -> None:
        """A fresh random stream: a forked process calls this, so workers do not fail in lockstep."""
        self._rng = random.Random()

    def op(self) -> None:
        if self.latency_ms:
            time.sleep(self.latency_ms / 1000.0)
        if self.error_rate and self._rng.random() < self.error_rate:
            raise InjectedFault("injected transient storage error (storage.error_rate)")

    def transfer(self, nbytes: int) -> None:
        if self.bandwidth_mb_s:
            time.sleep(nbytes / (self.bandwidth_mb_s * 1e6))

    def __repr__(self):
        return f"latency_ms={self.latency_ms}, bw={self.bandwidth_mb_s}"
