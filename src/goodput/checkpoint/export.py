"""The model out of a committed checkpoint, whole, on CPU: for `inspect_checkpoint.py --export` (a
safetensors file), the model logged to MLflow, scripts/evaluate.py and predict.py and
`run.init_from`. Any backend, any world size: DCP shards (DDP or FSDP, N ranks) are gathered into
full tensors by DCP's own planner, on one process.

A *source* of weights is a run's checkpoint dir (its newest commit whose bytes verify), one step dir
of it (or the dir with `step`), or a safetensors export; `read_weights` returns its tensors and its
model record (goodput.checkpoint.spec), whichever it is."""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from goodput.checkpoint.backends import SafeFileSystemReader
from goodput.checkpoint.commits import Commits
from goodput.checkpoint.layout import COMMIT, local_commits, parse_step, step_dir
from goodput.checkpoint.spec import FIELDS, ModelSpec
from goodput.errors import UserError
from goodput.logs import known_warning
from goodput.storage.checksum import CHECKSUM, TooLarge
from goodput.storage.remote import Storage

log = logging.getLogger(__name__)


class ExportError(UserError, RuntimeError):
    pass


class CorruptCheckpoint(ExportError):
    """A file of a commit whose bytes differ from its record."""


class SourceError(UserError, FileNotFoundError):
    """A source of weights that is not there: no checkpoint dir, no commit at that step, no file."""


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
                raise CorruptCheckpoint(f"{url}: {e}: it does not match its commit record") from None
            if got.size != want["bytes"] or got.digest != want[CHECKSUM]:
                raise CorruptCheckpoint(f"{url} does not match its commit record")
        try:
            sd = _read_group(tmp, rec, prefix)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            # the bytes match the record, but are not a checkpoint: crafted, or written by a bug
            why = str(e).replace(tmp, store.url(rel))[:600]
            raise CorruptCheckpoint(f"{store.url(rel)}: cannot read its {weights} weights: {why}") from None
        if not sd:
            raise ExportError(
                f"{store.url(rel)} holds no {weights} weights ({prefix}*)"
                + (": it was written without trainer.ema_decay" if weights == "ema" else "")
            )
        return {k[len(prefix) :]: v for k, v in sd.items()}


def full_state(store: Storage, rec: dict) -> dict[str, torch.Tensor]:
    """Every tensor of commit `rec`, full (unsharded), by its checkpoint key (`model.*`, `optim.*`,
    `extra.*`, `rank<r>.*`: goodput.checkpoint.state), whatever the backend, each file checked
    against the record: what scripts/check.py compares, key by key."""
    rel = rec.get("dir") or step_dir(rec["step"])
    with tempfile.TemporaryDirectory() as tmp:
        for name, want in rec["files"].items():
            got = store.get(f"{rel}/{name}", os.path.join(tmp, name), limit=want["bytes"])
            if got.size != want["bytes"] or got.digest != want[CHECKSUM]:
                raise CorruptCheckpoint(f"{store.url(f'{rel}/{name}')} does not match its commit record")
        if rec["format"] == "torch_save":
            return _flat(torch.load(os.path.join(tmp, "state.pt"), map_location="cpu", weights_only=True))
        return _read_group(tmp, rec, "")


def _flat(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree} if isinstance(tree, torch.Tensor) else {}


