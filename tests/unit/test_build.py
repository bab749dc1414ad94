"""Components from their own config nodes; the code's shape (no import cycles, a key to its use in a
few hops). All in-process."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import time

import pytest
import torch
from helpers import REPO
from helpers import flatten_to_manifest as _flatten_to_manifest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from goodput.checkpoint import CheckpointConfig
from goodput.checkpoint.backends import DCPAsync, DCPSync
from goodput.config import ConfigError, validate
from goodput.data.dataset import CsvManifest, DataRootError, ImageFolder
from goodput.data.loader import ResumableLoader
from goodput.data.sources import RemoteSource
from goodput.data.synthetic import make_dataset
from goodput.parallel import LAUNCHER_ENV, Single, init_distributed, shutdown_distributed
from goodput.run import build
from goodput.run.context import RunContext
from goodput.storage.remote import Storage

SRC = REPO / "src"


def _config(tmp_path, overrides=()) -> dict:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.root={tmp_path}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


class TaggedStorage(Storage):
    """A user's own storage class, selected by `storage._target_`."""


def test_storage_node_opens_the_data_root_and_the_checkpoint_dir(tmp_path):
    c = _config(tmp_path, ["storage.latency_ms=3", "checkpoint=dcp_sync"])
    c["storage"]["_target_"] = f"{__name__}.TaggedStorage"
    data = build.storage(validate(c), c["data"]["root"])
    mgr = build.checkpoint_manager(validate(c))
    for store in (data, mgr.storage):
        assert type(store) is TaggedStorage and store.cfg.latency_ms == 3
    assert mgr.storage.root == c["checkpoint"]["dir"] and data.root == c["data"]["root"]
    assert type(mgr.backend) is DCPSync


def test_the_backend_node_is_its_constructor(tmp_path):
    c = _config(tmp_path, ["checkpoint.backend.async_type=process"])
    backend = build.checkpoint_manager(validate(c)).backend
    assert type(backend) is DCPAsync and backend.async_type.value == "process"
    # A typo inside the node is not swallowed: the constructor takes no **kwargs.
    c["checkpoint"]["backend"]["asyn_type"] = "thread"
    with pytest.raises(ConfigError, match="asyn_type"):
        validate(c)


class CountingSource(RemoteSource):
    """A user's own source, selected by `data.source._target_`."""

    reads = 0

    def read(self, rel):
        type(self).reads += 1
        return super().read(rel)


def test_the_source_node_is_its_class(tmp_path):
    root = tmp_path / "d"
    make_dataset(str(root), num_classes=2, train_per_class=8, val_per_class=2, image_size=16)
    c = _config(tmp_path, ["experiment=smoke", f"data.root={root}", "data=remote"])
    c["data"]["source"]["_target_"] = f"{__name__}.CountingSource"
    typed = validate(c)
    cpu = torch.device("cpu")
    ld = ResumableLoader(typed.data, build.storage(typed, str(root)), 0, 8, 2, 0, 1, cpu)
    next(ld)
    ld.close()
    assert type(ld.source) is CountingSource and CountingSource.reads == 8
    # A typo or a bad value inside the node fails at start-up, naming it (no **kwargs anywhere).
    c["data"]["source"] = {"_target_": "goodput.data.sources.CachedSource", "prefetch_thread": 4}
    with pytest.raises(ConfigError, match="(?s)data.source: .*prefetch_thread"):
        validate(c)
    c["data"]["source"] = {"_target_": "goodput.data.shards.ShardSource", "shuffle_block": -1}
    with pytest.raises(ConfigError, match="data.source.shuffle_block must be >= 0, got -1"):
        validate(c)
    with pytest.raises(ConfigCompositionException, match="prefetch_thread"):
        _config(tmp_path, ["data.source.prefetch_thread=4"])


def test_parallel_single_under_a_bigger_world_is_refused(tmp_path, monkeypatch):
    """An outside launcher (torchrun, SLURM) started 2 processes of a `parallel=single` config."""
    c = _config(tmp_path, ["experiment=smoke"])
    validate(c)
    monkeypatch.setenv("WORLD_SIZE", "2")
    single = "parallel.strategy goodput.parallel.Single runs one process, but the world size is 2"
    with pytest.raises(ConfigError, match=single):
        validate(c)


