"""The model out of a committed checkpoint, whole, on CPU: for `inspect_checkpoint.py --export` (a
safetensors file) and for the model logged to MLflow. Any backend, any world size: DCP shards
(DDP or FSDP, N ranks) are gathered into full tensors by DCP's own planner, on one process."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from goodput.checkpoint.backends import SafeFileSystemReader
from goodput.checkpoint.layout import step_dir
from goodput.storage import CHECKSUM, Storage


class ExportError(RuntimeError):
    pass


def model_state(store: Storage, rec: dict) -> dict[str, torch.Tensor]:
    """The full model state dict of commit `rec` (from `CheckpointManager.committed()` or
    `parse_commit`), every file checked against the record as it downloads."""
    rel = rec.get("dir") or step_dir(rec["step"])
    with tempfile.TemporaryDirectory() as tmp:
        for name, want in rec["files"].items():
            got = store.get(f"{rel}/{name}", os.path.join(tmp, name))
            if got.size != want["bytes"] or got.digest != want[CHECKSUM]:
                raise ExportError(f"{store.url(rel + '/' + name)} does not match its commit record")
        if rec["format"] == "torch_save":
            return torch.load(os.path.join(tmp, "state.pt"), map_location="cpu", weights_only=True)["model"]
        reader = SafeFileSystemReader(tmp)
        md = reader.read_metadata()
        sd = {
            k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in md.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
        }
        dcp.load(sd, storage_reader=reader, no_dist=True)
        return {k[len("model.") :]: v for k, v in sd.items()}


def save_safetensors(sd: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """Tensors only (no pickle: loading runs no code), contiguous, written atomically."""
    from safetensors.torch import save_file

    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({k: v.detach().cpu().contiguous() for k, v in sd.items()}, tmp, metadata=metadata)
    os.replace(tmp, path)
