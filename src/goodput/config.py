"""The config's schema: one dataclass per group, registered in Hydra's ConfigStore as `<group>/base`
(by `register`, which Hydra calls through the hydra_plugins.goodput_config plugin module).

Each schema lives beside the component that reads it (goodput.checkpoint.config, goodput.data.config,
goodput.data.augment, goodput.run.config, goodput.parallel, goodput.resilience.fault,
goodput.storage.remote, goodput.tracking); the ones that belong to the job as a whole are here.
Group files start from their schema (`defaults: [base]`) and say only what differs, so a mistyped
key in a file or an override fails at compose time, naming the key and the file. Defaults,
documentation and checks (`__post_init__`) are written once, in the schema; `validate()` adds the
checks that span groups or need the machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import MISSING, OmegaConf

from goodput import identity, options
from goodput.checkpoint.config import AGENT_STOP_GRACE_S, RESCUE_MARGIN_S, CheckpointConfig
from goodput.data import augment
from goodput.data.augment import AugmentConfig
from goodput.data.config import DataConfig, DemoDataConfig
from goodput.errors import UserError
from goodput.parallel import ParallelConfig
from goodput.resilience.fault import FaultConfig
from goodput.run.cache_trust import key_file_problem
from goodput.run.config import ScheduleConfig, TrainerConfig
from goodput.storage.remote import StorageConfig
from goodput.tracking import MlflowConfig

log = logging.getLogger(__name__)


class ConfigError(UserError, ValueError):
    pass


@dataclass
class PathsConfig:
    """Every state path derives from `root` (relative roots are taken from the launch directory)."""

    root: str = MISSING
    """Set in conf/paths/default.yaml. A shared filesystem on a cluster."""

    data_dir: str = (
        "${paths.root}/remote/data/"
        "${demo_data.kind}-c${demo_data.num_classes}-n${demo_data.train_per_class}-v${demo_data.val_per_class}"
        "-s${demo_data.image_size}-g${demo_data.seed}"
    )
    """The demo "remote" dataset, named by every key that generated it (created on first use)."""

    cache_dir: str = "${paths.root}/cache"
    """Node-local cache of remote files: the fastest local disk."""

    checkpoint_dir: str = "${paths.root}/checkpoints"
    """The "remote" checkpoint volume (committed checkpoints, run lock, attempt records)."""

    staging_dir: str = "${paths.root}/staging"
    """Node-local fast disk where checkpoints are written before the upload."""

    run_dir: str = "${paths.root}/runs"
    """Hydra run directories (summary.json, goodput.png, .hydra/)."""


@dataclass
class RunConfig:
    experiment: str = "run"
    """What kind of run this is, set by the experiment preset (`demo`, `smoke`): the first part of
    the default run.name."""

    name: str = "${run.experiment}-${goodput.identity:}"
    """Names the checkpoint dir, the run dir and the MLflow run: relaunching the same name resumes
    it. By default the experiment plus 8 hex digits of the identity keys (what is trained; the table
    in docs/config.md), so a command that trains something else is a new run and the same command
    continues. A name given explicitly is kept; a `-m` sweep adds each job's overrides to it."""

    resume: str = "auto"
    """`auto` = the newest committed checkpoint that loads (falls back to older ones), `none` = start
    fresh (refused if checkpoints exist, unless overwrite), or the path of a committed step dir."""

    overwrite: bool = False
    """With resume=none: discard an existing run's checkpoints."""

    init_from: str | None = None
    """Start a new run from these weights: another run's checkpoint dir (its newest commit that
    verifies) or one step dir of it (a path or fsspec URL), or a local `.safetensors` export. The model only
    (and its EMA): optimizer, LR schedule, step and data position start fresh. Names and shapes must
    match this run's model exactly (another num_classes is an error that says so). Applied only when
    the run starts fresh: once the run has a commit of its own, a relaunch resumes that instead.
    It changes what is trained."""

    lock_stale_seconds: int = 120
    """A run lock without heartbeat for this long belongs to a dead job and is taken over. Shorter
    relaunches faster after a crash; too short lets a slow-but-alive job be joined by a second one."""

    allow_config_change: bool = False
    """Continue an existing run (an explicit run.name) whose identity keys differ from this launch's,
    with a warning listing them; without it that launch is refused (exit 2), naming each key."""

    allow_code_change: bool = False
    """Continue a run whose commit was written by other code (the goodput package or conf/ differ
    from this launch's: docs/recipe.md), with a warning naming the changed files; the commits record
    the code that wrote them. Without it that launch is refused (exit 2), naming the files."""