class TaggingStrategy(Single):
    """A user's own strategy, selected by `parallel.strategy._target_`; its option is `tag`."""

    def __init__(self, tag: str):
        self.tag, self.wrapped = tag, []

    def wrap(self, model, d, param_dtype=None):
        self.wrapped.append(model)
        return model


def test_a_strategy_of_your_own_by_target_wraps_the_model(tmp_path, monkeypatch):
    root = tmp_path / "d"
    make_dataset(str(root), num_classes=2, train_per_class=8, val_per_class=2, image_size=16)
    c = _config(tmp_path, ["experiment=smoke", f"data.root={root}"])
    c["parallel"]["strategy"] = {"_target_": f"{__name__}.TaggingStrategy", "tag": "mine"}
    typed = validate(c)
    for k in LAUNCHER_ENV:
        monkeypatch.delenv(k, raising=False)
    ctx = RunContext(str(tmp_path / "run"), time.time(), "0" * 16)  # no MLflow run: no tracking
    t = build.Trainer(typed, ctx, init_distributed())
    try:
        s = t.step.strategy
        assert type(s) is TaggingStrategy and s.tag == "mine" and s.wrapped == [t.model]
    finally:
        t.close()
        shutdown_distributed()
    # Checked by what the class says (one process, as Single), and its options by its constructor.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=f"{__name__}.TaggingStrategy runs one process"):
        validate(c)
    monkeypatch.delenv("WORLD_SIZE")
    c["parallel"]["strategy"]["tga"] = "x"
    with pytest.raises(ConfigError, match="(?s)parallel.strategy: .*tga"):
        validate(c)


