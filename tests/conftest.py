"""Fixtures shared by the tests (a reference smoke run per backend, a local S3 endpoint, a one-process
gloo group). Plain helper functions live in helpers.py (`from helpers import run_train`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from helpers import Turns, collector_left_as_found, process_state_kept, run_train

from goodput.data.synthetic import make_dataset
from goodput.parallel import LAUNCHER_ENV, init_distributed, shutdown_distributed

# -- `serial` tests run alone under pytest-xdist ------------------------------------------------
# `make test` runs the suite on 2 xdist workers (most drills wait on process start-up). A test
# marked `serial` times something against the wall clock: it runs alone (helpers.turn).
_TURNS: list[Turns] = []  # this worker's (made on its first test)


def _serial(item) -> bool:
    return item is not None and item.get_closest_marker("serial") is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of each test inside its turn (only under xdist: a plain run is
    serial). `nextitem` is the test this worker runs next: a serial one keeps the room."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        return (yield)
    if not _TURNS:
        _TURNS.append(Turns(Path(tempfile.gettempdir()) / f"goodput-tests-{run}"))
    with _TURNS[0].around(_serial(item), _serial(nextitem)):
        return (yield)


@pytest.fixture(autouse=True)
def _collector_left_as_found():
    with collector_left_as_found():
        yield


@pytest.fixture(autouse=True)
def _tracking_uri_left_as_found():
    """A test that points MLflow's fluent API somewhere (mlflow.set_tracking_uri exports
    MLFLOW_TRACKING_URI) does not hand that store to the in-process jobs of later tests."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture(scope="session")
def smoke_reference(tmp_path_factory):
    """Uninterrupted single-process smoke runs, one per checkpoint backend (shared by the drills)."""
    cache = {}

    def get(backend: str = "dcp_sync", *extra: str) -> dict:
        key = (backend, extra)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"ref-{backend}")
            _, s = run_train(root, f"checkpoint={backend}", *extra)
            cache[key] = s
        return cache[key]

    return get


@pytest.fixture(scope="session")
def s3_endpoint():
    """A local S3-compatible endpoint (moto's server) on loopback."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    import fsspec.config

    # fsspec reads FSSPEC_S3_* at import (for subprocesses); this process imported it already.
    os.environ["FSSPEC_S3_ENDPOINT_URL"] = url
    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = url
    yield url
    fsspec.config.conf.pop("s3", None)
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint, request):
    import s3fs

    name = "goodput-" + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40]
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    fs.mkdir(name)
    s3fs.S3FileSystem.clear_instance_cache()
    return name


@pytest.fixture(scope="module")
def dist1():
    """A one-process gloo group (world 1) for the checkpoint manager's collectives, per test module."""
    for k in LAUNCHER_ENV:
        os.environ.pop(k, None)
    d = init_distributed()
    yield d
    shutdown_distributed()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny demo ImageFolder (2 classes, 4 train images each), per test module (e2e/test_untrusted_runs
    and unit/test_untrusted; unit/test_shards defines its own, bigger one)."""
    root = tmp_path_factory.mktemp("folder")
    make_dataset(str(root), num_classes=2, train_per_class=4, val_per_class=1, image_size=16)
    return str(root)


@pytest.fixture
def one_process(monkeypatch):
    """The job in this process, one rank (as unit/test_keys.py runs it; helpers.run_job_here), its
    process-wide state put back."""
    import torch.distributed.launcher.api as elastic_api

    from goodput.run import launch, worker

    for k in LAUNCHER_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(elastic_api, "elastic_launch", lambda lc, fn: lambda *a: {0: fn(*a)})
    monkeypatch.setattr(launch, "preload_forkserver", lambda: None)
    monkeypatch.setattr(launch.AgentPhases, "install", lambda self: None)
    monkeypatch.setattr(worker, "plot", lambda *a: None)
    with process_state_kept():
        yield