@dataclass
class OptimConfig:
    """Schema of the `optim` group; the LR schedule is its own group, `optim/schedule`."""

    optimizer: Any = MISSING
    """A `_target_` node with `_partial_: true`, called with the model's parameters."""

    schedule: Any = None
    """Filled by the `optim/schedule` group (goodput.run.config.ScheduleConfig is the default's schema)."""

    norm_weight_decay: float | None = None
    """Weight decay of the normalization layers' parameters (BatchNorm, GroupNorm, LayerNorm, ...);
    null = the optimizer's, 0.0 = none. Parameter groups from named parameters: goodput/recipe/params.py."""

    bias_weight_decay: float | None = None
    """Weight decay of every bias (a norm layer's too); null = the optimizer's, 0.0 = none."""

    def __post_init__(self):
        for key in ("norm_weight_decay", "bias_weight_decay"):
            v = getattr(self, key)
            if v is not None and not (isinstance(v, int | float) and v >= 0):
                raise ValueError(f"optim.{key} must be >= 0 or null, got {v!r}")


# group -> schema. The file-based groups' options start with `defaults: [base]`; the others are
# selected as `<group>: base` in conf/train.yaml.
SCHEMAS = {
    "paths": PathsConfig,
    "run": RunConfig,
    "trainer": TrainerConfig,
    "demo_data": DemoDataConfig,
    "data": DataConfig,
    "augment": AugmentConfig,
    "checkpoint": CheckpointConfig,
    "optim": OptimConfig,
    "optim/schedule": ScheduleConfig,
    "parallel": ParallelConfig,
    "fault": FaultConfig,
    "storage": StorageConfig,
    "mlflow": MlflowConfig,
}


# The groups `validate` converts into their schema's dataclass (`optim/schedule` stays a node inside
# `optim`: a `_target_` node, instantiated whole).
_TYPED = (
    "paths",
    "run",
    "trainer",
    "demo_data",
    "data",
    "checkpoint",
    "optim",
    "parallel",
    "fault",
    "storage",
    "mlflow",
)  # fmt: skip  (and augment, once its transforms are built)


@dataclass
class Config:
    """The resolved, checked config of a job, one schema instance per group (goodput.config.validate
    builds it once). The job's code reads attributes (`cfg.trainer.max_steps`), so the schema is the
    one source of every key; `_target_` nodes (model, optim.optimizer, data.source, ...) stay plain
    dicts for hydra.utils.instantiate. What a launch *is* (its run dir, start, MLflow run) is not
    config: goodput.run.context.RunContext travels beside it."""

    seed: int
    model: dict
    task: dict
    batch_augment: dict
    paths: PathsConfig
    run: RunConfig
    trainer: TrainerConfig
    demo_data: DemoDataConfig
    data: DataConfig
    augment: AugmentConfig
    checkpoint: CheckpointConfig
    optim: OptimConfig
    parallel: ParallelConfig
    fault: FaultConfig
    storage: StorageConfig
    mlflow: MlflowConfig


# OmegaConf resolvers the config files use, by name. A resolver's function must live in a module as
# light as this one (no torch, no mlflow at import; tests/unit/test_config.py checks): every compose
# imports it.
RESOLVERS = {
    "goodput.options": options.listing,  # `--help`'s list of options (conf/hydra/default.yaml)
    identity.RESOLVER: identity.resolve,  # run.name's digest of the identity keys (conf/run/)
}


def register() -> None:
    """What Hydra must know before it composes conf/: each group's schema, stored as `<group>/base`
    in the ConfigStore (the option files start from it: `defaults: [base]`), and RESOLVERS. Called
    by hydra_plugins.goodput_config, which Hydra imports while it discovers plugins, before any
    compose: scripts/train.py, `--help`, and the compose API in a notebook or a test that imported
    nothing of goodput alike. Idempotent (Hydra may scan more than once)."""
    cs = ConfigStore.instance()
    for group, schema in SCHEMAS.items():
        cs.store(group=group, name="base", node=schema)
    for name, fn in RESOLVERS.items():
        OmegaConf.register_new_resolver(name, fn, replace=True)


def build(schema, node: dict, key: str):
    """A schema instance from a resolved node (runs its checks)."""
    known = {f.name for f in fields(schema)}
    unknown = set(node) - known
    if unknown:  # compose already rejects these; a hand-built dict might not
        raise ConfigError(f"{key}: unknown key(s) {sorted(unknown)}")
    return schema(**node)