# -- shape of the code -------------------------------------------------------------------------
def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in (SRC / "goodput").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _import_graph() -> dict[str, set[str]]:
    """Each goodput module -> the goodput modules it imports, function-level imports included."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("goodput"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    deps.add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("goodput")}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def test_no_module_imports_one_that_imports_it_back():
    """Every `goodput` import, function-level ones included: the module graph has no cycle."""
    graph = _import_graph()

    def reaches(start, goal, seen):
        for nxt in graph[start]:
            if nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)):
                return True
        return False

    cycles = sorted(m for m in graph if reaches(m, m, set()))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_the_data_layer_imports_no_checkpoint_or_run_code():
    """goodput.data sits below the checkpoint and the run: what it shares with them (an exception, a
    config) lives in a module both import, not up there."""
    above = ("goodput.checkpoint", "goodput.run")
    climbs = {
        (m, d)
        for m, deps in _import_graph().items()
        if m == "goodput.data" or m.startswith("goodput.data.")
        for d in deps
        if any(d == a or d.startswith(a + ".") for a in above)
    }
    assert not climbs, f"goodput.data imports from above it: {sorted(climbs)}"


def test_every_name_a_script_imports_exists():
    """What each script imports at module level exists where it imports it from (the package, the
    scripts' own benchlib, or an installed library), checked from the source without running it: a
    module that moved (goodput.bench -> scripts/benchlib.py) breaks a script no test runs."""
    import importlib
    import sys

    sys.path.insert(0, str(REPO / "scripts"))  # how a script is run: its own folder first on the path
    try:
        for script in sorted((REPO / "scripts").glob("*.py")):
            for node in ast.parse(script.read_text()).body:
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    mod = importlib.import_module(node.module)
                    for alias in node.names:
                        assert (
                            alias.name == "*"
                            or hasattr(mod, alias.name)
                            or importlib.util.find_spec(f"{node.module}.{alias.name}")
                        ), f"{script.name}:{node.lineno}: {node.module} has no {alias.name}"
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        assert importlib.util.find_spec(alias.name), (
                            f"{script.name}:{node.lineno}: {alias.name}"
                        )
    finally:
        sys.path.remove(str(REPO / "scripts"))


def _readers_of(node: str, key: str) -> set[str]:
    """Modules that read `<node>.<key>` from the typed config: `x.node.key`, or `name.key` where the
    module bound `name = x.node` (a `Storage.root` or a `Path.root` is neither)."""
    out = set()
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        aliases = {
            t.id
            for a in ast.walk(tree)
            if isinstance(a, ast.Assign) and isinstance(a.value, ast.Attribute) and a.value.attr == node
            for t in a.targets
            if isinstance(t, ast.Name)
        } | {  # tuple assignments: `dc, tr = c.data, c.trainer`
            t.id
            for a in ast.walk(tree)
            if isinstance(a, ast.Assign) and isinstance(a.value, ast.Tuple)
            for tup in a.targets
            if isinstance(tup, ast.Tuple)
            for t, v in zip(tup.elts, a.value.elts, strict=False)
            if isinstance(t, ast.Name) and isinstance(v, ast.Attribute) and v.attr == node
        }
        for a in ast.walk(tree):
            if isinstance(a, ast.Attribute) and a.attr == key:
                v = a.value
                if (isinstance(v, ast.Attribute) and v.attr == node) or (
                    isinstance(v, ast.Name) and v.id in aliases
                ):
                    out.add(name)
    return out


def _readers(key: str) -> set[str]:
    """Modules that read `key` as a subscript (`node["key"]`) or an attribute (`cfg.key`)."""
    out = set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == key) or (
                isinstance(node, ast.Subscript)
                and isinstance(node.slice, ast.Constant)
                and node.slice.value == key
            ):
                out.add(name)
    return out


def test_a_key_reaches_where_it_acts_in_three_hops():
    """checkpoint.every_n_steps: YAML -> build.checkpoint_manager (passes the node whole) -> the
    manager's `due()`. data.root: YAML -> job.ensure_data (demo data; opens it for the source's
    `prepare`, which packs shards) or build.Trainer -> Storage. Nothing else reads them, so no path
    doubles back (tests/unit/test_keys.py checks every key's readers at run time, this the code's reads;
    the next test that the node arrives whole)."""
    assert _readers("every_n_steps") == {"goodput.checkpoint.manager"}
    # `.data.root` (or `dc.root` after `dc = c.data`): the job and the builder. The source gets it opened.
    assert _readers_of("data", "root") == {"goodput.run.job", "goodput.run.build"}


def test_the_checkpoint_node_reaches_the_manager_whole(tmp_path):
    """build.checkpoint_manager hands the `checkpoint` node to the manager as it is: every field,
    each set away from its default here, arrives unchanged, and `due()` acts on the interval."""
    c = _config(tmp_path, [
        "checkpoint=dcp_sync", "checkpoint.every_n_steps=7", "checkpoint.every_n_minutes=30",
        "checkpoint.keep_last=4", "checkpoint.on_error=continue", "checkpoint.commit_timeout_s=12",
        "checkpoint.keep_best_by=val/accuracy", "checkpoint.keep_best_mode=min", "checkpoint.rescue=false",
        "checkpoint.rescue_timeout_s=9",
    ])  # fmt: skip
    mgr = build.checkpoint_manager(validate(c))
    for f in dataclasses.fields(CheckpointConfig):
        got = getattr(mgr.cfg, f.name)
        assert got == c["checkpoint"][f.name], f.name
        assert got != f.default, f"checkpoint.{f.name}: set it away from its default in this test"
    assert [s for s in range(1, 22) if mgr.due(s)] == [7, 14, 21]


# -- a dataset class by _target_ -------------------------------------------------------------------
def test_csv_manifest_lists_what_it_names(tmp_path):
    make_dataset(str(tmp_path / "folder"), 3, 4, 2, 16, 0)
    _flatten_to_manifest(tmp_path / "folder", tmp_path / "csv")
    store = Storage(str(tmp_path / "csv"))
    a, b = ImageFolder(Storage(str(tmp_path / "folder")), "train"), CsvManifest(store, "train")
    assert b.labels == a.labels and b.classes == a.classes and b.sizes == a.sizes
    assert b.files[0] == "pics/train-00000.jpg" and b.fingerprint != a.fingerprint
    CsvManifest.check_root(store)
    for text, error in [
        ("path,label\npics/train-00000.jpg\n", "line 2: expected `path,label`"),
        ("pics/nope.jpg,circle\n", "missing file(s), e.g. pics/nope.jpg"),
        ("path,label\n", "lists no samples"),
    ]:
        (tmp_path / "csv" / "train.csv").write_text(text)
        with pytest.raises(DataRootError, match=re.escape(error)):
            CsvManifest(store, "train")
    with pytest.raises(FileNotFoundError, match=r"has no labels-train\.csv"):
        CsvManifest.check_root(store, manifest="labels-{split}.csv")
