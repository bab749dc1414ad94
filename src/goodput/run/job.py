"""Once per job, before any worker starts: check the config, take the run lock, create the demo
data, open the MLflow run, and stop early if the run is already done.

Under an external launcher (torchrun, srun) every rank runs this; only global rank 0 writes (demo
data, overwrite, the MLflow run) and tells the others in goodput.run.worker.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import replace

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from goodput import identity, provenance
from goodput.checkpoint.export import SourceError, locate
from goodput.checkpoint.layout import parse_step
from goodput.config import Config, ConfigError, config_hash, validate
from goodput.data.synthetic import COMPLETE, foreign_files, make_dataset, read_record
from goodput.errors import UserError
from goodput.resilience.accounting import process_start
from goodput.resilience.lock import RunLock
from goodput.run import build
from goodput.run.context import RunContext
from goodput.storage.remote import DIR
from goodput.tracking import (
    CHECKPOINT_TAG,
    IDENTITY_TAG,
    StoreTimeout,
    close_leftovers,
    end_run,
    flatten,
    run_status,
    source_tags,
    start_run,
    within,
)
from goodput.untrusted import printable

log = logging.getLogger("goodput")


_STARTED: list[float] = []  # the jobs this process prepared


class AlreadyDone(Exception):
    pass


class DataDirTaken(UserError, FileExistsError):
    """paths.data_dir (where the demo data is generated) holds files that are not demo data."""


class IdentityChanged(UserError, ValueError):
    """An existing run (an explicit run.name) was trained with other identity keys."""


class CodeChanged(UserError, ValueError):
    """The commit a launch would continue was written by other code (goodput.provenance)."""


def prepare(
    cfg: DictConfig,
    run_dir: str,
    multirun_suffix: str | None = None,
    choices: dict | None = None,
    conf_dir: str | None = None,
) -> tuple[Config, RunContext, RunLock | None]:
    """Resolve and check the config, take the run lock, create demo data, open the MLflow run.
    Returns the typed config, this launch's context and the lock (held by rank 0's job process).
    `conf_dir`: the config dir the job composed from (its files are part of the code record)."""
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    if not re.match(r"^[a-z][a-z0-9+.-]*://", str(cfg.paths.root)):
        cfg.paths.root = os.path.abspath(str(cfg.paths.root))  # async daemons and workers need absolute paths
    if multirun_suffix:  # each sweep job its own run, also when the sweep is over non-identity keys
        cfg.run.name = f"{cfg.run.name}/{multirun_suffix}"
    ident = identity.record(cfg)  # from the composed config: some values count as written
    epochs_to_steps(cfg)  # (after the identity: a run is named by its epochs, as written)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    # The goodput ledger counts this launch from the process's start, imports included; the later
    # jobs of a sweep run in the same process (Hydra's basic launcher), each from its own start.
    job_start = process_start() if not _STARTED else time.time()
    _STARTED.append(job_start)
    c = validate(resolved)
    choices = {k: v for k, v in (choices or {}).items() if not k.startswith("hydra")}
    params = flatten(resolved)  # the MLflow params, and (hashed) the run's identity
    params.update({f"choice.{k}": str(v) for k, v in choices.items()})
    ctx = RunContext(run_dir, job_start, config_hash(params), identity=ident,
                     code=provenance.code_record(conf_dir))  # fmt: skip
    leader = int(os.environ.get("RANK", "0")) == 0

    view = build.checkpoint_commits(c)  # read-only: no backend, no staging dir from this process
    committed = view.committed()
    # A changed identity is refused before any work (the demo data, the run lock): the commit
    # records say what the run was trained with, and by which code, once the bytes of the one deciding
    # verify. _prepare_run checks again the commit it continues.
    early = _deciding_record(c, ctx, view, committed)
    check_identity(c, ctx, early, view.storage, quiet=True)
    check_code(c, ctx, early, view.storage, quiet=True)
    if leader:
        ensure_data(c)
    lock = None
    if leader:
        lock = RunLock(view.storage, c.run.lock_stale_seconds)
        lock.acquire()
        ctx = replace(ctx, lock_token=lock.token)  # every commit checks that the lock is still this job's
    try:
        ctx = _prepare_run(c, ctx, view, committed, leader, params, cfg)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return c, ctx, lock


def epochs_to_steps(cfg: DictConfig) -> None:
    """trainer.max_epochs and optim.schedule.warmup_epochs turned into steps in the composed config,
    before it is resolved (so what interpolates trainer.max_steps, the schedule's end, follows). The
    run's name is fixed first: the run is named by what was written (epochs), not by the steps."""
    tr, sched = cfg.trainer, cfg.optim.get("schedule")
    epochs = OmegaConf.to_container(cfg, resolve=False)["trainer"].get("max_epochs")  # (as written)
    epochs = tr.max_epochs if epochs is not None else None  # (resolved)
    warm = sched.get("warmup_epochs") if isinstance(sched, DictConfig) else None
    if epochs is None and warm is None:
        return
    if epochs is not None and tr.get("max_steps") is not None:
        raise ConfigError(
            f"trainer.max_epochs={epochs} and trainer.max_steps={tr.max_steps} are both set: a run's length "
            "is one of them (trainer.max_steps=null to train by epochs)"
        )
    per = steps_per_epoch(cfg)
    cfg.run.name = str(cfg.run.name)
    if epochs is not None:
        tr.max_steps = int(epochs) * per
        log.info("trainer.max_epochs=%s: %d steps (%d a epoch)", epochs, tr.max_steps, per)
    if warm is not None:
        sched.warmup_steps, sched.warmup_epochs = int(round(float(warm) * per)), None


def steps_per_epoch(cfg: DictConfig) -> int:
    """Optimizer steps in an epoch of the training split: samples x data.repeated_augment // global
    batch. The demo data's size is its config's; other data is listed (one listing of train/)."""
    from goodput.data.config import DataConfig
    from goodput.data.loader import open_split

    data = OmegaConf.to_container(cfg.data, resolve=True)
    gbs, repeats = int(cfg.trainer.global_batch_size), int(data["repeated_augment"])
    if data["root"] == str(cfg.paths.data_dir):
        n = int(cfg.demo_data.num_classes) * int(cfg.demo_data.train_per_class)
    else:
        store = build.storage_of(OmegaConf.to_container(cfg.storage, resolve=True), data["root"])
        n = len(open_split(DataConfig(**data), store, "train")[1])
    per = n * repeats // gbs
    if per < 1:
        raise ConfigError(
            f"an epoch of {n} training samples x data.repeated_augment={repeats} is less than one global "
            f"batch (trainer.global_batch_size={gbs}): trainer.max_epochs cannot count steps"
        )
    return per


def _prepare_run(
    c: Config,
    ctx: RunContext,
    view,
    committed: list,
    leader: bool,
    params: dict,
    cfg: DictConfig | None = None,
) -> RunContext:
    """Decide what this launch continues (refusing a changed identity), then open its MLflow run.
    `cfg`: the composed config, for the LR schedule's numbers when trainer.max_steps changed."""
    resume, store = str(c.run.resume), view.storage
    explicit = None
    if resume not in ("auto", "none"):  # fail now, with exit 2, rather than inside the workers
        explicit = view.resolve(resume)
    if leader and resume == "none" and (committed or store.ls("attempts")):
        if not c.run.overwrite:
            raise FileExistsError(
                f"run '{c.run.name}' already has checkpoints in {store.url()}; use run.resume=auto to "
                f"continue it, run.overwrite=true to discard them, or another run.name"
            )
        log.warning("run.overwrite=true: discarding %s", store.url())
        for name, size in store.ls().items():
            if RunLock.owns(name):  # the lock this job holds, its heartbeat
                continue
            if size == DIR and _holds_a_run(store.ls(name)):  # a sweep job's run: run.name/<overrides>
                log.warning("run.overwrite=true: keeping %s, another run's", store.url(name))
                continue
            store.rm(name, recursive=True)
        committed = []
    source = c.run.init_from  # a warm start: its weights must be there before a fresh start begins
    if source and not committed:
        try:
            locate(source, open_storage=lambda url: build.storage(c, url))
        except SourceError as e:
            raise SourceError(f"run.init_from={source}: {e}") from None
    # "Already done" and the MLflow run to continue come from the newest commit whose bytes verify:
    # a junk step far ahead (sizes right, checksums wrong) must not end the job with "nothing to do".
    newest = view.newest_verified(committed) if resume == "auto" and committed else None
    deciding = newest if explicit is None else _verified_if_refused(c, ctx, view, explicit)
    check_identity(c, ctx, deciding, store)  # before any work: the refusal is exit 2
    check_code(c, ctx, deciding, store)
    m = c.mlflow
    started = time.monotonic()  # the MLflow calls before the first step: mlflow.start_timeout_s together

    def bounded(fn, what: str):
        try:
            return within(fn, started + m.start_timeout_s - time.monotonic(), what)
        except TimeoutError:
            raise StoreTimeout(
                f"MLflow: the tracking store {m.tracking_uri} did not answer within "
                f"mlflow.start_timeout_s={m.start_timeout_s:g} s ({what}); nothing was trained. Run the "
                f"same command again once it answers, or point mlflow.tracking_uri at another store"
            ) from None

    if leader:  # this job holds the run lock: a RUNNING run of this dir is a killed job's
        what = "closing the runs a killed job left RUNNING"
        bounded(lambda: close_leftovers(m.tracking_uri, m.experiment, store.url()), what)
    # A rescue of the last step (its final evaluation or save failed) is not the end: the workers
    # finish it (the evaluation, the final regular commit, the summary), as after an elastic restart.
    unfinished = newest is not None and newest.get("kind") == "rescue"
    complete = newest is not None and (
        newest["step"] >= c.trainer.max_steps or bool(newest.get("stop_reason"))
    )
    if complete and not unfinished:  # its end (evaluation, summary, model, FINISHED) cut short?
        unfinished = _end_not_written(c, newest, started + m.start_timeout_s - time.monotonic())
    if newest is not None and newest["step"] >= c.trainer.max_steps and not unfinished:
        raise AlreadyDone(
            f"run '{c.run.name}' is complete: it reached step {newest['step']} "
            f"(trainer.max_steps={c.trainer.max_steps}); nothing to do. Raise trainer.max_steps to train "
            f"it further; a command that changes what is trained is a new run, one that changes only how "
            f"(checkpoint, data source, parallelism) is this run: give it a run.name of its own, or use -m "
            f"(one run per job). Checkpoint: {store.url(newest['dir'])}"
        )
    if newest is not None and newest.get("stop_reason") and not unfinished:
        raise AlreadyDone(
            f"run '{c.run.name}' is complete: it stopped at step {newest['step']} "
            f"({printable(newest['stop_reason'])}). Checkpoint: {store.url(newest['dir'])}"
        )
    previous_run_id = _run_to_continue(c, newest, store)
    start = explicit or newest
    log.info("run '%s': %s", c.run.name, f"continues from step {start['step']}" if start else "a new run")
    if cfg is not None and newest is not None and newest.get("max_steps") not in (None, c.trainer.max_steps):
        log.warning("%s", longer_run(cfg, newest["step"], newest["max_steps"], c.trainer.max_steps))
    if not leader:
        return ctx
    tags = {CHECKPOINT_TAG: store.url(), IDENTITY_TAG: ctx.identity.get("digest", ""), **code_tags(ctx.code)}
    tags = {**source_tags(sys.argv[0]), **parent_tag(m.parent_run_id), **tags}
    run_id = bounded(
        lambda: start_run(
            m.tracking_uri, m.experiment, c.run.name, params, previous_run_id, m.artifact_location, tags=tags
        ),
        "creating or continuing the run",
    )
    # identity.json (the digest's keys), code.json and code.diff (the code: goodput.provenance) are
    # uploaded by rank 0's Tracker, which never waits for them
    return replace(ctx, mlflow_run_id=run_id)


def check_code(c: Config, ctx: RunContext, rec: dict | None, store, quiet: bool = False) -> None:
    """The commit a launch would continue was written by this launch's code (goodput.provenance);
    if not, the launch is refused naming the files that changed, unless run.allow_code_change (a
    warning). `quiet`: refuse only (the early check); the warnings are the later check's."""
    allow = c.run.allow_code_change
    if rec is None:
        return
    diff = provenance.changed(rec.get("code"), ctx.code)
    if diff is None:  # written before commits recorded their code
        if not quiet:
            log.warning(
                "%s records no code digest (written by an older version): continuing run '%s' without "
                "checking the code that wrote it", store.url(rec["dir"]), c.run.name,
            )  # fmt: skip
        return
    if not diff:
        return
    shown = ", ".join(_escaped(f) for f in diff[:8]) + (f" and {len(diff) - 8} more" if len(diff) > 8 else "")
    if not allow:
        raise CodeChanged(
            f"run '{c.run.name}' ({store.url(rec['dir'])}) was written by other code than this launch's: "
            f"{shown} changed. A run is one program: give this code a run of its own (run.name=<new name>), "
            f"or set run.allow_code_change=true to continue this run with it (recorded in its next commits)"
        )
    if not quiet:
        log.warning(
            "run.allow_code_change=true: continuing run '%s' with changed code: %s", c.run.name, shown
        )


def code_tags(code: dict) -> dict[str, str]:
    """The MLflow tags of a launch's code: its digest, and the git commit with a dirty flag."""
    git = code.get("git") or {}
    tags = {"goodput.code_digest": str(code.get("digest", ""))}
    if git:
        tags.update(
            {"goodput.git_commit": str(git.get("commit")), "goodput.git_dirty": str(git.get("dirty"))}
        )
    return tags


def _escaped(text: str) -> str:
    """A name from a record, printed without the control characters it may carry."""
    return json.dumps(str(text))[1:-1]


def _end_not_written(c: Config, newest: dict, timeout_s: float = 120.0) -> bool:
    """A complete run whose MLflow run did not end FINISHED: the job was killed while it wrote the
    run's end (a SIGKILL, a second signal), after the final commit, or the store did not take it
    within mlflow.end_timeout_s. The relaunch writes it: no step, no save; the final evaluation
    again, the summary, the logged model. Every node decides alike: the leader has set a run left
    RUNNING to KILLED, and either is not FINISHED. A run this launch would not continue (another
    run.name's), or a store that does not answer within `timeout_s`: complete."""
    run_id = newest.get("mlflow_run_id")
    if run_id is None or newest.get("run") not in (None, c.run.name):
        return False
    status = run_status(c.mlflow.tracking_uri, run_id, timeout_s)
    if status in (None, "FINISHED"):
        return False
    log.warning(
        "run '%s' reached step %d, but its end was not written (MLflow run %s is %s: killed while "
        "ending, or its store did not answer in time?): writing it now (the final evaluation, the "
        "summary, the logged model)",
        c.run.name, newest["step"], printable(run_id), status,
    )  # fmt: skip
    return True


def _continued_record(c: Config, view, committed: list) -> dict | None:
    """The commit record a launch would continue, from the records alone (no bytes verified):
    run.resume's step dir, or with resume=auto the newest commit."""
    resume = str(c.run.resume)
    if resume == "none":
        return None
    if resume != "auto":
        return view.resolve(resume)
    return committed[0] if committed else None


def _refuses(c: Config, ctx: RunContext, rec: dict | None) -> bool:
    """Whether check_identity or check_code would refuse `rec` (from its record alone)."""
    theirs = rec and rec.get("identity")
    other_keys = (
        bool(theirs)
        and not c.run.allow_config_change
        and bool(identity.differences(theirs["keys"], ctx.identity["keys"]))
    )
    other_code = (
        rec is not None
        and not c.run.allow_code_change
        and bool(provenance.changed(rec.get("code"), ctx.code))
    )
    return other_keys or other_code


def _verified_if_refused(c: Config, ctx: RunContext, view, rec: dict) -> dict | None:
    """`rec` when its record agrees with this launch (nothing to refuse: no byte read) or its bytes
    verify; else None, with a warning naming it: a step dir whose bytes do not verify refuses
    nothing (a junk copy with an edited identity record); loading it fails on its own."""
    if not _refuses(c, ctx, rec):
        return rec
    why = view.verify(rec)
    if why is None:
        return rec
    log.warning("not trusting %s: %s", view.storage.url(rec["dir"]), why)
    return None


def _deciding_record(c: Config, ctx: RunContext, view, committed: list) -> dict | None:
    """The commit record the early identity check decides on. The records alone (no byte read) while
    the one the launch would continue agrees with this launch: the usual relaunch costs nothing
    here. One that would refuse counts only once its bytes verify: with resume=auto the newest
    commit that verifies decides instead (a junk step far ahead, sizes right and checksums wrong,
    with an edited identity record, is skipped as any corrupt commit is)."""
    rec = _continued_record(c, view, committed)
    if not _refuses(c, ctx, rec):
        return rec
    if str(c.run.resume) == "auto":
        return view.newest_verified(committed)
    return _verified_if_refused(c, ctx, view, rec)


def check_identity(c: Config, ctx: RunContext, rec: dict | None, store, quiet: bool = False) -> None:
    """The commit a launch would continue was trained with this launch's identity keys; if not, the
    launch is refused naming each key with both values, unless run.allow_config_change (a warning).
    `quiet`: refuse only (the early check, before any work); the warnings are the later check's."""
    allow = c.run.allow_config_change
    if rec is None:
        return
    theirs = rec.get("identity")
    if theirs is None:  # written before commits recorded it
        if quiet:
            return
        log.warning(
            "%s records no run identity (written by an older version): continuing run '%s' without "
            "checking that it trains the same thing", store.url(rec["dir"]), c.run.name,
        )  # fmt: skip
        return
    diff = identity.differences(theirs["keys"], ctx.identity["keys"])
    if not diff:
        return
    if not allow:
        raise IdentityChanged(
            f"run '{c.run.name}' was trained with other identity keys than this launch (its commit "
            f"{store.url(rec['dir'])}): {identity.describe(diff)}. Leave run.name unset (a new run, "
            f"named by what it trains), choose another run.name, or set run.allow_config_change=true "
            f"to continue it anyway"
        )
    if not quiet:
        log.warning(
            "run.allow_config_change=true: continuing run '%s' with changed identity keys: %s",
            c.run.name, identity.describe(diff),
        )  # fmt: skip


def longer_run(cfg: DictConfig, step: int, old_max: int, new_max: int) -> str:
    """What a changed trainer.max_steps does to a continued run, the LR schedule's numbers included."""
    said = f"trainer.max_steps {old_max} -> {new_max}: the run continues from step {step} to {new_max}."
    before = cfg.copy()
    before.trainer.max_steps = old_max
    old_node = OmegaConf.to_container(before.optim.schedule, resolve=True)
    new_node = OmegaConf.to_container(cfg.optim.schedule, resolve=True)
    moved = [
        f"optim.schedule.{k} {old_node.get(k)} -> {v}" for k, v in new_node.items() if old_node.get(k) != v
    ]
    if not moved:
        return f"{said} The LR schedule does not depend on trainer.max_steps: it goes on as it was."
    optimizer = OmegaConf.to_container(cfg.optim.optimizer, resolve=True)
    was = build.lr_trace(optimizer, old_node, [step])
    now = build.lr_trace(optimizer, new_node, [step, new_max])
    if was is None or now is None:
        return f"{said} The LR schedule follows it ({', '.join(moved)}): the LR changes from the resume on."
    jump = (
        "the same LR, no jump" if math.isclose(was[0], now[0], rel_tol=1e-9)
        else f"x{now[0] / was[0]:.3g}: the LR jumps at the resume" if was[0] else "the LR jumps at the resume"
    )  # fmt: skip
    return (
        f"{said} The LR schedule follows it ({', '.join(moved)}): after step {step} the old schedule gave "
        f"LR {was[0]:.4g}, the new one gives {now[0]:.4g} ({jump}), then {now[1]:.4g} at step {new_max}."
    )


def close_failed(c: Config, ctx: RunContext, e: BaseException) -> None:
    """The job failed (or was interrupted) after its MLflow run was opened: end the run FAILED
    (KILLED for an interrupt) with the error as a tag, unless a worker ended it already; waiting
    at most mlflow.end_timeout_s."""
    end_run(c.mlflow.tracking_uri, ctx.mlflow_run_id, e, timeout_s=c.mlflow.end_timeout_s)


def _run_to_continue(c: Config, rec: dict | None, store) -> str | None:
    """The MLflow run id of the verified commit `rec`, when it belongs to this run. A commit written
    under another run.name (copied in, or a store shared by mistake) is fenced: its MLflow run is not
    continued, a new one starts, with a warning naming both."""
    if rec is None:
        return None
    name = c.run.name
    if rec.get("run") is not None and rec.get("run") != name:
        log.warning(
            "%s was written by run '%s', not '%s': not continuing its MLflow run %s (a new one starts)",
            store.url(rec["dir"]), printable(rec.get("run")), name, printable(rec.get("mlflow_run_id")),
        )  # fmt: skip
        return None
    run_id = rec.get("mlflow_run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def _holds_a_run(listing: dict) -> bool:
    """A directory's listing is a run's own: its lock, its attempt records or its step dirs (what a
    run writes directly under its dir, checkpoint.layout; none of its own subdirs holds these)."""
    return RunLock.NAME in listing or "attempts" in listing or any(parse_step(n) is not None for n in listing)


def parent_tag(run_id: str | None) -> dict[str, str]:
    """A trial of a hyperparameter search nests under the search's run (MLflow's own tag)."""
    return {"mlflow.parentRunId": run_id} if run_id else {}


def ensure_data(c: Config) -> None:
    """The data the ranks will read exists: the source class's `prepare` (the demo data generated
    if it is missing; data=shards packs it), once, before the ranks start."""
    dc = c.data
    source = get_class(dc.source["_target_"])
    root = build.storage(c, dc.root)
    source.prepare(root, dc.dataset, lambda url: build.storage(c, url), lambda: _ensure_dataset(c, root))


def _check_demo_record(c: Config, root: str) -> None:
    """The demo data in paths.data_dir is what demo_data.* generate. The run's identity names the
    demo data by those keys (data.root is `${paths.data_dir}` as written): other demo data there
    (make_dataset.py's, other settings') would train, and continue, a run under a name that says
    otherwise; a checkpoint of that run would not even fit its head."""
    ds, rec = c.demo_data, read_record(root) or {}
    want = {
        "num_classes": ds.num_classes,
        "train": ds.num_classes * ds.train_per_class,
        "val": ds.num_classes * ds.val_per_class,
        "image_size": ds.image_size,
        "seed": ds.seed,
        "kind": ds.kind,
    }
    rec = {**rec, "kind": rec.get("kind", "shapes")}  # the default kind is not recorded
    off = [f"{k} {rec.get(k)} (demo_data.* make {v})" for k, v in want.items() if rec.get(k) != v]
    if off:
        raise DataDirTaken(
            f"paths.data_dir {root} holds demo data other than demo_data.* generate: {', '.join(off)} "
            f"({COMPLETE}). To train on the data in it, pass data.root={root} instead of paths.data_dir; "
            f"for the demo data, set demo_data.* to match it, or leave paths.data_dir to its default "
            f"(named by demo_data.*)"
        )


def _ensure_dataset(c: Config, store) -> None:
    """The demo data generated where it is missing; the dataset class checks `store` (data.root)."""
    root = c.data.root
    if root == c.paths.data_dir and read_record(root) is None:  # the demo data: generate it
        foreign = foreign_files(root)
        if foreign:  # somebody's files (paths.data_dir pointed at a dataset): never written over
            raise DataDirTaken(
                f"paths.data_dir {root} holds {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''} "
                f"but no {COMPLETE}: it is not goodput's demo data, so the demo data is not generated "
                f"there. To train on the data in it, pass data.root={root} instead of paths.data_dir "
                f"(it is where the demo data goes); for the demo data, name an empty or new folder"
            )
        if os.path.isdir(os.path.join(root, "train")):  # a killed generator's (its marker is there)
            log.warning("demo data at %s is incomplete (no %s): generating it again", root, COMPLETE)
        ds = c.demo_data
        log.info("demo data not found: generating it at %s", root)
        n = make_dataset(root, ds.num_classes, ds.train_per_class, ds.val_per_class, ds.image_size, ds.seed,
                         kind=ds.kind)  # fmt: skip
        log.info("wrote %d train / %d val JPEGs", n["train"], n["val"])
    elif root == c.paths.data_dir:
        _check_demo_record(c, root)
    node = c.data.dataset  # the dataset class checks its root (cheaply) before any worker starts
    options = {k: v for k, v in node.items() if k != "_target_"}
    get_class(node["_target_"]).check_root(store, **options)
