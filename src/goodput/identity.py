"""Run identity: which config keys decide *what is trained*, and the short digest of their values
that names a run by default (`run.name: ${run.experiment}-${goodput.identity:}`).

A key is an identity key when changing it makes another training run: the model, the data's
contents, augmentation, optimizer and schedule, seed, global batch, precision, the step's switches.
A key that may change between relaunches of one run (world size and strategy, the checkpoint backend
and interval, the data source and workers, fault drills, timeouts, logging, paths, MLflow,
`trainer.max_steps`) is not: relaunching with it changed still resumes the same run, bit-exactly or
within the resharding tolerance. The code is not in the digest: a commit records it apart, and a
relaunch by other code is refused (goodput.provenance). `TABLE` below is the one classification:
every schema key is in it (tests/unit/test_identity.py walks every schema and every option file, and
checks docs/config.md's table against `markdown_table()`).

The digest is over the identity keys' values as composed, with one rule for interpolations: a
value that refers to a key which is not an identity key is taken as written, not resolved.
`optim.schedule.total_steps: ${trainer.max_steps}` is "the run's end", so raising max_steps keeps
the name; `data.root: ${paths.data_dir}` is "the demo data", wherever paths.root is. A relative
local path in `data.root` or `run.init_from` counts as the absolute path the job opens (`_opened`):
the same command from another working directory reads other files. Keys whose value is null, or
the value in NEUTRAL (what trains as runs trained before the key existed), are left out, so a key
or group added later with its neutral default keeps every existing run's name; a class that moved
is hashed by the name runs knew it by (MOVED).

The resolver (`resolve`) is registered with the schemas by goodput.config.register, which Hydra's
plugin discovery runs (hydra_plugins.goodput_config), so `hydra.compose` sees it from anywhere. No
torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from typing import Any

from omegaconf import OmegaConf

RESOLVER = "goodput.identity"

# (key, identity?, why). A key ending in `.*` is an open `_target_` node: every key under it that
# has no row of its own is classified as the node is.
TABLE: list[tuple[str, bool, str]] = [
    ("seed", True, "initial weights, sample order, augmentation"),
    ("model.*", True, "the network: its class and every argument"),
    # the recipe's groups
    ("task.*", True, "what is learned: the task class, its loss (task.loss) and every argument"),
    ("task.top_k", False, "a metric (val/top<k>)"),
    ("task.threshold", False, "which labels count as predicted in metrics and predict.py"),
    ("batch_augment.*", True, "the batch transform (MixUp, CutMix) and its arguments"),
    # paths
    ("paths.root", False, "where state lives; moving it moves the whole run"),
    (
        "paths.data_dir",
        False,
        "where the demo data lives (its contents: demo_data.*); a folder holding other files, or demo"
        " data of other settings, is refused, never generated into (your data: `data.root`)",
    ),
    ("paths.cache_dir", False, "a node-local cache"),
    ("paths.checkpoint_dir", False, "where checkpoints live"),
    ("paths.staging_dir", False, "node-local staging"),
    ("paths.run_dir", False, "where run directories go"),
    # run
    ("run.experiment", False, "the name's first part, not its digest"),
    ("run.name", False, "the name itself"),
    ("run.resume", False, "how a launch continues, not what it trains"),
    ("run.overwrite", False, "what to do with old checkpoints"),
    ("run.lock_stale_seconds", False, "a timeout"),
    ("run.allow_config_change", False, "a permission for one launch"),
    ("run.allow_code_change", False, "a permission for one launch"),
    ("run.init_from", True, "the weights training starts from"),
    # trainer
    ("trainer.max_steps", False, "how far, not what: raising it continues the run"),
    ("trainer.global_batch_size", True, "the sample order and the maths of a step"),
    ("trainer.eval_every_n_steps", False, "when to evaluate; the weights are the same"),
    ("trainer.log_every_n_steps", False, "logging"),
    ("trainer.num_threads", False, "speed; float rounding only (as the world size)"),
    ("trainer.deterministic", False, "bit-exactness of reruns, not the maths"),
    ("trainer.progress", False, "logging"),
    ("trainer.progress_every_s", False, "logging"),
    ("trainer.signal_grace_seconds", False, "a timeout"),
    ("trainer.precision", True, "the maths of every step"),
    ("trainer.micro_batch_size", True, "BatchNorm sees micro-batches: other maths"),
    ("trainer.clip_grad_norm", True, "changes every update"),
    ("trainer.ema_decay", True, "the EMA weights (evaluated and exported with eval_on=ema)"),
    ("trainer.ema_every_n_steps", True, "the EMA weights"),
    ("trainer.ema_start_step", True, "the EMA weights"),
    ("trainer.eval_on", False, "which trained weights to evaluate and export; both are kept"),
    ("trainer.channels_last", False, "memory layout: speed, same maths"),
    ("trainer.sync_batchnorm", True, "BatchNorm statistics over the global batch: other maths"),
    ("trainer.max_epochs", False, "how far, not what (as max_steps)"),
    ("trainer.eval_top_k", False, "a metric"),
    ("trainer.early_stopping_patience", False, "when to stop, as max_steps"),
    ("trainer.early_stopping_by", False, "when to stop, as max_steps"),
    ("trainer.early_stopping_min_delta", False, "when to stop, as max_steps"),
    ("trainer.early_stopping_mode", False, "when to stop, as max_steps"),
    ("trainer.compile", False, "speed; checkpoints are the same compiled or not"),
    ("trainer.compile_mode", False, "speed"),
    ("trainer.compile_dynamic", False, "speed"),
    ("trainer.compile_cache_dir", False, "a path"),
    ("trainer.compile_cache_upload", False, "where a cache is kept"),
    ("trainer.compile_cache_key_file", False, "a path (the cache's signing key)"),
    ("trainer.compile_timeout_s", False, "a timeout"),
    ("trainer.hang_timeout_s", False, "a timeout"),
    ("trainer.phase_timeout_s", False, "a timeout"),
    ("trainer.straggler_factor", False, "a warning"),
    ("trainer.straggler_windows", False, "a warning"),
    ("trainer.profile_start_step", False, "observability"),
    ("trainer.profile_steps", False, "observability"),
    ("trainer.peak_tflops", False, "a metric (MFU)"),
    # demo_data
    ("demo_data.num_classes", True, "the demo data's contents"),
    ("demo_data.train_per_class", True, "the demo data's contents"),
    ("demo_data.val_per_class", True, "the demo data's contents (evaluation, best, early stop)"),
    ("demo_data.image_size", True, "the demo data's contents"),
    ("demo_data.seed", True, "the demo data's contents"),
    ("demo_data.kind", True, "the demo data's contents"),
    # data
    ("data.source.*", False, "where bytes come from; the order is the same"),
    ("data.source.shuffle_block", True, "data=shards: the sample order"),
    ("data.root", True, "the dataset (as written: ${paths.data_dir} is the demo data)"),
    ("data.dataset.*", True, "the layout class and its options: which samples, which labels"),
    ("data.cache_dir", False, "a node-local cache"),
    ("data.image_size", True, "the input resolution"),
    ("data.train_crop_size", True, "the training view's resolution"),
    ("data.val_resize_size", False, "the evaluation view; the weights are the same"),
    ("data.val_crop_size", False, "the evaluation view; the weights are the same"),
    ("data.repeated_augment", True, "the sample order: each sample N times per epoch"),
    ("data.num_workers", False, "speed; order and augmentation do not depend on it"),
    ("data.prefetch_factor", False, "speed"),
    ("data.prefetch_steps", False, "speed"),
    ("data.on_bad_sample", False, "what to do on a bad file; relaunch with skip to go on"),
    # augment
    ("augment.train.*", True, "the training transforms"),
    ("augment.after_normalize.*", True, "the training transforms after normalization"),
    ("augment.mean", True, "the normalization"),
    ("augment.std", True, "the normalization"),
    # checkpoint
    ("checkpoint.backend.*", False, "how state is written; any backend resumes any other"),
    ("checkpoint.dir", False, "a path"),
    ("checkpoint.staging_dir", False, "a path"),
    ("checkpoint.every_n_steps", False, "when to save"),
    ("checkpoint.every_n_minutes", False, "when to save"),
    ("checkpoint.keep_last", False, "retention"),
    ("checkpoint.keep_best_by", False, "which commit is kept, not what is trained"),
    ("checkpoint.keep_best_mode", False, "which commit is kept"),
    ("checkpoint.on_error", False, "what a failed save does"),
    ("checkpoint.commit_timeout_s", False, "a timeout"),
    ("checkpoint.rescue", False, "what a failure costs, not what is trained"),
    ("checkpoint.rescue_timeout_s", False, "a timeout"),
    # optim
    ("optim.optimizer.*", True, "the optimizer: its class and every argument"),
    ("optim.norm_weight_decay", True, "the update of every norm layer's parameters"),
    ("optim.bias_weight_decay", True, "the update of every bias"),
    ("optim.schedule.*", True, "the LR schedule: its class and every argument"),
    ("optim.schedule._target_", True, "the LR schedule"),
    ("optim.schedule._partial_", True, "the LR schedule"),
    ("optim.schedule.warmup_steps", True, "the LR schedule"),
    ("optim.schedule.min_lr_ratio", True, "the LR schedule"),
    ("optim.schedule.total_steps", True, "as written: ${trainer.max_steps} follows the run's end"),
    ("optim.schedule.warmup_epochs", True, "the LR schedule (its warm-up in epochs)"),
    # parallel
    ("parallel.strategy.*", False, "world layout: resumes within the resharding tolerance"),
    ("parallel.nproc_per_node", False, "world size: resumes within the resharding tolerance"),
    ("parallel.shard_size", False, "world layout: resumes within the resharding tolerance"),
    ("parallel.shard_units", False, "world layout: which blocks FSDP shards one by one"),
    ("parallel.oversubscribe", False, "permission to share CPU cores"),
    ("parallel.max_restarts", False, "fault tolerance"),
    ("parallel.rdzv_endpoint", False, "where to meet"),
    ("parallel.rdzv_timeout_s", False, "a timeout"),
    ("parallel.init_timeout_s", False, "a timeout"),
    ("parallel.collective_timeout_s", False, "a timeout"),
    ("parallel.spares", False, "fault tolerance"),
    ("parallel.recovery_timeout_s", False, "a timeout"),
    # fault
    *[
        (f"fault.{k}", False, "a fault drill")
        for k in (
            "kill_at_step",
            "kill_during_save",
            "rank",
            "mtbf_seconds",
            "max_kills",
            "chaos_p",
            "chaos_seed",
            "kill_in_step",
            "raise_at_step",
            "hang_at_step",
            "hang_rank",
            "hang_site",
            "slow_rank",
            "slow_seconds",
            "hang_mtbf_seconds",
            "max_hangs",
        )  # fmt: skip
    ],
    # storage
    ("storage.latency_ms", False, "emulation of a network volume"),
    ("storage.bandwidth_mb_s", False, "emulation of a network volume"),
    ("storage.error_rate", False, "emulation of a network volume"),
    ("storage.retries", False, "retries"),
    ("storage.backoff_s", False, "retries"),
    ("storage.request_timeout_s", False, "a timeout"),
    ("storage._target_", False, "how bytes are read and written"),
    ("storage._partial_", False, "how bytes are read and written"),
    # mlflow
    ("mlflow.tracking_uri", False, "where the run is recorded"),
    ("mlflow.experiment", False, "where the run is recorded"),
    ("mlflow.artifact_location", False, "where the run is recorded"),
    ("mlflow.log_model", False, "what is logged at the end"),
    ("mlflow.registered_model_name", False, "what is logged at the end"),
    ("mlflow.parent_run_id", False, "where the run is shown"),
    ("mlflow.system_metrics_interval_s", False, "observability"),
    ("mlflow.artifact_timeout_s", False, "a timeout"),
    ("mlflow.start_timeout_s", False, "a timeout"),
    ("mlflow.end_timeout_s", False, "a timeout"),
]

# Keys at the value that trains what runs trained before the key (or its group) existed: left out
# of the digest like a null, so adding them renamed no run. A value that differs counts.
NEUTRAL: dict[str, Any] = {
    "task._target_": "goodput.recipe.task.Classification",
    "task.loss._target_": "torch.nn.CrossEntropyLoss",
    "task.loss.label_smoothing": 0.0,
    "batch_augment._target_": "goodput.recipe.batch.MixUpCutMix",
    "demo_data.kind": "shapes",
    "data.train_crop_size": "${data.image_size}",  # (compared as written)
    "data.repeated_augment": 1,
    "augment.after_normalize": [],
    "trainer.sync_batchnorm": False,
}
# `_target_`s of classes that moved -> the name runs were digested with
MOVED = {"goodput.recipe.models.SmallCNN": "goodput.model.SmallCNN"}
_UNSET = object()

KEYS = {k.removesuffix(".*"): ident for k, ident, _ in TABLE if not k.endswith(".*")}
NODES = {k.removesuffix(".*"): ident for k, ident, _ in TABLE if k.endswith(".*")}

_REF = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")  # ${a.b.c}; resolvers (${oc.env:..}) are not keys
# Keys whose value is a path the job opens, a local one relative to its working directory: hashed as
# opened (`_opened`), so the same relative path from two directories names two runs.
PATHS = ("data.root", "run.init_from")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # s3://, memory://, file://; models:/ ...
_busy = threading.local()


def classify(key: str) -> bool | None:
    """Whether `key` (dotted, list items by index) is an identity key: its own row, else the
    nearest open node above it; None when the table does not say."""
    if key in KEYS:
        return KEYS[key]
    parts = key.split(".")
    for i in range(len(parts), 0, -1):  # the node itself (an empty list, say), then the nodes above
        node = ".".join(parts[:i])
        if node in NODES:
            return NODES[node]
    return None


def is_identity(key: str) -> bool:
    """Unclassified keys count as identity: a key nobody classified starts a new run rather than
    silently continuing another's weights (the test makes every schema key classified)."""
    return classify(key) is not False


