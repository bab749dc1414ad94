"""Every key of every group option is read by the code that runs a job, and by one component.

For each option of each group, on top of experiment=smoke with paths.root in tmp, the real job runs
in this process: `goodput.run.job.prepare` (validate, demo data, run lock, MLflow run) and
`goodput.run.launch.launch` (one rank: build, resume, 4 loop steps, a checkpoint, the summary), plus
the few extra runs a group's conditional keys need (EXTRA_RUNS). The resolved config those
functions get is a recording tree (Node); the schema dataclasses built from it record attribute
reads. A read of key K is attributed to the module of the Python frame that makes it.

A component is a module, except for the runner: goodput.run.job (once per job), goodput.run.launch,
goodput.run.build (a rank's components), goodput.run.worker (the rank) and goodput.run.loop are one training
run split by phase, and each reads the keys its phase acts on (trainer.max_steps: "already done?"
before any worker, the requeue decision, the loader's length, the loop's end). Keys several phases
read are asserted exactly in PHASES, with the reason for each.

K is consumed by module M when
- a frame of M reads K: `node["k"]`, `node.get("k")`, `"k" in node`, or `cfg.k` on a schema
  instance built from K's node;
- K is an argument of a `_target_` node that some goodput code read (handed on): M is the target's
  module, and K must be a named parameter of the target (a key that lands in **kwargs must be read
  where it lands: the storage node's keys are StorageConfig's fields, read in goodput.storage.remote).
K is consumed without a reader of its own when it is interpolated into a key that is consumed
(paths.* into data.root, checkpoint.dir, ...; data.image_size into demo_data.image_size), or into
Hydra's own config (paths.run_dir is hydra.run.dir).

Not reads (plumbing), each for the reason given where it is excluded:
- bulk access to a node (iteration, `**node`, copying, json, OmegaConf.create, instantiate's own
  copy): handing a node on whole, logging it (summary.json), hashing it (config_hash), MLflow params;
- reads by goodput.config (validate) and by a schema's __post_init__: validation;
- reads by third-party frames and by a dataclass's generated methods (__repr__, __eq__);
- reading a whole node (not a key): it only makes a `_target_` node's arguments count;
- rule (b) skips Hydra's meta keys (`_target_`, `_partial_`): instantiate's, not a component's.
A switch whose one effect is to let a config through a check (SWITCHES: parallel.oversubscribe) is
read by validation only, by definition: the table says so, and the test asserts it exactly.

Limits: a read is not an effect. A key read and then handed to code that ignores it counts as
consumed (data.prefetch_steps under data=remote: the loader computes a look-ahead that
RemoteSource.prefetch does nothing with). A value passed on as an argument is followed only as far
as the module that read it from the config.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
from collections import defaultdict

import pytest
from helpers import REPO, process_state_kept
from hydra import compose, initialize_config_dir
from hydra.utils import get_object
from omegaconf import OmegaConf

from goodput.config import SCHEMAS, Config
from goodput.parallel import LAUNCHER_ENV
from goodput.run import job, launch, worker

CONF = REPO / "conf"
ROOT_KEYS = [(k,) for k in OmegaConf.load(CONF / "train.yaml") if k != "defaults"]  # seed
META = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}  # Hydra's instructions to instantiate


# -- recording ----------------------------------------------------------------------------------
class Recorder:
    def __init__(self):
        self.reads: dict[tuple, set[str]] = defaultdict(set)  # key path -> reading modules
        self.plumbing: dict[tuple, set[str]] = defaultdict(set)

    def note(self, path: tuple, frame) -> None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("goodput") or frame.f_code.co_filename == "<string>":
            # ("<string>": a dataclass's generated __repr__/__eq__, which read every field at once.)
            # Third-party code reading a node we handed it (hydra's instantiate copies the node
            # whole; json, OmegaConf): the node-level read by goodput already counts.
            return
        if module == "goodput.config" or frame.f_code.co_name == "__post_init__":
            # Validation: goodput.config.validate/build and the schemas' own checks read a key to
            # refuse a bad value, which makes nothing happen. A key read only there is dead.
            self.plumbing[path].add(module)
        else:
            self.reads[path].add(module)


REC: Recorder | None = None


def _wrap(value, path: tuple):
    if isinstance(value, dict) and not isinstance(value, Node):
        return Node({k: _wrap(v, (*path, k)) for k, v in value.items()}, path)
    if isinstance(value, list):  # a plain list (OmegaConf takes no subclass); its nodes record
        return [_wrap(v, (*path, i)) for i, v in enumerate(value)]
    return value


class Node(dict):
    """A config node that records point reads (`node[k]`, `node.get(k)`, `k in node`) of its keys.

    Children are stored already wrapped, and keys()/items()/iteration are dict's own: bulk access
    (`**node`, `dict(node)`, iteration, hashing and logging the whole config) hands the node on
    without counting as a read of each key; a node handed to a constructor whole is counted where
    its fields are read (a schema instance, below) or, for a `_target_` node, as its target's
    parameters."""

    __slots__ = ("_path",)

    def __init__(self, items=(), path: tuple = ()):
        super().__init__(items)
        self._path = path

    def _note(self, key):
        if REC is not None:
            REC.note((*self._path, key), sys._getframe(2))

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

    def __setitem__(self, key, value):
        super().__setitem__(key, _wrap(value, (*self._path, key)))

    def __copy__(self):
        return Node(dict.items(self), self._path)

    copy = __copy__

    def __deepcopy__(self, memo):
        import copy

        return Node({k: copy.deepcopy(v, memo) for k, v in dict.items(self)}, self._path)

    def __reduce__(self):  # pickled for another process: a plain dict (nothing records there)
        return dict, (dict(self),)


def _schema_paths() -> dict[type, tuple]:
    """Each schema's key path; the root Config's fields are the root keys (seed, model, the groups)."""
    return {Config: (), **{schema: tuple(group.split("/")) for group, schema in SCHEMAS.items()}}


def _instrument_schemas(monkeypatch, only: tuple = ()) -> None:
    """Attribute reads of schema instances count as reads of `<group>.<field>`. Only instances built
    with arguments (from a config node) record: a schema built from its defaults alone reads no key."""
    tracked: list = []  # instances kept alive, so their ids stay unique
    ids: set[int] = set()
    for schema, path in _schema_paths().items():
        if only and schema not in only:
            continue
        names = {f.name for f in dataclasses.fields(schema)}
        init, getattribute = schema.__init__, schema.__getattribute__

        def __init__(self, *a, _init=init, **kw):
            if a or kw:  # before __post_init__ runs, so that validation reads are seen (as such)
                tracked.append(self)
                ids.add(id(self))
            _init(self, *a, **kw)

        def __getattribute__(self, name, _get=getattribute, _names=names, _path=path):
            if REC is not None and name in _names and id(self) in ids:
                REC.note((*_path, name), sys._getframe(1))
            return _get(self, name)

        monkeypatch.setattr(schema, "__init__", __init__)
        monkeypatch.setattr(schema, "__getattribute__", __getattribute__)


def _let_omegaconf_take_nodes(monkeypatch) -> None:
    """OmegaConf accepts only an exact `dict` as a plain mapping; a Node is one (a bulk read)."""
    import omegaconf

    for name in ("_utils", "omegaconf", "dictconfig", "basecontainer"):
        mod = getattr(omegaconf, name)
        original = mod.is_primitive_dict
        monkeypatch.setattr(
            mod, "is_primitive_dict", lambda obj, _o=original: isinstance(obj, Node) or _o(obj)
        )


def _instrument_conversions(monkeypatch) -> None:
    """goodput.run.job and goodput.data.augment turn a config into a fresh plain dict with
    OmegaConf.to_container before reading it: when a goodput module converts, the result records too,
    rooted at the config's top (both convert a tree rooted there; a sub-tree converted on its own
    gets paths that match no key, so it can only fail to count, never count wrongly)."""
    original = OmegaConf.to_container

    def to_container(cfg, *a, **kw):
        out = original(cfg, *a, **kw)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return _wrap(out, ()) if caller.startswith("goodput") else out

    monkeypatch.setattr(OmegaConf, "to_container", staticmethod(to_container))


# -- the job ------------------------------------------------------------------------------------
def _compose(overrides, hydra=False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=hydra)


def _fake_elastic(lc, fn):
    """The elastic agent's launch, in this process: one worker, world size 1 (the agent's own
    reading of LaunchConfig is torch's business; goodput.run.launch reads the keys to build it)."""
    return lambda *args: {0: fn(*args)}


