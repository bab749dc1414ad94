"""Checkpointing: one manager (stage, upload, commit, discover, retain, restore), three backends.

The names below load their module on first use (`from goodput.checkpoint import CheckpointManager`
works as usual): the schema, goodput.checkpoint.config, is imported whenever Hydra composes the
config (`--help`, the compose API), and must not bring torch.distributed.checkpoint with it."""

import importlib

_MODULE = {
    "BACKENDS": "backends",
    "READERS": "backends",
    "DCPAsync": "backends",
    "DCPSync": "backends",
    "TorchSave": "backends",
    "CheckpointConfig": "config",
    "COMMIT": "layout",
    "CommitError": "layout",
    "parse_commit": "layout",
    "parse_step": "layout",
    "step_dir": "layout",
    "CheckpointManager": "manager",
    "SaveFailed": "manager",
    "AppState": "state",
    "RNGState": "state",
}
__all__ = sorted(_MODULE)


def __getattr__(name: str):
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE[name]}"), name)