def monitors_logged(
    task, trainer: TrainerConfig, checkpoint: CheckpointConfig, num_classes=None
) -> list[str]:
    """checkpoint.keep_best_by and trainer.early_stopping_by (when on) name a metric every evaluation
    logs: one of the task's metric_modes (goodput.recipe.task), for `num_classes` (None: not known
    yet, before the data is listed)."""
    modes = task.metric_modes(num_classes)
    watched = {"checkpoint.keep_best_by": checkpoint.keep_best_by}
    if trainer.early_stopping_patience is not None:
        watched["trainer.early_stopping_by"] = trainer.early_stopping_by
    out = []
    for key, name in watched.items():
        if name is not None and name not in modes:
            why = f" with {num_classes} classes" if num_classes is not None else ""
            out.append(
                f"{key}={name} is not a metric every evaluation logs: task {type(task).__name__} logs "
                f"{', '.join(modes)}{why} (val/top<k>: k = trainer.eval_top_k, null = 5 from 5 classes up; "
                "a metric of your own: goodput/recipe/metrics.py and the task's metric_modes)"
            )
    return out


def idle_settings(trainer: TrainerConfig) -> list[str]:
    """Settings that are accepted but can do nothing in this run (a warning each, naming the keys)."""
    tr, out = trainer, []
    n, every, patience = tr.max_steps, tr.eval_every_n_steps, tr.early_stopping_patience
    evals = n // every + (n % every > 0) if every else 1  # (the last step always evaluates)
    if patience is not None and evals <= patience:  # the first evaluation only sets the best
        out.append(
            f"trainer.early_stopping_patience={patience} can never stop the run: "
            f"trainer.eval_every_n_steps={every} with trainer.max_steps={n} makes {evals} evaluation(s), "
            f"and the first one only sets the best"
        )
    if tr.profile_start_step is not None and tr.profile_start_step > n:
        out.append(f"trainer.profile_start_step={tr.profile_start_step} is after trainer.max_steps={n}: "
                   "no step is profiled")  # fmt: skip
    return out


def idle_top_k(trainer: TrainerConfig, num_classes: int) -> str | None:
    """trainer.eval_top_k at or above the class count (known once the data is listed): a warning."""
    eval_top_k = trainer.eval_top_k
    if eval_top_k is not None and eval_top_k >= num_classes:
        return (f"trainer.eval_top_k={eval_top_k} with {num_classes} classes: val/top{eval_top_k} "
                "counts every sample, it is always 1.0")  # fmt: skip
    return None


def optim_errors(optim: dict) -> list[str]:
    """The optimizer and its LR schedule, built once on a stand-in parameter: their constructors'
    own checks (a negative learning rate, betas out of range, a schedule that divides by zero) fail
    now, naming the key, not after the data is made. Only the errors those checks raise count
    (ValueError, ArithmeticError): an optimizer of your own that needs the real model is built later."""
    import torch  # here, as in validate: composing the config must not import torch

    param = torch.nn.Parameter(torch.zeros(1))

    def optimizer(node):
        return instantiate(node)(params=[param])

    try:
        opt = optimizer(optim["optimizer"])
    except (ValueError, ArithmeticError) as e:
        return [f"{_culprit('optim.optimizer', optim['optimizer'], optimizer, e)}: {e}"]

    def schedule(node):
        return instantiate(node)(opt)

    try:
        if optim.get("schedule") is not None:
            schedule(optim["schedule"])
    except (ValueError, ArithmeticError) as e:
        return [f"{_culprit('optim.schedule', optim['schedule'], schedule, e)}: {e}"]
    return []


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _shard_plan_errors(c: dict, strategy: str) -> list[str]:
    """A model without a shard plan under a strategy that shards block by block: refused now, from
    the model built on the meta device (no memory, no weights), not in every rank after the data."""
    import torch

    from goodput.recipe.models import missing_plan

    try:
        with torch.device("meta"):
            model = instantiate(c["model"], num_classes=c["demo_data"]["num_classes"])
    except Exception:  # a model that cannot be built so: the workers' build says why
        return []
    why = missing_plan(model, c["model"].get("_target_"), c["parallel"].get("shard_units"))
    return [f"parallel.strategy {strategy}: {why}"] if why else []


def _loss_errors(task) -> list[str]:
    """task.loss called once on a stand-in batch (2 samples, 3 classes, probabilities as targets):
    what a loss checks only when called (torch's label_smoothing range) fails now, not at step 1."""
    import torch

    try:
        task.loss(torch.zeros(2, 3), torch.full((2, 3), 1 / 3))
    except Exception as e:
        return [f"task.loss: {e}"]
    return []


