"""Shared test helpers: run the real entry point on tiny configs in tmp dirs, read what it wrote.

Import them from here (`from helpers import run_train`); fixtures live in conftest.py. No test module
imports another: what two modules share lives here or there."""

from __future__ import annotations

import gc
import glob
import json
import os
import re
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from goodput.data.dataset import ImageFolder
from goodput.parallel import without_launcher_env
from goodput.storage.remote import Storage

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "scripts" / "train.py")


def train_cmd(root, *overrides: str, experiment: str = "smoke") -> list[str]:
    flags = [o for o in overrides if o.startswith("-")]  # Hydra wants -m before the overrides
    rest = [o for o in overrides if not o.startswith("-")]
    return [sys.executable, TRAIN, *flags, f"experiment={experiment}", f"paths.root={root}", *rest]


def entry_env() -> dict:
    """The environment for the entry point: no launcher variables, no outside MLflow store."""
    return {**without_launcher_env(None, "MLFLOW_TRACKING_URI"), "PYTHONUNBUFFERED": "1"}


def start_train(cmd: list[str], out) -> subprocess.Popen:
    """Start `cmd` (see train_cmd) in its own session, so a test can signal its whole process group.
    faulthandler is on in it (and in the workers it forks): `dump_stacks` makes a stuck run say where."""
    env = {**entry_env(), "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def dump_stacks(p: subprocess.Popen, log: Path) -> str:
    """A run started by start_train that a test gave up on: SIGABRT to each process of its group in
    turn, the started one last (each writes its threads' stacks to the log through faulthandler and
    dies: one at a time, so the dumps do not interleave), and the log's tail for the failure message."""
    import signal
    import time

    def group() -> list[int]:
        pids = []
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == p.pid:  # the process group id
                pids.append(int(stat.split("/")[2]))
        return sorted(pids, key=lambda pid: pid == p.pid)

    for pid in group():
        try:
            os.kill(pid, signal.SIGABRT)
            time.sleep(0.5)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    return Path(log).read_text()[-30000:]


def run_train(root, *overrides: str, expect_rc: int = 0, timeout: int = 300, experiment: str = "smoke"):
    """Run scripts/train.py; returns (completed process, newest summary.json or None)."""
    env = entry_env()
    p = subprocess.run(
        train_cmd(root, *overrides, experiment=experiment),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if expect_rc is not None and p.returncode != expect_rc:
        raise AssertionError(
            f"train.py exited {p.returncode} (expected {expect_rc})\n--- stdout\n{p.stdout[-4000:]}\n"
            f"--- stderr\n{p.stderr[-6000:]}"
        )
    return p, latest_summary(root)


@contextmanager
def nodes_running(root, run_dir, log_dir, *overrides: str, agent: tuple = (), nodes: int = 2):
    """A job of `nodes` "nodes" on this machine, left running: torchrun agents with a c10d
    rendezvous on loopback, one rank each of scripts/train.py (experiment=smoke, every node the same
    hydra.run.dir), each in a session of its own printing to `log_dir`/node<i>.log; `agent`: more
    torchrun options. Node 0 hosts the rendezvous's store. Yields the agents' processes; whatever
    is still running at the end is SIGKILLed."""
    import signal
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logs = [open(Path(log_dir) / f"node{i}.log", "w") for i in range(nodes)]  # noqa: SIM115  # closed below
    procs = []
    try:
        for i, f in enumerate(logs):
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "goodput-nodes", "--rdzv-conf", f"is_host={str(i == 0).lower()}", *agent,
                TRAIN, "experiment=smoke", f"paths.root={root}", f"hydra.run.dir={run_dir}", *overrides,
            ]  # fmt: skip
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=entry_env(), stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for f in logs:
            f.close()


def await_step(root, procs, lo: int, hi: int, log: Path, timeout: float = 240) -> None:
    """Until rank 0's first attempt record says a step in [lo, hi] is done (every agent alive)."""
    deadline = time.monotonic() + timeout
    while not lo <= attempt_step(root) <= hi:
        assert all(p.poll() is None for p in procs), log.read_text()[-3000:]
        assert time.monotonic() < deadline, "training did not get under way in time"
        time.sleep(0.02)


def kill_node(pid: int) -> None:
    """SIGKILL a torchrun agent and every process under it (its workers run in sessions of their
    own: a signal to the agent's process group would miss them), the workers first."""
    import psutil

    agent = psutil.Process(pid)
    for p in [*reversed(agent.children(recursive=True)), agent]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def attempt_step(root) -> int:
    """The step rank 0's first attempt record says it finished (0 before it has one)."""
    for f in (Path(root) / "checkpoints").glob("*/attempts/0000.json"):
        try:
            return json.loads(f.read_text())["step"]
        except (OSError, ValueError, KeyError):
            pass
    return 0


def run_nodes(root, run_dir, *overrides: str, nodes: int = 2, nproc: int = 1, timeout: int = 300):
    """A multi-node job on this machine: `nodes` torchrun agents with a c10d rendezvous on loopback,
    each starting `nproc` ranks of scripts/train.py (experiment=smoke, every node the same
    hydra.run.dir). Returns its summary.json and what the nodes printed."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "goodput-test",
        TRAIN, "experiment=smoke", f"paths.root={root}", f"hydra.run.dir={run_dir}", *overrides,
    ]  # fmt: skip
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    procs = [subprocess.Popen(cmd, cwd=REPO, env=entry_env(), **out) for _ in range(nodes)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * nodes, "".join(o[-3000:] for o in outs)
    with open(Path(run_dir) / "summary.json") as f:
        return json.load(f), "".join(outs)


@contextmanager
def turn(lock_dir: Path, serial: bool):
    """One test's turn among xdist workers sharing `lock_dir`: parallel tests run side by side, a
    serial one alone. A readers-writer lock on two flock files: `room` is held shared by parallel
    tests and exclusively by a serial one; `gate`, held by a serial test while it waits for the
    room, keeps new parallel tests from overtaking it (else a busy worker could starve it)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): serial tests are not kept apart there; run JOBS=0
        yield
        return
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / "gate", "a") as gate, open(lock_dir / "room", "a") as room:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if not serial:
            fcntl.flock(gate, fcntl.LOCK_UN)
        fcntl.flock(room, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        if serial:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


class Turns:
    """One xdist worker's turns (see turn), where a serial test followed by another serial test
    keeps the room for it. Released in between, the room went to the other worker's next test (a
    drill of a minute, say) and the next serial test, and this worker, waited for it to end."""

    def __init__(self, lock_dir: Path):
        self.lock_dir, self.kept = lock_dir, None

    @contextmanager
    def around(self, serial: bool, next_serial: bool):
        if self.kept is None:
            self.kept = ExitStack()
            self.kept.enter_context(turn(self.lock_dir, serial))
        try:
            yield
        finally:
            if not (serial and next_serial):
                kept, self.kept = self.kept, None
                kept.close()


def latest_summary(root) -> dict | None:
    files = sorted(glob.glob(f"{root}/runs/**/summary.json", recursive=True), key=os.path.getmtime)
    if not files:
        return None
    with open(files[-1]) as f:
        return json.load(f)


def final_checkpoint_state(ckpt_dir) -> tuple[str, str]:
    """(model_sha256, sample_order_sha256) of the newest committed checkpoint, read back from disk."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from goodput.checkpoint.backends import SafeFileSystemReader
    from goodput.checkpoint.layout import local_commits
    from goodput.checkpoint.state import decode
    from goodput.model import SmallCNN, model_sha256

    newest = Path(local_commits(ckpt_dir)[-1][1])
    if (newest / "state.pt").exists():
        full = torch.load(newest / "state.pt", weights_only=True)
        model_sd, data = full["model"], decode(full["extra"]["data"])
    else:
        reader = SafeFileSystemReader(str(newest))
        md = reader.read_metadata().state_dict_metadata
        sd = {
            k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in md.items()
            if (k.startswith("model.") or k == "extra.data") and isinstance(m, TensorStorageMetadata)
        }
        dcp.load(sd, storage_reader=reader, no_dist=True)
        model_sd = {k[len("model.") :]: v for k, v in sd.items() if k.startswith("model.")}
        data = decode(sd["extra.data"])
    model = SmallCNN(num_classes=10, width=32)
    model.load_state_dict(model_sd)
    return model_sha256(model), data["sample_order_sha256"]


def final_weights(ckpt_dir) -> dict:
    """The model tensors of the newest committed checkpoint in `ckpt_dir`, read back from disk."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from goodput.checkpoint.backends import SafeFileSystemReader
    from goodput.checkpoint.layout import local_commits

    newest = Path(local_commits(ckpt_dir)[-1][1])
    if (newest / "state.pt").exists():
        return torch.load(newest / "state.pt", weights_only=True)["model"]
    reader = SafeFileSystemReader(str(newest))
    md = reader.read_metadata().state_dict_metadata
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return {k[len("model.") :]: v for k, v in sd.items()}


# Resuming on another world size sums the same gradients in another order (one rank's mean of 16
# vs the mean of two ranks' means of 8): float rounding, nothing else. After 12 steps the weights
# differed from the 2-rank reference by 1.7e-7 to 3.7e-7 relative (measured on the four cases of
# e2e/test_parallel.py's test_resume_on_another_world_size_or_strategy); a resume that loaded no
# weights (fresh init at step 8, the negative controls there and in e2e/test_hsdp_runs.py) by 1.8.
# The hsdp resumes of e2e/test_hsdp_runs.py (4 ranks -> 2) are held to the same bound. The rounding
# can grow with the steps after the change: the 40-step job of e2e/test_rescue_runs.py resumed on
# one process at step 10, 13 or 14 ends 1.2e-4 away (at 15, 16 or 20: 3e-7 to 7e-7), so that test does
# not use this bound.
WEIGHT_RTOL = 1e-4


def weight_gap(a: dict, b: dict) -> float:
    """Largest difference over all tensors, relative to that tensor's largest magnitude."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item() for k in a)


def check_config_change(c: dict, change: dict, message: str | None) -> None:
    """`c` with each group of `change` updated validates (message None), or fails naming `message`."""
    import re

    import pytest

    from goodput.config import ConfigError, validate

    bad = {**c, **{k: {**c[k], **v} for k, v in change.items()}}
    if message is None:
        validate(bad)
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(bad)


def compose_train(overrides, hydra=False):
    """conf/train.yaml composed with `overrides` through Hydra's compose API (no run, no output dir)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=hydra)


@contextmanager
def collector_left_as_found():
    """Fails the test that leaves the collector frozen (the entry points freeze it for a fast
    exit), and unfreezes it: the worker's later tests that count on collection (test_data.py)
    would fail instead, far from the cause, and only when xdist puts them after it."""
    import pytest

    yield
    if gc.get_freeze_count():
        gc.unfreeze()
        pytest.fail("the test left the collector frozen (gc.freeze): nothing it held is collected")


@contextmanager
def process_state_kept():
    """What a worker sets for the whole process (threads, determinism, logging, the preemption
    handlers, MLflow's tracking URI: goodput.publish sets it, and MLflow exports it as
    MLFLOW_TRACKING_URI, which the next job's config would read), put back after a job run in this
    process. A run that raised keeps its StopSignal handlers on purpose (a SIGTERM must not kill its
    rescue write); the next test gets the old ones."""
    import logging
    import signal

    import mlflow.tracking._tracking_service.utils as mlflow_uri
    import torch

    from goodput import logs
    from goodput.resilience.preemption import PREEMPT_SIGNALS

    root = logging.getLogger()
    saved = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        root.level,
        root.handlers[:],
        logs._who,  # the worker's rank in every line (`rank0`); later tests log as the job again
        {sig: signal.getsignal(sig) for sig in PREEMPT_SIGNALS},
        (mlflow_uri._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")),
    )
    try:
        yield
    finally:
        mlflow_uri._tracking_uri = saved[6][0]
        if saved[6][1] is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved[6][1]
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])
        root.setLevel(saved[2])
        root.handlers[:] = saved[3]
        logs._who = saved[4]
        for sig, handler in saved[5].items():
            signal.signal(sig, handler)