def run_job(root, overrides) -> dict | None:
    cfg = _compose(["experiment=smoke", f"paths.root={root}", *overrides])
    c, ctx, lock = job.prepare(cfg, str(root / "run"))
    try:
        return launch.launch(c, ctx)
    finally:
        if lock is not None:
            lock.release()


@pytest.fixture
def recorded(monkeypatch):
    """The instruments, and the process-wide state a worker sets (threads, determinism, logging)
    put back afterwards, for the tests that run after these in the same process."""

    import torch
    import torch.distributed.launcher.api as elastic_api

    global REC
    for k in LAUNCHER_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(elastic_api, "elastic_launch", _fake_elastic)
    # Which keys are read does not depend on the device. On CPU, as in CI: validate then allows
    # parallel=ddp|fsdp's 2 processes here even where one GPU would be the limit.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpus = os.cpu_count() or 1
    monkeypatch.setattr(os, "cpu_count", lambda: max(2, cpus))
    monkeypatch.setattr(launch, "preload_forkserver", lambda: None)  # process-wide state
    monkeypatch.setattr(launch.AgentPhases, "install", lambda self: None)  # process-wide state
    monkeypatch.setattr(worker, "plot", lambda *a: None)  # draws goodput.png from numbers: 0.3 s a job
    # Which keys trainer.compile=true reads does not depend on torch compiling (20 s on CPU); the
    # compile cache points inductor at its dir through the environment (process-wide state).
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    _instrument_schemas(monkeypatch)
    _instrument_conversions(monkeypatch)
    _let_omegaconf_take_nodes(monkeypatch)
    REC = Recorder()
    try:
        with process_state_kept():
            yield REC
    finally:
        REC = None


