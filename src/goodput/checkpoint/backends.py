"""Three ways to write a checkpoint into a node-local directory. One class per `checkpoint=` option.

A backend only writes (and reads) a local directory; staging, upload, commit, discovery and
retention are the manager's, identical for all three. `save()` returns a `Pending` whose
`staged()` is when the loop may mutate parameters again and `result()` when the local files are
complete. Sync backends return finished work; `dcp_async` returns real futures.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions

from goodput.checkpoint.layout import CommitError, check_file_name
from goodput.checkpoint.state import OPTIONAL
from goodput.storage.local import atomic_write

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

    def result(self) -> None:
        self._upload.result()


# -- safe reading of DCP checkpoints ------------------------------------------------------------
# DCP pickles `.metadata`. A pickle names the callables it wants built as (module, name) pairs, and
# protocol >= 4 resolves a dotted name attribute by attribute, so "any name in an allowed module"
# reaches everything those modules import (os.system via a module that imports os). Allow exact
# pairs only: the metadata classes DCP writes, torch.Size, the dtypes, and layout/path helpers.
_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_MD, "Metadata"),
    (_DCP_MD, "TensorStorageMetadata"),
    (_DCP_MD, "BytesStorageMetadata"),  # parsed (old checkpoints list them) but never read
    (_DCP_MD, "ChunkStorageMetadata"),
    (_DCP_MD, "TensorProperties"),
    (_DCP_MD, "MetadataIndex"),
    (_DCP_MD, "StorageMeta"),
    (_DCP_MD, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps "torch.strided" to the layout object, nothing else
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
} | {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not allowed"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("checkpoint metadata uses persistent ids, which are not allowed")


def load_metadata(data: bytes):
    """Unpickle DCP metadata through the allow-list, then check what DCP will trust from it."""
    from torch.distributed.checkpoint.metadata import Metadata

    md = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(md, Metadata):
        raise CheckpointLoadError(f"checkpoint metadata is a {type(md).__name__}, not DCP Metadata")
    for index, info in (md.storage_data or {}).items():
        # Where DCP reads each item from: a plain file name of this checkpoint, untransformed.
        try:
            check_file_name(str(info.relative_path))
        except CommitError as e:
            raise CheckpointLoadError(
                f"checkpoint metadata points {index.fqn} outside the checkpoint: {e}"
            ) from e
        if getattr(info, "transform_descriptors", None):
            raise CheckpointLoadError(
                f"checkpoint entry {index.fqn} has transforms {info.transform_descriptors}"
            )
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the two unpickling doors shut: metadata through the allow-list, and
    any BYTE_IO item (which DCP's planner loads with `torch.load(weights_only=False)`) refused."""

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(str(self.path), ".metadata"), "rb") as f:
            metadata = load_metadata(f.read())
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        from torch.distributed.checkpoint.planner import LoadItemType

        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointLoadError(
                    f"checkpoint entry {item.dest_index.fqn} is not a tensor: refusing to unpickle it"
                )
        try:
            return super().read_data(plan, planner)
        except Exception as e:  # name the files, so the fallback warning says what was bad
            files = sorted({str(self.storage_data[i.storage_index].relative_path) for i in plan.items})
            raise CheckpointLoadError(f"reading {files} in {self.path}: {e}") from e


def optional_group(group: str) -> bool:
    """A module registered beside the model (AppState.register_module): a checkpoint written
    before it was switched on lacks it, and resumes without it."""
    return group not in ("model", "optim", "extra") and not group.startswith("rank")


def _fill_template_from_metadata(template: dict, md) -> dict:
    """Every entry we load must be a plain tensor in the metadata; extras (JSON in uint8 tensors)
    have checkpoint-defined sizes, so allocate them from it."""
    out = {}
    saved_groups = {k.split(".", 1)[0] for k in md.state_dict_metadata}
    for group, val in template.items():
        if optional_group(group) and group not in saved_groups:
            continue  # a module this run added (EMA switched on): AppState.apply says so
        out[group] = {}
        for k, v in _flat(val, group):
            meta = md.state_dict_metadata.get(k)
            if meta is None and group == "extra" and v == OPTIONAL:
                continue  # a part newer than the checkpoint: AppState.apply says so
            if meta is None:
                raise CheckpointLoadError(f"checkpoint has no entry {k}")
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointLoadError(f"checkpoint entry {k} is not a tensor: refusing to unpickle it")
        if group != "extra" and not group.startswith("rank"):
            out[group] = val  # live tensors (model, optim, registered modules), loaded in place
            continue
        for k in val:
            meta = md.state_dict_metadata.get(f"{group}.{k}")
            if meta is not None:
                out[group][k] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return out


def _flat(tree, prefix: str):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}.{k}")
    else:
        yield prefix, tree