def run_job_here(root, *overrides, run_dir=None):
    """The job on experiment=smoke in this process (with the one_process fixture): prepare, then
    launch one rank. Returns (summary, typed config). `run_dir`: the launch's (default <root>/run)."""
    from goodput.run import job, launch

    cfg = compose_train(["experiment=smoke", f"paths.root={root}", *overrides])
    c, ctx, lock = job.prepare(cfg, str(run_dir or Path(root) / "run"))
    try:
        return launch.launch(c, ctx), c
    finally:
        if lock is not None:
            lock.release()


class Counter:
    """A minimal stateful component for AppState: one integer."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def make_app(seed: int, width: int = 8):
    """An AppState (model, optimizer, schedule, counter, RNG) one real step past its defaults."""
    import torch

    from goodput.checkpoint import AppState, RNGState
    from goodput.model import SmallCNN

    torch.manual_seed(seed)
    model = SmallCNN(num_classes=4, width=width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    # one real step so optimizer state and the schedule are not at their defaults
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    opt.step()
    sched.step()
    counter = Counter()
    counter.n = seed
    app = AppState(model, opt, rank=0)
    app.register("counter", counter)
    app.register("scheduler", sched)
    app.register("rng", RNGState(seed, 0), per_rank=True)
    return app, counter, sched


def manager(tmp_path, backend: str, d, remote: str | None = None, keep_last: int = 3, **kw):
    """A CheckpointManager on rank 0 of the one-process group `d` (the dist1 fixture)."""
    from goodput.checkpoint import BACKENDS, CheckpointConfig, CheckpointManager
    from goodput.storage.remote import Storage

    remote = remote or str(tmp_path / "remote")
    node = {"_target_": f"goodput.checkpoint.backends.{BACKENDS[backend].__name__}"}
    cfg = CheckpointConfig(node, remote, str(tmp_path / "staging"), None, None, keep_last, **kw)
    return CheckpointManager(cfg, Storage(remote), BACKENDS[backend](), 0, 1, 0, pg=d.ckpt_pg)


def plain_write(path: str, data: bytes) -> None:
    """The mutant the cache-fill drills must catch: a fill written in place, not temp + rename."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


