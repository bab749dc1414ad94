"""Registers the `goodput.identity` resolver (goodput.identity) for every Hydra composition.

Hydra imports every module under `hydra_plugins` when it starts (its plugin discovery), before it
composes a config: so `run.name: ${run.experiment}-${goodput.identity:}` and `hydra.run.dir`, which
interpolates run.name, resolve in `scripts/train.py`, in `hydra.compose` from a notebook or a test,
and in `--cfg job`, without importing anything of goodput first. Importing goodput.identity is all
it takes (it registers on import; no torch)."""

import goodput.identity  # noqa: F401
