"""Checkpointing: one manager (stage, upload, commit, discover, retain, restore), three backends."""

from goodput.checkpoint.backends import BACKENDS, READERS, DCPAsync, DCPSync, TorchSave
from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.layout import COMMIT, CommitError, parse_commit, parse_step, step_dir
from goodput.checkpoint.manager import CheckpointManager, SaveFailed
from goodput.checkpoint.state import AppState, RNGState

__all__ = [
    "BACKENDS",
    "COMMIT",
    "READERS",
    "AppState",
    "CheckpointConfig",
    "CheckpointManager",
    "CommitError",
    "DCPAsync",
    "DCPSync",
    "RNGState",
    "SaveFailed",
    "TorchSave",
    "parse_commit",
    "parse_step",
    "step_dir",
]