def leaves(node: Any, path: str = ""):
    """(dotted key, raw value) of each leaf of a plain config tree; a list of nodes is walked by index."""
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list) and any(isinstance(v, dict) for v in node):
        for i, v in enumerate(node):
            yield from leaves(v, f"{path}.{i}")
    else:
        yield path, node


def _value(cfg, key: str, raw: Any) -> Any:
    """An identity key's value: as written when it refers to a key that is not identity, else resolved
    (a local path of PATHS: as the job opens it)."""
    if not (isinstance(raw, str) and "${" in raw):
        return _opened(raw) if key in PATHS else raw
    if any(not is_identity(ref) for ref in _REF.findall(raw)):
        return raw
    value = OmegaConf.select(cfg, key, throw_on_missing=False)
    value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return _opened(value) if key in PATHS else value


def _opened(value: Any) -> Any:
    """A relative local path as the job opens it (fsspec's rule: `~` expanded, then from the working
    directory), `file://` ones too; an absolute path, a URL and any other value unchanged, so the
    names of existing runs (which name their data by absolute path or URL) stay the same."""
    if not isinstance(value, str) or not value:
        return value
    prefix = "file://" if value.startswith("file://") else ""
    path = value[len(prefix) :]
    if (_SCHEME.match(path) and not prefix) or os.path.isabs(path):
        return value
    return prefix + os.path.abspath(os.path.expanduser(path))


