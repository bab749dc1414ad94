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
from goodput.logs import known_warning
from goodput.storage.checksum import CHECKSUM, TooLarge
from goodput.storage.remote import Storage


class ExportError(RuntimeError):
    pass


# trainer.eval_on -> the checkpoint group holding those weights (goodput.checkpoint.state: the EMA
# is the AveragedModel registered as `ema`, its weights under `ema.module.*`)
WEIGHTS = {"model": "model", "ema": "ema.module"}


def model_state(store: Storage, rec: dict, weights: str = "model") -> dict[str, torch.Tensor]:
    """The full state dict of commit `rec` (from `CheckpointManager.committed()` or `parse_commit`)
    of the trained model (`weights="model"`) or of its EMA (`"ema"`, trainer.eval_on), every file
    checked against the record as it downloads, and none downloaded past its recorded size. Loads
    into the model class either way."""
    if weights not in WEIGHTS:
        raise ExportError(f"weights must be one of {sorted(WEIGHTS)}, got {weights!r}")
    prefix = WEIGHTS[weights] + "."
    rel = rec.get("dir") or step_dir(rec["step"])
    with tempfile.TemporaryDirectory() as tmp:
        for name, want in rec["files"].items():
            url = store.url(f"{rel}/{name}")
            try:  # a file longer than its record stops at the recorded size, nothing more is copied
                got = store.get(f"{rel}/{name}", os.path.join(tmp, name), limit=want["bytes"])
            except TooLarge as e:
                raise ExportError(f"{url}: {e}: it does not match its commit record") from None
            if got.size != want["bytes"] or got.digest != want[CHECKSUM]:
                raise ExportError(f"{url} does not match its commit record")
        if rec["format"] == "torch_save":
            full = torch.load(os.path.join(tmp, "state.pt"), map_location="cpu", weights_only=True)
            top, _, sub = WEIGHTS[weights].partition(".")
            sd = full.get(top, {})
            sd = {f"{top}.{k}": v for k, v in sd.items()} if isinstance(sd, dict) else {}
            sd = {k: v for k, v in sd.items() if k.startswith(prefix)}
        else:
            reader = SafeFileSystemReader(tmp)
            md = reader.read_metadata()
            sd = {
                k: torch.empty(m.size, dtype=m.properties.dtype)
                for k, m in md.state_dict_metadata.items()
                if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
            }
            if sd:
                # One process reads the whole model on purpose (no_dist); DCP warns that it assumes so.
                with known_warning("torch.distributed is disabled", "torch.distributed.checkpoint"):
                    dcp.load(sd, storage_reader=reader, no_dist=True)
        if not sd:
            raise ExportError(
                f"{store.url(rel)} holds no {weights} weights ({prefix}*)"
                + (": it was written without trainer.ema_decay" if weights == "ema" else "")
            )
        return {k[len(prefix) :]: v for k, v in sd.items()}


def save_safetensors(sd: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """Tensors only (no pickle: loading runs no code), contiguous, written atomically."""
    from safetensors.torch import save_file

    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({k: v.detach().cpu().contiguous() for k, v in sd.items()}, tmp, metadata=metadata)
    os.replace(tmp, path)
