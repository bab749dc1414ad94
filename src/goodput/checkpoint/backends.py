"""Three ways to write a checkpoint into a node-local directory. One class per `checkpoint=` option.

A backend only writes (and reads) a local directory; staging, upload, commit, discovery and
retention are the manager's, identical for all three. `save()` returns a `Pending` whose
`staged()` is when the loop may mutate parameters again and `result()` when the local files are
complete. Sync backends return finished work; `dcp_async` returns real futures.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions

from goodput.storage import atomic_write

log = logging.getLogger(__name__)


class CheckpointLoadError(RuntimeError):
    pass


def _done() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


class Pending:
    def __init__(self, staging: Future | None = None, upload: Future | None = None):
        self._staging, self._upload = staging or _done(), upload or _done()

    def staged(self) -> None:
        self._staging.result()

    def staged_done(self) -> bool:
        return self._staging.done()

    def result(self) -> None:
        self._upload.result()


# -- safe reading of DCP metadata -------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles `.metadata`; a file we did not write could carry code. Only DCP's own metadata
    classes, torch dtypes/Size/layout and paths may be constructed."""

    def find_class(self, module, name):
        ok = (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module in ("torch._utils", "torch.serialization") and name == "_get_layout")
            or (
                module == "pathlib"
                and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
            )
            or (module == "collections" and name == "OrderedDict")
        )
        if not ok:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not allowed"
            )
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = os.path.join(str(self.path), ".metadata")
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _fill_template_from_metadata(template: dict, md) -> dict:
    """Extras have checkpoint-defined sizes: allocate them from the metadata; refuse any key that is
    not a plain tensor (a BYTE_IO item would be unpickled without weights_only)."""
    out = {}
    for group, val in template.items():
        if group in ("model", "optim"):
            out[group] = val
            continue
        out[group] = {}
        for k in val:
            fqn = f"{group}.{k}"
            meta = md.state_dict_metadata.get(fqn)
            if meta is None:
                raise CheckpointLoadError(f"checkpoint has no entry {fqn}")
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointLoadError(f"checkpoint entry {fqn} is not a tensor: refusing to unpickle it")
            out[group][k] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return out


# -- backends ---------------------------------------------------------------------------------
class TorchSave:
    """Rank 0 gathers the full state and writes one file synchronously: the baseline."""

    name = "torch_save"
    is_async = False
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def __init__(self, **_):
        pass

    def save(self, sd: dict, local_dir: str, rank: int, world: int, pg) -> Pending:
        rank_key = f"rank{rank}"
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(sd[rank_key], gathered, dst=0, group=pg)
        if rank == 0:
            full = {k: v for k, v in sd.items() if not k.startswith("rank")}
            for r, part in enumerate(gathered):
                full[f"rank{r}"] = part
            buf = io.BytesIO()
            torch.save(full, buf)
            os.makedirs(local_dir, exist_ok=True)
            atomic_write(os.path.join(local_dir, "state.pt"), buf.getvalue())
        return Pending()

    def rank_files(self, local_dir: str, rank: int) -> list[str]:
        return ["state.pt"] if rank == 0 else []

    def prepare_load(self, template: dict, local_dir: str) -> dict:
        """Local and fallible: read and check the file (no collectives)."""
        # weights_only=True: only tensors and plain containers, never arbitrary objects.
        path = os.path.join(local_dir, "state.pt")
        full = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        missing = [g for g in template if g not in full]
        if missing:
            raise CheckpointLoadError(f"state.pt lacks {missing}")
        return {g: full[g] for g in template}

    def load(self, sd: dict, local_dir: str) -> None:
        pass  # prepare_load already read everything

    def close(self) -> None:
        pass


class DCPSync:
    """torch.distributed.checkpoint.save: every rank writes its own shard; `.metadata` last."""

    name = "dcp_sync"
    is_async = False
    options = StateDictOptions()

    def __init__(self, thread_count: int = 1, **_):
        self.thread_count = thread_count

    def _writer(self, local_dir: str) -> FileSystemWriter:
        return FileSystemWriter(local_dir, sync_files=True, thread_count=self.thread_count, overwrite=False)

    def save(self, sd: dict, local_dir: str, rank: int, world: int, pg) -> Pending:
        dcp.save(sd, storage_writer=self._writer(local_dir), process_group=pg)
        return Pending()

    def rank_files(self, local_dir: str, rank: int) -> list[str]:
        mine = sorted(
            f for f in os.listdir(local_dir) if f.startswith(f"__{rank}_") and f.endswith(".distcp")
        )
        # .metadata goes last: it is what makes a DCP checkpoint loadable.
        return mine + ([".metadata"] if rank == 0 else [])

    def prepare_load(self, template: dict, local_dir: str) -> dict:
        """Local and fallible: read the metadata safely and size the extras (no collectives)."""
        return _fill_template_from_metadata(template, SafeFileSystemReader(local_dir).read_metadata())

    def load(self, sd: dict, local_dir: str) -> None:
        """Collective: every rank reads the chunks it needs into `sd`, in place."""
        dcp.load(sd, storage_reader=SafeFileSystemReader(local_dir))

    def close(self) -> None:
        pass


class DCPAsync(DCPSync):
    """dcp.async_save: the loop pays for staging a CPU copy; the write runs in the background on a
    process group nobody else uses. Pinned memory / non-blocking copies only where CUDA exists."""

    name = "dcp_async"
    is_async = True

    def __init__(self, async_type: str = "thread", thread_count: int = 1, **_):
        super().__init__(thread_count=thread_count)
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if async_type not in ("thread", "process"):
            raise ValueError(f"checkpoint.async_type must be 'thread' or 'process', got {async_type!r}")
        self.async_type = AsyncCheckpointerType(async_type)
        self._stager = None

    def _make_stager(self):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        # StagingOptions() defaults are CUDA-only: non-blocking copy raises without an accelerator.
        opts = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=self.async_type.value == "process",
            use_async_staging=cuda,  # overlap the D2H copy with compute; on CPU the copy *is* the stall
            use_non_blocking_copy=cuda,
        )
        return DefaultStager(opts)

    def save(self, sd: dict, local_dir: str, rank: int, world: int, pg) -> Pending:
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        if self._stager is None:  # reused: keeps one staging buffer instead of allocating per save
            self._stager = self._make_stager()
        resp = dcp.async_save(
            sd,
            storage_writer=self._writer(local_dir),
            process_group=pg,
            async_checkpointer_type=self.async_type,
            async_stager=self._stager,
        )
        if isinstance(resp, AsyncSaveResponse):
            return Pending(resp.staging_completion, resp.upload_completion)
        return Pending(None, resp)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


BACKENDS = {"torch_save": TorchSave, "dcp_sync": DCPSync, "dcp_async": DCPAsync}