# -- what the records say -----------------------------------------------------------------------
def leaves(node, path: tuple = ()):
    """Key paths of a plain config tree; a list holding nodes (augment.train) is walked by index."""
    if isinstance(node, dict) and node:
        for k, v in dict.items(node):
            yield from leaves(v, (*path, k))
    elif isinstance(node, list) and any(isinstance(v, dict) for v in node):
        for i, v in enumerate(node):
            yield from leaves(v, (*path, i))
    else:
        yield path


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


REF = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")  # ${a.b.c}; resolvers (${oc.env:..}, ${now:..}) are not keys


def derived_from(cfg) -> dict[tuple, set[tuple]]:
    """key path -> the key paths whose value interpolates it (Hydra's own config included)."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    out = defaultdict(set)
    for path in leaves(raw):
        value = _at(raw, path)
        if isinstance(value, str):
            for ref in REF.findall(value):
                out[tuple(ref.split("."))].add(path)
    return out


RUNNER = {
    "goodput.run.job",
    "goodput.run.launch",
    "goodput.run.build",
    "goodput.run.worker",
    "goodput.run.loop",
}


def component(module: str) -> str:
    return "runner" if module in RUNNER else module


class Consumption:
    def __init__(self, c: dict, rec: Recorder, derived: dict):
        self.c, self.reads, self.derived = c, rec.reads, derived

    def _handed(self, node_path: tuple) -> bool:
        """A node reaches its code whole: read as a node, or inside a list that was read, or inside a
        node that was (instantiate builds a `_target_` node's nested `_target_` nodes too: task.loss)."""
        if node_path in self.reads or (
            bool(node_path) and isinstance(node_path[-1], int) and node_path[:-1] in self.reads
        ):
            return True
        return len(node_path) > 1 and self._handed(node_path[:-1])

    def target(self, path: tuple) -> str | None:
        """The module of the `_target_` whose parameter this key is, if its node was handed on.
        Hydra's instantiate passes every key of the node as an argument: the target consumes it."""
        parent = path[:-1]
        node = _at(self.c, parent) if parent else None
        if not (isinstance(node, dict) and "_target_" in node and self._handed(parent)):
            return None
        fn = get_object(dict.__getitem__(node, "_target_"))
        if path[-1] in META:
            return fn.__module__
        p = inspect.signature(fn).parameters.get(path[-1])
        named = p is not None and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        return fn.__module__ if named else None  # into **kwargs: must be shown read where it lands

    def readers(self, path: tuple) -> set[str]:
        """The modules that consume `path`."""
        out = set(self.reads.get(path, ()))
        if (t := self.target(path)) is not None:
            out.add(t)
        return out

    def consumers(self, path: tuple) -> set[str]:
        """The components that consume `path`."""
        return {component(m) for m in self.readers(path)}

    def consumed(self, path: tuple, seen=()) -> bool:
        """Read, or a `_target_`'s argument, or interpolated into a key that is consumed; Hydra
        consumes its own config (paths.run_dir is hydra.run.dir's)."""
        if path[0] == "hydra" or self.consumers(path):
            return True
        return any(q not in seen and self.consumed(q, (*seen, path)) for q in self.derived.get(path, ()))


# -- the groups ---------------------------------------------------------------------------------
def _options() -> list[tuple[str, str]]:
    """Every option of every group: the files under conf/<group>/, and `base` for a group that has
    no file (none now: run/, trainer/, ... have a `default.yaml` that says nothing beyond its schema,
    so `ls conf/` shows them). `hydra` is Hydra's own
    config (consumed by Hydra; hydra/launcher=slurm is composed in test_config), and so are the
    `hparams_search` presets (Hydra's sweeper; run in test_outputs); `experiment` files set other
    groups' keys (test_the_root_file_and_the_experiments)."""
    out = set()
    for f in CONF.rglob("*.yaml"):
        group = f.parent.relative_to(CONF).as_posix()
        if group != "." and group.split("/")[0] not in ("hydra", "experiment", "hparams_search"):
            out.add((group, f.stem))
    out |= {(g, "base") for g in SCHEMAS if not (CONF / g).is_dir()}
    return sorted(out)


def group_keys(c: dict, group: str) -> list[tuple]:
    """The key paths of one group's node, without a nested group's (optim/schedule inside optim)."""
    path = tuple(group.split("/"))
    nested = [tuple(g.split("/")) for g in SCHEMAS if g != group and g.startswith(group + "/")]
    return [path + p for p in leaves(_at(c, path)) if not any((path + p)[: len(n)] == n for n in nested)]


# Code paths that a fresh job does not take, run after it on the same root (the checked group's option
# stays selected); a key read only on such a path is not dead, it is conditional. Each entry: the
# overrides, and whether every checkpoint upload fails (a test-side fault: no config key makes one).
EXTRA_RUNS = {
    # run.resume (and trainer.max_steps, in goodput.run.job) are read on a relaunch that finds a commit;
    # run.overwrite only when run.resume=none finds checkpoints to discard.
    "run": [(["trainer.max_steps=6"], False), (["run.resume=none", "run.overwrite=true"], False)],
    "trainer": [
        (["trainer.max_steps=6"], False),
        # trainer.compile_*: only when trainer.compile is on (the fixture makes compiling a no-op);
        # compile_cache_key_file is opened (created in paths.root) because the upload is on.
        (["trainer.max_steps=8", "trainer.compile=true", "trainer.compile_cache_upload=true"], False),
    ],
    # parallel.rdzv_*: only when the elastic agent starts (max_restarts > 0 or several processes).
    "parallel": [(["parallel.max_restarts=1", "trainer.max_steps=6"], False)],
    # checkpoint.on_error: only when a save fails.
    "checkpoint": [(["checkpoint.on_error=continue", "trainer.max_steps=6"], True)],
}


def _failing_uploads(monkeypatch) -> None:
    from goodput.checkpoint.manager import CheckpointManager

    def _put(self, *a, **kw):
        raise OSError("injected by test_keys: the upload fails")

    monkeypatch.setattr(CheckpointManager, "_put", _put)


# An option that cannot run the 4-step job as it is: what it needs besides (warmup_cosine's 20
# warm-up steps would outlast the run, which is refused).
OPTION_NEEDS = {"optim/schedule=warmup_cosine": ["optim.schedule.warmup_steps=2"]}


def record_jobs(root, overrides, group: str, mlflow_uri: str, monkeypatch) -> tuple[dict, dict]:
    """A fresh job (4 steps: a checkpoint, the summary), then the group's EXTRA_RUNS, all recorded.
    Returns the plain resolved config and its interpolations."""
    needs = [n for o in overrides for n in OPTION_NEEDS.get(o, [])]
    common = [*overrides, *needs, f"mlflow.tracking_uri={mlflow_uri}"]
    run_job(root, [*common, "trainer.max_steps=4"])
    for extra, failing in EXTRA_RUNS.get(group, []):
        with monkeypatch.context() as m:
            if failing:
                _failing_uploads(m)
            run_job(root, [*common, *extra])
    cfg = _compose(["experiment=smoke", f"paths.root={root}", *common, "trainer.max_steps=4"], hydra=True)
    derived = derived_from(cfg)
    OmegaConf.set_struct(cfg, False)
    del cfg["hydra"]  # the job's config is without it (no key of the job interpolates Hydra's)
    return OmegaConf.to_container(cfg, resolve=True), derived


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """One MLflow store for the module (creating one costs a second); the key is read all the same."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


# -- what the current code does: found by this test, asserted exactly ------------------------------
# A key that no code reads under these options. Remove an entry when the key goes or gets read.
KNOWN_DEAD: dict[tuple, set[str]] = {  # key path -> the options under which nothing reads it
    # the ranks per replica group of parallel=hsdp (interpolated into its strategy node): the other
    # strategies have no replica groups to size
    ("parallel", "shard_size"): {"single", "ddp", "fsdp"},
}

# A key read by more than one component today: the components found (a subset of these) and why.
KNOWN_SHARED: dict[tuple, set[str]] = {}

# Switches whose one effect is to let a config through a check that would refuse it: validation
# reads them and nothing else may (asserted exactly, under every option, so the table stays true).
SWITCHES = {
    # more worker processes than CPU cores (4-rank layouts tried on a 2-core machine)
    ("parallel", "oversubscribe"): {"goodput.config"},
}

# Keys that several phases of the runner read (one component: not a finding), asserted exactly so
# that the list stays true: the modules, and why each needs it.
PHASES = {
    # "already done?" before any worker (job, on a relaunch), whether a stop was the end anyway, to
    # requeue (launch), the loader's length (build), whether the restored commit was the final one
    # so that only the run's end is left to write (worker), the loop's end (loop).
    ("trainer", "max_steps"): {
        "goodput.run.job",
        "goodput.run.launch",
        "goodput.run.build",
        "goodput.run.worker",
        "goodput.run.loop",
    },
    # the MLflow run's name (job) and the commit record's `run` field (build).
    ("run", "name"): {"goodput.run.job", "goodput.run.build"},
    # an explicit checkpoint is checked before the workers start (job); the workers load it (worker).
    ("run", "resume"): {"goodput.run.job", "goodput.run.worker"},
    # a warm start's source is checked to be there before a fresh start begins (job); the workers
    # load its weights when they resumed nothing of the run (worker).
    ("run", "init_from"): {"goodput.run.job", "goodput.run.worker"},
    # the job starts the MLflow run; rank 0's Tracker logs to it (build).
    ("mlflow", "tracking_uri"): {"goodput.run.job", "goodput.run.build"},
    # the job creates or checks the data (and hands the opened root to the source's `prepare`),
    # the builder opens it for the loader.
    ("data", "root"): {"goodput.run.job", "goodput.run.build"},
    # conf/train.yaml: weights, sample order, augmentation, RNG state (build); and the schedule of
    # fault.mtbf_seconds' random kills (worker), which has no seed of its own.
    ("seed",): {"goodput.run.build", "goodput.run.worker"},
}


def findings(keys: list[tuple], option: str, c: dict, rec: Recorder, derived: dict) -> dict:
    """What breaks the rules for these keys under one option: dead keys, keys with several readers
    beyond KNOWN_SHARED, and KNOWN_* entries that no longer hold (so the tables cannot go stale)."""
    use = Consumption(c, rec, derived)
    dead = {p for p in keys if not use.consumed(p) and p not in SWITCHES}
    expected_dead = {p for p, opts in KNOWN_DEAD.items() if p in keys and option in opts}
    shared, stale = {}, []
    for p in keys:
        if p[-1] in META:
            # Hydra's instructions: instantiate reads them. Goodput peeking at `_target_` (to check
            # that a node is one, or to call the class's check_root) is part of handing it on.
            continue
        who = use.consumers(p)
        phases = use.readers(p) & RUNNER
        if (len(phases) > 1 or p in PHASES) and phases != PHASES.get(p, phases):
            stale.append(("runner phases", p, phases))
        elif len(phases) > 1 and p not in PHASES:
            stale.append(("runner phases not in PHASES", p, phases))
        if p in KNOWN_SHARED:
            if len(who) < 2 or not who <= KNOWN_SHARED[p]:
                stale.append((p, who))
        elif len(who) > 1:
            shared[p] = who
    stale += [("no longer dead", p) for p in expected_dead - dead]
    for p in SWITCHES.keys() & set(keys):
        if use.consumers(p) or rec.plumbing.get(p, set()) != SWITCHES[p]:
            stale.append(("switch read", p, use.consumers(p), rec.plumbing.get(p, set())))
    return {"dead": dead - expected_dead, "shared": shared, "stale": stale}


@pytest.mark.parametrize("group, option", _options())
def test_every_key_has_one_consumer(recorded, tmp_path, mlflow_uri, monkeypatch, group, option):
    """(a) every key of the option's group node is read by the job (or feeds, by interpolation, a
    key that is), and (b) the modules reading it, validation and bulk hand-offs aside, are one."""
    c, derived = record_jobs(tmp_path, [f"{group}={option}"], group, mlflow_uri, monkeypatch)
    assert group_keys(c, group), f"{group}={option}: no keys found"
    f = findings(group_keys(c, group), option, c, recorded, derived)
    only_checked = {p: sorted(recorded.plumbing[p]) for p in f["dead"] if p in recorded.plumbing}
    assert not f["dead"], f"{group}={option}: keys nothing reads: {sorted(f['dead'])} ({only_checked=})"
    assert not f["shared"], f"{group}={option}: keys read by several components: {f['shared']}"
    assert not f["stale"], f"{group}={option}: KNOWN_*/PHASES/SWITCHES no longer hold: {f['stale']}"


def test_the_root_file_and_the_experiments(recorded, tmp_path, mlflow_uri, monkeypatch):
    """conf/train.yaml's own keys (seed) follow the two rules. An experiment file (`@package
    _global_`) sets other groups' keys: each must be consumed (the values differ between presets;
    which keys are read does not, for these keys)."""
    c, derived = record_jobs(tmp_path, [], "experiment", mlflow_uri, monkeypatch)
    f = findings(ROOT_KEYS, "", c, recorded, derived)
    assert f == {"dead": set(), "shared": {}, "stale": []}, f"conf/train.yaml: {f}"
    use = Consumption(c, recorded, derived)
    for f in sorted((CONF / "experiment").glob("*.yaml")):
        keys = [p for p in leaves(OmegaConf.to_container(OmegaConf.load(f))) if p[0] != "defaults"]
        assert keys and not [p for p in keys if not use.consumed(p)], f"{f.name}: keys nothing reads"


# -- the test can fail ----------------------------------------------------------------------------
def test_a_dead_key_and_a_second_reader_are_caught(recorded, tmp_path, mlflow_uri, monkeypatch):
    """A schema field no code reads is reported dead; a key that a second module starts reading is
    reported with both readers."""
    from hydra.core.config_store import ConfigStore

    from goodput.run import loop
    from goodput.run.config import TrainerConfig

    @dataclasses.dataclass
    class Planted(TrainerConfig):
        planted: int = 3
        """A setting nobody reads."""

    def in_build(
        t, _original=loop.train
    ):  # run with goodput.run.build's globals: a read "by goodput.run.build"
        _ = t.cfg.trainer.log_every_n_steps  # also read by goodput.run.loop: two phases of the runner
        return _original(t)

    def in_tracking(t, _next=None):  # goodput.tracking's globals: another component
        _ = t.cfg.trainer.num_threads  # read by goodput.run.worker (the runner)
        return _next(t)

    from goodput import tracking
    from goodput.run import build

    first = type(in_build)(in_build.__code__, vars(build), "train", in_build.__defaults__)
    second = type(in_tracking)(in_tracking.__code__, vars(tracking), "train", (first,))
    monkeypatch.setattr(loop, "train", second)
    monkeypatch.setitem(SCHEMAS, "trainer", Planted)
    _instrument_schemas(monkeypatch, only=(Planted,))
    cs = ConfigStore.instance()
    cs.store(group="trainer", name="base", node=Planted)
    try:
        c, derived = record_jobs(tmp_path, [], "trainer", mlflow_uri, monkeypatch)
    finally:
        cs.store(group="trainer", name="base", node=TrainerConfig)
    f = findings(group_keys(c, "trainer"), "base", c, recorded, derived)
    assert f["dead"] == {("trainer", "planted")}
    assert f["shared"] == {("trainer", "num_threads"): {"runner", "goodput.tracking"}}
    # A second phase of the runner reading a key is not a second component, but it must be listed.
    assert f["stale"] == [
        (
            "runner phases not in PHASES",
            ("trainer", "log_every_n_steps"),
            {"goodput.run.build", "goodput.run.loop"},
        )
    ]


def test_the_tables_name_schema_keys():
    """A KNOWN_* entry for a key that no schema has any more (renamed, moved into another node) is
    stale: remove it."""
    for path in [*KNOWN_DEAD, *KNOWN_SHARED, *PHASES, *SWITCHES]:
        if len(path) == 1:
            assert path in ROOT_KEYS, f"{path[0]}: not a key of conf/train.yaml"
            continue
        schema = SCHEMAS["/".join(path[:-1])]
        assert path[-1] in {f.name for f in dataclasses.fields(schema)}, f"{'.'.join(path)}: no such key"