# The entry point with one change: after the restore, the model is re-initialised (what a resume
# that restored everything but the weights would train on). Run as `python script TRAIN overrides...`.
FORGET_WEIGHTS = """
import runpy, sys
import torch
import goodput.checkpoint.manager as m

restore = m.CheckpointManager.restore

def forgetful(self, app, candidates):
    rec, skipped = restore(self, app, candidates)
    torch.manual_seed(12345)
    for mod in app.model.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    return rec, skipped

m.CheckpointManager.restore = forgetful
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def flatten_to_manifest(src: Path, dst: Path) -> None:
    """The ImageFolder at `src` as a flat folder of images plus `<split>.csv` manifests, in the
    ImageFolder's order: the same samples under other names, labels only in the manifest."""
    (dst / "pics").mkdir(parents=True)
    for split in ("train", "val"):
        folder = ImageFolder(Storage(str(src)), split)
        rows = ["path,label"]
        for i, (rel, label) in enumerate(zip(folder.files, folder.labels)):
            name = f"pics/{split}-{i:05d}.jpg"
            (dst / name).write_bytes((src / rel).read_bytes())
            rows.append(f"{name},{folder.classes[label]}")
        (dst / f"{split}.csv").write_text("\n".join(rows) + "\n")


def manifest_dataset(folder, dst):
    """The demo data flattened under `pics/` with a train.csv naming each file."""
    os.makedirs(dst / "pics")
    rows = ["path,label"]
    src = ImageFolder(Storage(folder), "train")
    for i, (rel, label) in enumerate(zip(src.files, src.labels)):
        (dst / "pics" / f"{i}.jpg").write_bytes(Path(folder, rel).read_bytes())
        rows.append(f"pics/{i}.jpg,{src.classes[label]}")
    return rows