def _read_group(tmp: str, rec: dict, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` of the verified files of commit `rec`, downloaded to `tmp`."""
    if rec["format"] == "torch_save":
        full = torch.load(os.path.join(tmp, "state.pt"), map_location="cpu", weights_only=True)
        if not isinstance(full, dict):
            raise ExportError(f"state.pt holds a {type(full).__name__}, not a checkpoint's dict")
        top = prefix.split(".", 1)[0]
        group = full.get(top, {})
        if not isinstance(group, dict):
            raise ExportError(f"state.pt's {top!r} is a {type(group).__name__}, not a state dict")
        sd = {f"{top}.{k}": v for k, v in group.items()}
        sd = {k: v for k, v in sd.items() if k.startswith(prefix)}
        wrong = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
        if wrong:
            raise ExportError(f"state.pt's {wrong[0]} is a {type(sd[wrong[0]]).__name__}, not a tensor")
        return sd
    reader = SafeFileSystemReader(tmp)
    md = reader.read_metadata()
    meta = {k: m for k, m in md.state_dict_metadata.items() if k.startswith(prefix)}
    meta = {k: m for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    # The sizes come from the metadata, which whoever writes the store writes: DCP stores each
    # tensor's bytes whole, so the tensors cannot outweigh the files that hold them.
    need = sum(m.size.numel() * m.properties.dtype.itemsize for m in meta.values())
    have = sum(f["bytes"] for f in rec["files"].values())
    if need > have:
        raise ExportError(f"its metadata declares {need} bytes of tensors in {have} bytes of files")
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    if sd:
        # One process reads the whole model on purpose (no_dist); DCP warns that it assumes so.
        with known_warning("torch.distributed is disabled", "torch.distributed.checkpoint"):
            dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def save_safetensors(sd: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """Tensors only (no pickle: loading runs no code), contiguous, written atomically."""
    from safetensors.torch import save_file

    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({k: v.detach().cpu().contiguous() for k, v in sd.items()}, tmp, metadata=metadata)
    os.replace(tmp, path)


@dataclass
class Weights:
    """The tensors of a source and what it says about them."""

    state: dict[str, torch.Tensor]
    record: object  # the model record as stored (None: the source has none); `spec()` checks it
    origin: str  # the step dir's URL or the file's path
    step: int | None
    weights: str  # "model" or "ema"
    commit: dict | None = None  # the commit record (checkpoint sources)

    def spec(self) -> ModelSpec:
        if isinstance(self.record, ModelSpec):
            return self.record
        return ModelSpec.parse(self.record, self.origin)


def is_safetensors(source: str) -> bool:
    return source.endswith(".safetensors")


RUN_DIGEST = r"-[0-9a-f]{8}"  # a run name's tail: run.experiment + "-" + the identity digest


def _trained_at(run: str, otherwise: float) -> float:
    """When a run last committed a checkpoint (its newest COMMIT.json's mtime), else `otherwise`
    (the dir's own mtime): a relaunch that only takes and drops the lock makes no run newer."""
    times = []
    for _, path in local_commits(run):
        try:
            times.append(os.stat(os.path.join(path, COMMIT)).st_mtime)
        except OSError:
            pass  # gone since the listing
    return max(times, default=otherwise)


def run_dir(source: str, say: Callable[[str], None] = log.info) -> str:
    """`source`, or the one run dir it is short for: a local path that does not exist, with exactly
    one sibling directory named `<its name>-<8 lowercase hex>` (a run name: the experiment plus its
    identity digest), names that directory (`say` tells which). Several such siblings: SourceError
    listing them, newest first by their newest commit. Anything else (a path that exists, a URL, a
    safetensors file, no such sibling, a sibling that is a file or a link) is returned as is."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:/", source) or is_safetensors(source) or os.path.lexists(source):
        return source
    parent, name = os.path.split(source.rstrip("/"))
    if not name:
        return source
    pattern = re.compile(re.escape(name) + RUN_DIGEST)
    try:
        with os.scandir(parent or ".") as entries:
            found = [
                (_trained_at(e.path, e.stat(follow_symlinks=False).st_mtime), os.path.join(parent, e.name))
                for e in entries
                if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
            ]
    except OSError:  # no parent either: the caller says the path is not there
        return source
    if len(found) > 1:
        runs = ", ".join(path for _, path in sorted(found, reverse=True))
        raise SourceError(
            f"{source}: no such directory, and {len(found)} runs are named {name}-<digest> "
            f"(newest first): {runs}; name one"
        )
    if found:
        say(f"{source}: no such directory; using {found[0][1]}, the one run named {name}-<digest>")
        return found[0][1]
    return source


def locate(source: str, step: int | None = None, open_storage: Callable[[str], Storage] = Storage):
    """(storage, commit records to try, newest first) of a checkpoint source, or (None, [path]) of a
    safetensors file. Cheap (listings and commit records only); SourceError when there is nothing."""
    if is_safetensors(source):
        if not os.path.isfile(source):
            raise SourceError(f"{source}: no such safetensors file")
        if step is not None:
            raise SourceError(f"{source} is an export of one step: --step applies to a checkpoint dir")
        return None, [source]
    path = source.rstrip("/")
    parent, name = os.path.split(path)
    one = parse_step(name)
    if one is not None and step is not None and step != one:
        raise SourceError(f"{source} is the step dir of step {one}, but --step {step} was given")
    root = (parent or ".") if one is not None else path
    if "://" not in root:  # local: absolute, so what it names (a tag, a log line) holds from anywhere
        if not os.path.isdir(root):
            raise SourceError(
                f"{root}: no such directory (a run's checkpoint dir, or one step-NNNNNNNNN dir in it)"
            )
        root = os.path.abspath(root)
    store = open_storage(root)
    commits = Commits(store)
    # the step dir named (a regular save's or a rescue's); of --step N the regular save, else its rescue
    names = [name] if one is not None else []
    if one is None and step is not None:
        names = [step_dir(step), step_dir(step, rescue=True)]
    try:
        for rel in names:
            rec = commits.read_commit(rel)
            if rec is not None:
                return store, [rec]
        if names:
            have = sorted({r["step"] for r in commits.committed()}, reverse=True)
            raise SourceError(f"{store.url(names[0])}: not a committed checkpoint (committed steps: {have})")
        committed = commits.committed()
    except OSError as e:  # an unreachable store, a path that is a file
        if isinstance(e, SourceError):
            raise
        raise SourceError(f"{source}: cannot list checkpoints there ({e})") from e
    if not committed:
        raise SourceError(f"{source}: no committed checkpoint (step-NNNNNNNNN/COMMIT.json) there")
    return store, committed


def read_weights(
    source: str,
    weights: str | None = "model",
    step: int | None = None,
    open_storage: Callable[[str], Storage] = Storage,
) -> Weights:
    """The full state dict of `source` (see the module docstring), checked byte for byte against its
    commit record as it downloads; a checkpoint dir gives its newest commit that verifies (a corrupt
    newer one is skipped with a warning). `weights` None: those the run evaluated (its commit's
    `eval_on`). A safetensors file gives the weights it holds."""
    store, candidates = locate(source, step, open_storage)
    if store is None:
        got = _read_safetensors(candidates[0])
        if weights is not None and weights != got.weights:
            raise SourceError(f"{source} holds the {got.weights} weights, not the {weights} ones")
        return got
    for i, rec in enumerate(candidates):
        which = weights or (rec.get("eval_on") if rec.get("eval_on") in WEIGHTS else "model")
        try:
            sd = model_state(store, rec, which)
        except CorruptCheckpoint as e:
            if i + 1 == len(candidates):  # an explicit step, or no older commit left
                raise
            log.warning("skipping %s: %s", store.url(rec["dir"]), e)
            continue
        return Weights(sd, rec.get("model"), store.url(rec["dir"]), rec["step"], which, rec)
    raise SourceError(f"{source}: no committed checkpoint")


def _read_safetensors(path: str) -> Weights:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError, ValueError) as e:
        raise SourceError(f"{path}: not a readable safetensors file ({e})") from e
    # no field at all: an export of an older goodput (weights only); some: a malformed record
    record = ModelSpec.from_metadata(meta, path) if any(k in meta for k in FIELDS) else None
    step = meta.get("step", "")
    return Weights(sd, record, path, int(step) if step.isascii() and step.isdigit() else None,
                   meta.get("weights", "model"))  # fmt: skip
