"""Checkpointing: one manager (stage, upload, commit, discover, retain, restore), three backends."""

from goodput.checkpoint.backends import BACKENDS, DCPAsync, DCPSync, TorchSave
from goodput.checkpoint.manager import CheckpointConfig, CheckpointManager, SaveFailed, step_dir
from goodput.checkpoint.state import AppState, RNGState, StatefulDict

__all__ = [
    "BACKENDS",
    "AppState",
    "CheckpointConfig",
    "CheckpointManager",
    "DCPAsync",
    "DCPSync",
    "RNGState",
    "SaveFailed",
    "StatefulDict",
    "TorchSave",
    "step_dir",
]