# -- where replicated entries are written ------------------------------------------------------
def lowest_rank_keeps(all_plans: list, keys: frozenset[str]) -> list:
    """`all_plans` (one SavePlan per rank, in rank order) with every write item whose key is in
    `keys` left only in the plan of the lowest rank that holds it. Items are matched by their whole
    index (key and offset), so a sharded tensor's chunks stay with their ranks."""
    seen: set = set()
    out = []
    for plan in all_plans:
        items = [i for i in plan.items if i.index.fqn not in keys or i.index not in seen]
        seen.update(i.index for i in plan.items if i.index.fqn in keys)
        out.append(dataclasses.replace(plan, items=items))
    return out


class LowestRankSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that the entries named in `keys` are written by the lowest
    rank holding them. The default planner writes each replicated entry from whichever rank has
    planned the fewest bytes so far (spreading the write over the ranks); that is right for entries
    equal on every rank and wrong for ones that differ (the buffers: AppState.buffer_keys). Those
    are taken out of the other ranks' plans first; everything else is spread as before."""

    def __init__(self, keys: frozenset[str] = frozenset()):
        super().__init__()
        self.keys = frozenset(keys)

    def create_global_plan(self, all_plans):
        return super().create_global_plan(lowest_rank_keeps(all_plans, self.keys))


# -- backends ---------------------------------------------------------------------------------
class TorchSave:
    """Rank 0 gathers the full state and writes one file synchronously: the baseline."""

    name = "torch_save"
    format = "torch_save"
    is_async = False
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def save(
        self, sd: dict, local_dir: str, rank: int, world: int, pg, from_lowest_rank: frozenset = frozenset()
    ) -> Pending:
        """`from_lowest_rank`: unused, rank 0 writes everything (its own buffers among it)."""
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
        try:
            full = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise CheckpointLoadError(f"{path}: {e}") from e
        missing = [g for g in template if g not in full and not optional_group(g)]
        if missing:
            raise CheckpointLoadError(f"state.pt lacks {missing}")
        return {g: full[g] for g in template if g in full}

    def load(self, sd: dict, local_dir: str) -> None:
        pass  # prepare_load already read everything

    def close(self) -> None:
        pass


class DCPSync:
    """torch.distributed.checkpoint.save: every rank writes its own shard; `.metadata` last."""

    name = "dcp_sync"
    format = "dcp"
    is_async = False
    options = StateDictOptions()

    def _writer(self, local_dir: str) -> FileSystemWriter:
        return FileSystemWriter(local_dir, sync_files=True, overwrite=False)

    def save(
        self, sd: dict, local_dir: str, rank: int, world: int, pg, from_lowest_rank: frozenset = frozenset()
    ) -> Pending:
        """`from_lowest_rank`: the flattened keys that every rank holds whole but not equal (the
        buffers, AppState.buffer_keys), written from the lowest rank; other replicated entries are
        spread over the ranks."""
        planner = LowestRankSavePlanner(from_lowest_rank)
        dcp.save(sd, storage_writer=self._writer(local_dir), planner=planner, process_group=pg)
        return Pending()

    def rank_files(self, local_dir: str, rank: int) -> list[str]:
        mine = sorted(
            f for f in os.listdir(local_dir) if f.startswith(f"__{rank}_") and f.endswith(".distcp")
        )
        # .metadata goes last: it is what makes a DCP checkpoint loadable.
        return mine + ([".metadata"] if rank == 0 else [])

    def prepare_load(self, template: dict, local_dir: str) -> dict:
        """Local and fallible: read the metadata safely and size the extras (no collectives)."""
        try:
            md = SafeFileSystemReader(local_dir).read_metadata()
        except Exception as e:
            raise CheckpointLoadError(f"{os.path.join(local_dir, '.metadata')}: {e}") from e
        return _fill_template_from_metadata(template, md)

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

    def __init__(self, async_type: str = "thread"):
        """`async_type`: `thread` writes in a background thread (shares the GIL with the loop),
        `process` in a daemon process (no GIL contention; a process and its start-up per job)."""
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if async_type not in ("thread", "process"):
            raise ValueError(f"checkpoint.backend.async_type must be thread|process, got {async_type!r}")
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

    def save(
        self, sd: dict, local_dir: str, rank: int, world: int, pg, from_lowest_rank: frozenset = frozenset()
    ) -> Pending:
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        if self._stager is None:  # reused: keeps one staging buffer instead of allocating per save
            self._stager = self._make_stager()
        resp = dcp.async_save(
            sd,
            storage_writer=self._writer(local_dir),
            planner=LowestRankSavePlanner(from_lowest_rank),
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
# What reads a committed checkpoint is chosen by the format it was written in, not by this run's
# backend: a run can switch between torch_save, dcp_sync and dcp_async and still resume.
READERS = {"torch_save": TorchSave, "dcp": DCPSync}