def two_steps(tmp_path, dist1):
    """A dcp_sync manager on `dist1` with two committed steps of different weights."""
    mgr = manager(tmp_path, "dcp_sync", dist1)
    app, *_ = make_app(1)
    mgr.save(1, app)
    app.model.head.weight.data.add_(1.0)
    mgr.save(2, app)
    mgr.wait()
    return mgr, app, tmp_path / "remote"


# a record nested past any parser's recursion limit
DEEP = b"[" * 100000 + b"]" * 100000


def ckpt_dir(root, name: str = "smoke") -> Path:
    """The checkpoint dir (checkpoint.dir) of the run called `name`, or of the one run of experiment
    `name` under paths.root `root`: `<root>/checkpoints/<name>`, else the one
    `<root>/checkpoints/<name>-<8 hex digits>` (the default run.name: the experiment plus the digest
    of the identity keys, goodput.identity). Tests find a run's checkpoints through this, not by
    spelling the path, so the run-naming rule lives in one place."""
    base = Path(root) / "checkpoints"
    if (base / name).is_dir():
        return base / name
    found = sorted(
        p
        for p in base.glob(f"{name}-*")
        if p.is_dir() and re.fullmatch(r"[0-9a-f]{8}", p.name[len(name) + 1 :])
    )
    if len(found) != 1:
        names = [p.name for p in found]
        raise AssertionError(f"expected one run named {name}[-<digest>] under {base}, found {names}")
    return found[0]


class StochasticNet:
    """`model._target_=helpers.StochasticNet.build`: a small CNN with what a rescue must put back
    or re-derive: BatchNorm buffers (the forward changes them before the update) and dropout
    (draws from the global RNG)."""

    @staticmethod
    def build(num_classes: int, width: int = 8, **_):
        from torch import nn

        return nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.Dropout(0.3),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes),
        )  # fmt: skip