def _cause(e: BaseException) -> str:
    """What a constructor said, not Hydra's wrapper around it (InstantiationException: 'Error in
    call to target ...' with the cause's message inside)."""
    cause = e.__cause__ or e
    return f"{type(cause).__name__}: {cause}" if cause is not e else str(e)


def _culprit(where: str, node: dict, build_with, error: BaseException | None = None) -> str:
    """`where.<key>=<value>` for the key whose value the constructor refused: the one its message
    starts with (`warmup_steps must be ...`), or the one that, put back to the target's default,
    makes it build; else `where` (<target>)."""
    import inspect

    from hydra.utils import get_object

    said = [k for k in node if not k.startswith("_") and re.match(rf"{re.escape(k)}\b", str(error or ""))]
    if len(said) == 1:
        return f"{where}.{said[0]}={node[said[0]]!r}"
    try:
        params = inspect.signature(get_object(node["_target_"])).parameters
    except Exception:
        params = {}
    for k, v in node.items():
        p = params.get(k)
        if k.startswith("_") or p is None or p.default is inspect.Parameter.empty:
            continue
        try:
            build_with({**node, k: p.default})
        except Exception:
            continue
        return f"{where}.{k}={v!r}"
    return f"{where} ({node.get('_target_')})"


def validate(c: dict) -> Config:
    """Check a resolved config (plain dict) and convert it, once, into the schemas' dataclasses:
    the `Config` the job's code reads (`cfg.trainer.max_steps`). Raises ConfigError listing every
    problem."""
    errors, nodes = [], {}
    for key in _TYPED:
        try:
            nodes[key] = build(SCHEMAS[key], c[key], key)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    try:  # instantiates the transforms once and checks the output size: a bad list fails here
        augment.build(c["augment"], c["data"]["train_crop_size"])
        nodes["augment"] = build(AugmentConfig, c["augment"], "augment")
    except Exception as e:
        errors.append(f"augment: {e}")
    # Nodes built by their class: the constructor names a mistyped or unknown key (none takes
    # **kwargs) and checks the values. Cheap: a source opens nothing until `open()`.
    built = {}
    for group, key in (("checkpoint", "backend"), ("data", "source"), ("parallel", "strategy")):
        try:
            built[group] = instantiate(c[group][key])
        except Exception as e:
            errors.append(f"{group}.{key}: {e}")

    tr, par = c["trainer"], c["parallel"]
    gbs, n = tr["global_batch_size"], par["nproc_per_node"]
    external = "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if external else n
    if not external and n >= 1:
        import torch  # here: importing this module (every compose, `--help`) must not cost torch's import

        cuda = torch.cuda.is_available()
        limit = torch.cuda.device_count() if cuda else (os.cpu_count() or 1)
        shared = par["oversubscribe"] and not cuda  # CPU processes may share cores; GPUs may not
        if n > limit and not shared:
            errors.append(
                f"parallel.nproc_per_node={n} is more processes than this machine can run ({limit}"
                + (" GPUs)" if cuda else " CPUs; parallel.oversubscribe=true runs them anyway, slower)")
            )
    ck = c["checkpoint"]
    budget = AGENT_STOP_GRACE_S - RESCUE_MARGIN_S
    if ck["rescue"] and tr["signal_grace_seconds"] + ck["rescue_timeout_s"] > budget:
        errors.append(
            f"trainer.signal_grace_seconds={tr['signal_grace_seconds']:g} + checkpoint.rescue_timeout_s="
            f"{ck['rescue_timeout_s']:g} must be at most {budget:g}: a survivor stuck in a collective starts "
            f"its rescue after the grace, and the elastic agent kills it {AGENT_STOP_GRACE_S:g} s after its "
            f"SIGTERM ({RESCUE_MARGIN_S:g} s are left for the exit)"
        )
    # What the strategy class says it does, not its name: a subclass of your own is checked alike.
    strategy, name = built.get("parallel"), par["strategy"]["_target_"]
    if strategy is not None and strategy.shards_parameters and world <= 1:
        errors.append(f"parallel.strategy {name} shards parameters: it needs more than one process "
                      "(set parallel.nproc_per_node >= 2)")  # fmt: skip
    if strategy is not None and strategy.shards_parameters and world > 1:
        errors += _shard_plan_errors(c, name)
    if tr.get("sync_batchnorm") and not _cuda():
        errors.append(
            "trainer.sync_batchnorm=true needs CUDA devices: torch's SyncBatchNorm runs on GPUs only "
            "(on CPU each rank's BatchNorm sees its part of the batch: leave it false)"
        )
    if strategy is not None and strategy.shards_parameters and tr.get("sync_batchnorm"):
        errors.append(
            f"trainer.sync_batchnorm=true with parallel.strategy {name}: SyncBatchNorm is for replicas "
            "(parallel=ddp); under a sharding strategy use a norm without batch statistics (GroupNorm)"
        )
    if strategy is not None and strategy.shards_parameters and tr.get("channels_last"):
        errors.append(
            f"trainer.channels_last=true with parallel.strategy {name}: FSDP2 shards only contiguous "
            "parameters (torch 2.14); use parallel=ddp or single for channels_last"
        )
    if strategy is not None:  # ranks per node: the launcher's (all: one node), or the ones this job starts
        errors += strategy.layout_errors(
            world, int(os.environ.get("LOCAL_WORLD_SIZE", world)) if external else n
        )
    if strategy is not None and not strategy.distributed and world != 1:
        errors.append(
            f"parallel.strategy {name} runs one process, but the world size is {world}: "
            "use parallel=ddp or fsdp"
        )
    if par.get("spares") and not ck["rescue"]:
        errors.append(
            f"parallel.spares={par['spares']} needs checkpoint.rescue=true: the state a spare receives is "
            "the step boundary the rescue notes"
        )
    if par.get("spares") and (strategy is not None and not strategy.distributed or world <= 1):
        errors.append(
            f"parallel.spares={par['spares']} with parallel.strategy {name} on {world} process(es): a spare "
            "takes a dead rank's place among survivors; use parallel=ddp with parallel.nproc_per_node >= 2"
        )
    if isinstance(gbs, int) and gbs > 0 and world >= 1 and gbs % world:
        errors.append(f"trainer.global_batch_size={gbs} is not divisible by the world size {world}")
    else:
        micro = tr.get("micro_batch_size")
        per_rank = gbs // world if isinstance(gbs, int) and world >= 1 else None
        if isinstance(micro, int) and micro > 0 and per_rank and (micro > per_rank or per_rank % micro):
            errors.append(
                f"trainer.micro_batch_size={micro} must divide the per-rank batch {per_rank} "
                f"(trainer.global_batch_size={gbs} / world size {world}): gradient accumulation "
                f"runs per_rank / micro_batch_size whole micro-batches per step"
            )

    # The recipe's nodes, built once (cheap: no data, no model): a bad argument is named now
    recipe = {}
    for key in ("task", "batch_augment"):
        try:
            recipe[key] = instantiate(c[key])
        except Exception as e:
            errors.append(f"{key}: {_cause(e)}")
    if "task" in recipe:  # the loss on a stand-in batch: an argument it checks only when called
        errors += _loss_errors(recipe["task"])
    mix = recipe.get("batch_augment")
    if mix is not None and getattr(mix, "active", True) and getattr(mix, "pairs", False):
        per_rank = gbs // world if isinstance(gbs, int) and world >= 1 else None
        if per_rank is not None and per_rank % 2:
            errors.append(
                f"batch_augment ({c['batch_augment']['_target_']}) mixes neighbouring samples in pairs "
                f"inside each rank's part of the global batch: trainer.global_batch_size={gbs} / world size "
                f"{world} = {per_rank} must be even"
            )
    # The number of classes, where the config says it: the demo data (else known in build.Trainer)
    demo = c["data"]["root"] == c["paths"]["data_dir"]
    classes = c["demo_data"]["num_classes"] if demo else None
    if "trainer" in nodes and "checkpoint" in nodes and "task" in recipe:
        errors += monitors_logged(recipe["task"], nodes["trainer"], nodes["checkpoint"], classes)
    errors += optim_errors(c["optim"])
    if c["mlflow"]["log_model"] == "best" and not c["checkpoint"]["keep_best_by"]:
        errors.append("mlflow.log_model=best needs checkpoint.keep_best_by (which metric is best)")
    if tr.get("compile") and tr.get("compile_cache_upload"):  # the key must not be the store's to swap
        problem = key_file_problem(tr["compile_cache_key_file"], c["checkpoint"]["dir"])
        errors += [problem] if problem else []

    seed = c["seed"]  # any integer torch.manual_seed takes; the streams mix it by hashing
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
        errors.append(f"seed must be an integer, got {seed!r}")

    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
    for w in idle_settings(nodes["trainer"]):  # (eval_top_k against the classes: once they are listed)
        log.warning("%s", w)
    untyped = {k: c[k] for k in ("seed", "model", "task", "batch_augment")}  # an int; `_target_` nodes
    return Config(**untyped, **nodes)


def config_hash(resolved: dict) -> str:
    """A hash of the whole resolved config, recorded in each commit (what decides which run a launch
    continues is the identity, goodput.identity, a digest of fewer keys)."""
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:16]
