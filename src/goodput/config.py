"""Checks on the resolved config that must fail before any work starts, each naming the key."""

from __future__ import annotations

import os

import torch

from goodput.checkpoint import BACKENDS
from goodput.data.sources import SOURCES
from goodput.parallel import STRATEGIES
from goodput.storage import check_url


class ConfigError(ValueError):
    pass


def validate(c: dict) -> None:
    errors = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errors.append(msg)

    tr, ck, dc, par = c["trainer"], c["checkpoint"], c["data"], c["parallel"]
    need(
        isinstance(tr["max_steps"], int) and tr["max_steps"] > 0,
        f"trainer.max_steps must be > 0, got {tr['max_steps']}",
    )
    gbs = tr["global_batch_size"]
    need(isinstance(gbs, int) and gbs > 0, f"trainer.global_batch_size must be > 0, got {gbs}")
    need(
        tr["eval_every_n_steps"] >= 0,
        f"trainer.eval_every_n_steps must be >= 0, got {tr['eval_every_n_steps']}",
    )
    need(tr["log_every_n_steps"] > 0, f"trainer.log_every_n_steps must be > 0, got {tr['log_every_n_steps']}")
    need(tr["num_threads"] > 0, f"trainer.num_threads must be > 0, got {tr['num_threads']}")

    need(
        ck["backend"] in BACKENDS,
        f"checkpoint.backend must be one of {sorted(BACKENDS)}, got {ck['backend']!r}",
    )
    for key in ("every_n_steps", "every_n_minutes"):
        v = ck[key]
        need(v is None or v > 0, f"checkpoint.{key} must be > 0 or null, got {v}")
    need(
        ck["keep_last"] >= 1,
        f"checkpoint.keep_last must be >= 1 (the newest commit is never deleted), got {ck['keep_last']}",
    )
    need(
        ck.get("async_type", "thread") in ("thread", "process"),
        f"checkpoint.async_type must be thread|process, got {ck.get('async_type')!r}",
    )
    need(
        ck.get("on_error", "raise") in ("raise", "continue"),
        f"checkpoint.on_error must be raise|continue, got {ck.get('on_error')!r}",
    )

    need(dc["backend"] in SOURCES, f"data.backend must be one of {sorted(SOURCES)}, got {dc['backend']!r}")
    need(dc["num_workers"] >= 0, f"data.num_workers must be >= 0, got {dc['num_workers']}")
    need(dc["image_size"] >= 8, f"data.image_size must be >= 8, got {dc['image_size']}")
    need(dc["prefetch_steps"] >= 1, f"data.prefetch_steps must be >= 1, got {dc['prefetch_steps']}")
    need(dc["prefetch_threads"] >= 1, f"data.prefetch_threads must be >= 1, got {dc['prefetch_threads']}")
    need(
        dc["on_bad_sample"] in ("error", "skip"),
        f"data.on_bad_sample must be error|skip, got {dc['on_bad_sample']!r}",
    )
    if dc["cache_limit"] is not None:
        need(dc["cache_limit"] > 0, f"data.cache_limit must be > 0 bytes or null, got {dc['cache_limit']}")

    st = c["storage"]
    for key in ("latency_ms", "bandwidth_mb_s"):
        need(st[key] >= 0, f"storage.{key} must be >= 0, got {st[key]}")
    need(0 <= st["error_rate"] < 1, f"storage.error_rate must be in [0, 1), got {st['error_rate']}")
    for key, url in (("data.root", dc["root"]), ("checkpoint.dir", ck["dir"])):
        try:
            check_url(str(url), key)
        except ValueError as e:
            errors.append(str(e))

    need(
        par["strategy"] in STRATEGIES,
        f"parallel.strategy must be one of {sorted(STRATEGIES)}, got {par['strategy']!r}",
    )
    n = par["nproc_per_node"]
    external = "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if external else n
    need(n >= 1, f"parallel.nproc_per_node must be >= 1, got {n}")
    need(par["max_restarts"] >= 0, f"parallel.max_restarts must be >= 0, got {par['max_restarts']}")
    need(par["rdzv_timeout_s"] > 0, f"parallel.rdzv_timeout_s must be > 0, got {par['rdzv_timeout_s']}")
    if not external and n >= 1:
        limit = torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)
        need(n <= limit, f"parallel.nproc_per_node={n} is more processes than this machine can run ({limit})")
    if par["strategy"] == "fsdp":
        need(world > 1, "parallel=fsdp needs more than one process (set parallel.nproc_per_node >= 2)")
    if par["strategy"] == "single":
        need(
            world == 1,
            f"parallel=single runs one process, but the world size is {world}: use parallel=ddp or fsdp",
        )
    if isinstance(gbs, int) and gbs > 0 and world >= 1:
        need(gbs % world == 0, f"trainer.global_batch_size={gbs} is not divisible by the world size {world}")

    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