def end_gloo_rank() -> None:
    """The end of an `mp.spawn` gloo rank: a barrier, then the group destroyed. Without the barrier
    a rank that returns straight after a collective can start interpreter shutdown while gloo's
    worker thread still releases that collective's tensors; taking the GIL then ends the thread
    inside a C++ destructor, and the rank dies of SIGABRT after doing all its work (pytorch#190489;
    seen 3 runs in 20 of test_step's FSDP ranks, none in 20 with the barrier)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


class PyRandomShift:
    """An augmentation of a researcher's own that draws from Python's `random` and NumPy's global
    generator, not torch's: exact at any worker count only because the engine seeds both per sample
    (goodput.data.dataset.seeded)."""

    def __call__(self, img):
        import random

        import numpy as np
        import torch

        return torch.roll(img, shifts=(int(np.random.randint(-3, 4)), random.randint(-3, 3)), dims=(-2, -1))


# augment.train with PyRandomShift, ending at the smoke runs' 16 x 16
PY_RANDOM_AUGMENT = (
    "augment.train=[{_target_:helpers.PyRandomShift},"
    "{_target_:torchvision.transforms.v2.Resize,size:[16,16]}]"
)


class WithHead(torch.nn.Module):
    """The nested model form (lightning-hydra-template's `net:`): a backbone node inside the model's,
    built by Hydra first, then given to this class with num_classes."""

    def __init__(self, net: torch.nn.Module, num_classes: int):
        super().__init__()
        self.net, self.out = net, torch.nn.Linear(net.head.out_features, num_classes)

    def forward(self, x):
        return self.out(self.net(x))


class SilentStore:
    """An HTTP store on loopback that accepts every connection and never answers it (what a hung
    tracking server or artifact store looks like to MLflow's client: each request waits its 120 s
    timeout, 8 times). After `answer()`, new connections are served as a minimal artifact store
    (PUT stored by path, 200); the held ones stay unanswered. `close()` drops them all."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held, self.put, self._answer = [], {}, threading.Event()
        threading.Thread(target=self._accept, name="silent store", daemon=True).start()

    def _accept(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler

        store = self

        class Answer(BaseHTTPRequestHandler):
            def do_PUT(self):
                store.put[self.path] = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        while True:
            try:
                conn, addr = self.sock.accept()
            except OSError:  # closed
                return
            if not self._answer.is_set():
                self.held.append(conn)
            else:
                threading.Thread(target=Answer, args=(conn, addr, None), daemon=True).start()

    def answer(self) -> None:
        self._answer.set()

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


# MLflow's own tracking server (its Flask app, artifacts proxied) in one process: `python -c
# MLFLOW_SERVER ROOT PORT_FILE`. Seconds to start, where `mlflow server` takes 15 and forks ten.
MLFLOW_SERVER = """
import os, sys
root, port_file = sys.argv[1], sys.argv[2]
os.environ["_MLFLOW_SERVER_FILE_STORE"] = f"sqlite:///{root}/mlflow.db"
os.environ["_MLFLOW_SERVER_ARTIFACT_ROOT"] = "mlflow-artifacts:/"
os.environ["_MLFLOW_SERVER_ARTIFACT_DESTINATION"] = f"{root}/artifacts"
os.environ["_MLFLOW_SERVER_SERVE_ARTIFACTS"] = "true"
from werkzeug.serving import make_server
from mlflow.server import app
server = make_server("127.0.0.1", 0, app, threaded=True)
with open(port_file + ".tmp", "w") as f:
    f.write(str(server.server_port))
os.replace(port_file + ".tmp", port_file)
server.serve_forever()
"""


class FailsInsideUpdate(torch.optim.SGD):
    """`optim.optimizer._target_=helpers.FailsInsideUpdate`: SGD that, armed (`fail_at`, set by the
    test), writes its first parameter in its `fail_at`-th step and raises there: a failure inside
    the optimizer's update with the parameters half-written (an out-of-memory error in a fused
    kernel, a device lost mid-update). Unarmed, it is SGD."""

    fail_at: int | None = None

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.calls = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        if self.calls == FailsInsideUpdate.fail_at:
            group = self.param_groups[0]
            first = group["params"][0]
            first.sub_(group["lr"] * first.grad)  # one of the step's writes, the others never made
            raise RuntimeError(f"the optimizer failed inside its step {self.calls}, one parameter written")
        return super().step(closure)


def warmup_constant(
    optimizer, total_steps: int, warmup_steps: int = 20, min_lr_ratio: float = 0.05, warmup_epochs=None
):
    """`optim.schedule._target_=helpers.warmup_constant`: a schedule of one's own taking
    goodput.run.schedule.warmup_cosine's arguments (a linear warm-up, then the LR held): its class
    changed and no other key."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))