def keys(cfg) -> dict[str, Any]:
    """The identity keys of a composed config (a DictConfig) and their values (nulls and NEUTRAL
    values left out)."""
    if getattr(_busy, "on", False):
        raise ValueError("an identity key refers to run.name (or to a key that does): it cannot name the run")
    _busy.on = True
    try:
        raw = OmegaConf.to_container(cfg, resolve=False)
        out = {}
        for key, v in leaves({k: v for k, v in raw.items() if k != "hydra"}):
            if is_identity(key) and v is not None:
                value = _value(cfg, key, v)
                if key.endswith("_target_"):
                    value = MOVED.get(value, value)
                if value is not None and NEUTRAL.get(key, _UNSET) not in (value, v):
                    out[key] = value
        return out
    finally:
        _busy.on = False


def digest(identity_keys: dict[str, Any]) -> str:
    """8 hex digits of sha256 over the sorted keys and values (JSON)."""
    blob = json.dumps(identity_keys, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def record(cfg) -> dict:
    """What a commit and the MLflow run record: {"digest": ..., "keys": {key: value}}."""
    k = keys(cfg)
    return {"digest": digest(k), "keys": k}


def differences(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for each identity key that differs; absent = None."""
    return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def describe(diff: list[tuple[str, Any, Any]]) -> str:
    """One line naming each difference with both values (JSON; null = absent)."""
    show = lambda v: json.dumps(v, default=str)  # noqa: E731
    return "; ".join(f"{k} (the run: {show(a)}, this launch: {show(b)})" for k, a, b in diff)


def resolve(*, _root_) -> str:
    """`${goodput.identity:}`: the digest of the composed config's identity keys (registered with
    the schemas by goodput.config.register, which Hydra's plugin discovery runs)."""
    return digest(keys(_root_))


def markdown_table() -> str:
    """docs/config.md's table, generated from TABLE (the test checks the page against it)."""
    rows = ["| key | identity | why |", "|---|---|---|"]
    for key, ident, why in TABLE:
        shown = f"`{key[:-2]}` (every key under it)" if key.endswith(".*") else f"`{key}`"
        rows.append(f"| {shown} | {'yes' if ident else 'no'} | {why.replace('|', '/')} |")
    return "\n".join(rows)
