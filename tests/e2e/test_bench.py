"""Smoke tests of the benchmark scripts at tiny sizes: they run, and write complete JSON and a PNG."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time

import pytest
from helpers import REPO

from goodput.parallel import without_launcher_env


def _benchlib():
    """scripts/benchlib.py, loaded from its file: the scripts import it by name from their own
    directory, which is not on the tests' path (and should not be: it would put every script there)."""
    spec = importlib.util.spec_from_file_location("benchlib", REPO / "scripts" / "benchlib.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_script(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**without_launcher_env(), "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, f"{name} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_helpers():
    b = _benchlib()
    median, ratio, markdown_table = b.median, b.ratio, b.markdown_table
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert math.isnan(ratio(1.0, 0.0))
    table = markdown_table(["a", "b"], [["x", 1.5], ["yy", float("nan")]])
    lines = table.splitlines()
    assert len(lines) == 4 and lines[1].startswith("|--") and "-" in lines[3]


# A process tree four deep: each level spins 0.3 s of CPU, then forks the next and waits for it
TREE = r"""
import os, time
def level(d):
    print(d, os.getpid(), time.time(), flush=True)
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    if d < 3:
        pid = os.fork()
        if pid == 0:
            level(d + 1)
            os._exit(0)
        os.waitpid(pid, 0)
    time.sleep(0.1)  # a sample sees the CPU it ended with
level(0)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
def test_tree_cpu_names_each_depth_and_splits_time_into_windows():
    """drill.py --cpu: a process's role is its depth below the job, and a window holds the CPU time
    spent inside it (none of a process that had not started)."""
    b = _benchlib()
    p = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    tree = b.TreeCPU(p.pid, interval_s=0.02).start()
    out, _ = p.communicate(timeout=60)
    tree.stop()
    levels = [line.split() for line in out.splitlines()]
    pids, starts = [int(x[1]) for x in levels], [float(x[2]) for x in levels]
    assert [tree.roles.get(pid) for pid in pids] == list(b.ROLES)
    whole = tree.window(starts[0] - 1, time.time())
    assert all(0.2 <= whole[role] <= 0.6 for role in b.ROLES), whole
    first = tree.window(starts[0] - 1, starts[1] - 0.01)  # before the first fork: the job alone
    assert 0.2 <= first[b.ROLES[0]] <= 0.6 and [first[r] for r in b.ROLES[1:]] == [0.0, 0.0, 0.0], first
    later = tree.window(starts[2], time.time())  # the first two levels had spent theirs already
    assert later[b.ROLES[0]] < 0.05 and later[b.ROLES[1]] < 0.05 and later[b.ROLES[3]] >= 0.2, later
    assert tree.self_cpu_s > 0


def test_cpu_per_failure_compares_each_restart_with_steady_training_after_it():
    """drill.py --cpu: a restart's window runs kill -> first resumed step; its steady window starts
    2 s after that step and is dropped when the next kill comes first."""
    b = _benchlib()
    sys.modules["benchlib"] = b  # drill.py imports it by name from its own directory
    spec = importlib.util.spec_from_file_location("drill", REPO / "scripts" / "drill.py")
    drill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drill)

    class Tree:  # each role burns 1 CPU-s per second inside restarts, 0.5 outside
        samples = [(200.0, {})]
        self_cpu_s = 1.0

        def window(self, t0, t1):
            inside = sum(max(0.0, min(t1, b_) - max(t0, a_)) for a_, b_ in spans)
            return dict.fromkeys(b.ROLES, inside + 0.5 * (t1 - t0 - inside))

    spans = [(10.0, 12.0), (15.0, 16.0), (40.0, 44.0)]  # the second kill comes 3 s after the first step
    s = {"recovery": {"per_restart": [{"at": {"failure": a, "first_step": z}} for a, z in spans]}}
    c = drill.cpu_per_failure(Tree(), s, elapsed=100.0)
    role = b.ROLES[2]
    assert c["restarts"] == 3 and c["restart_wall_s"] == pytest.approx(7 / 3, abs=1e-3)
    assert c["restart_cpu_s"][role] == pytest.approx(7 / 3, abs=1e-3)  # 2 + 1 + 4 CPU-s over three restarts
    assert c["steady_windows"] == 2  # after 12 s: [14, 16) reaches the kill at 15; after 16 and 44: kept
    assert c["steady_cpu_s"][role] == pytest.approx(0.5 * 7 / 3, abs=1e-3)  # 0.5/s, as long as a restart
    assert c["sampler_cpu_share"] == pytest.approx(0.01)
    assert "| all" in drill.cpu_table("faulty", c)


@pytest.mark.slow  # ~40 s on 2 cores, mostly process start-up: three sets of processes + DCP daemons
def test_bench_checkpoint_smoke(tmp_path):
    tiny = "mobilenet_v3_small"  # 30 MB of state
    p = run_script(
        "bench_checkpoint.py",
        *("--model", tiny, "--train-model", tiny, "--repeats", "1", "--latency-ms", "1"),
        *("--bandwidth-mb-s", "0", "--train-rounds", "2", "--save-every", "4", "--train-batch", "4"),
        *("--train-image-size", "32", "--out", str(tmp_path)),
    )
    report = json.loads((tmp_path / "bench_checkpoint.json").read_text())
    assert (tmp_path / "bench_checkpoint.png").stat().st_size > 0
    got = {(r["backend"], r["ranks"], r["async_type"]) for r in report["rows"]}
    assert got == {
        ("torch_save", 1, None),
        ("dcp_sync", 1, None),
        ("dcp_sync", 2, None),
        ("dcp_async", 1, "thread"),
        ("dcp_async", 2, "thread"),
        ("dcp_async", 1, "process"),
        ("dcp_async", 2, "process"),
    }
    for r in report["rows"]:
        for k in (
            "stall_s",
            "commit_s",
            "floor_s",
            "stall_vs_torch_save",
            "stall_vs_floor",
            "state_bytes_per_rank",
        ):
            assert positive(r[k]), (r["label"], k, r[k])
        assert r["commit_s"] >= r["stall_s"]
        assert r["committed_bytes"] >= r["state_bytes_per_rank"] * 0.9  # the whole state reached the remote
    assert [r["label"] for r in report["train"]] == [
        "torch_save",
        "dcp_sync",
        "dcp_async/thread",
        "dcp_async/process",
    ]
    for r in report["train"]:
        for k in ("step_s_no_save", "step_s_with_save", "stall_s_mean", "after_save_step_s", "other_step_s"):
            assert positive(r[k]), (r["label"], k, r[k])
        assert r["saves"] == 2
    sums = {(r["label"], r["checksums"]): r for r in report["checksums"]}
    assert set(sums) == {(b, on) for b in ("dcp_sync", "dcp_async/thread") for on in (True, False)}
    assert all(positive(r["stall_s"]) and r["commit_s"] >= r["stall_s"] for r in sums.values())
    assert positive(sums[("dcp_sync", True)]["commit_vs_without"])
    assert len(report["targets"]) == 11 and report["machine"]["cpu_count"] >= 1
    assert p.stdout.count("PASS") + p.stdout.count("MISS") == 11
    assert not any(tmp_path.glob("ckpt-*")), "scratch space left behind"


def test_bench_data_smoke(tmp_path):
    p = run_script(
        "bench_data.py",
        *("--data-root", str(tmp_path / "data"), "--classes", "2", "--per-class", "48"),
        *("--batch", "16", "--steps", "3", "--compute-ms", "5", "--latency-ms", "2", "--repeats", "1"),
        *("--sweep-prefetch-steps", "1", "--sweep-threads", "2,8", "--sweep-steps", "2"),
        *("--s3-latency-ms", "2", "--shard-mb", "0.02", "--shuffle-block", "2", "--out", str(tmp_path)),
        timeout=240,
    )
    report = json.loads((tmp_path / "bench_data.json").read_text())
    assert (tmp_path / "bench_data.png").stat().st_size > 0
    rows = {r["row"]: r for r in report["rows"]}
    assert list(rows) == ["emulated remote", "emulated cached cold", "emulated cached warm", "floor"]
    for r in rows.values():
        for k in ("images_per_s", "fetch_s_per_step", "wait_share", "seconds", "cpu_ms_per_image"):
            assert positive(r[k]), (r["row"], k, r[k])
    assert rows["emulated cached warm"]["hit_rate"] == 1.0  # the cold pass filled the cache with every file
    assert {(c["prefetch_steps"], c["prefetch_threads"]) for c in report["sweep"]} == {(1, 2), (1, 8)}
    s3 = {r["row"]: r for r in report["s3_rows"]}
    try:
        import streaming  # noqa: F401

        mosaic = ["mosaic cold", "mosaic warm"]
    except ImportError:
        mosaic = []
    assert list(s3) == [
        "s3 remote",
        "s3 cached cold (old client)",
        "s3 cached cold",
        "s3 cached warm",
        "s3 shards cold",
        "s3 shards warm",
        *mosaic,
    ]
    for r in s3.values():
        for k in ("images_per_s", "cpu_ms_per_image"):
            assert positive(r[k]), (r["row"], k, r[k])
    # Requests counted at the proxy: one GET per file for remote (the listing aside), a HEAD
    # more per file a fresh worker client reads with the old client, a handful for shards.
    files = 6 * 16
    assert files <= s3["s3 remote"]["requests"] <= files + 10
    assert s3["s3 remote"]["requests_by_method"].get("HEAD", 0) == 0
    assert s3["s3 cached cold (old client)"]["requests_by_method"].get("HEAD", 0) > 0
    assert s3["s3 cached warm"]["requests"] <= 5  # listings only
    # Each file fetched once: a worker that reaches a file the prefetch is fetching waits for it.
    assert s3["s3 cached cold"]["requests"] <= files + 5
    for r in s3.values():
        assert (r["connections"] > 0) == (r["requests"] > 0) and r["endpoint_cpu_s"] >= 0, r["row"]
    assert positive(s3["s3 remote"]["endpoint_cpu_s"])  # ~100 requests: some clock ticks at least
    assert s3["s3 shards cold"]["requests"] <= report["s3_staged"]["shards_per_epoch"] + 3
    assert s3["s3 shards warm"]["requests"] <= 2  # index.json
    assert len(report["targets"]) == 3 + (2 if mosaic else 0)
    assert p.stdout.count("PASS") + p.stdout.count("MISS") == len(report["targets"])
    # A second run reuses the generated dataset.
    p2 = run_script(
        "bench_data.py",
        *("--data-root", str(tmp_path / "data"), "--classes", "2", "--per-class", "48"),
        *("--batch", "16", "--steps", "2", "--compute-ms", "1", "--latency-ms", "0", "--repeats", "1"),
        *("--sweep-prefetch-steps", "", "--sweep-steps", "2", "--no-s3", "--out", str(tmp_path / "again")),
    )
    assert "reusing the dataset" in p2.stderr
    assert json.loads((tmp_path / "again" / "bench_data.json").read_text())["sweep"] == []


def test_bench_recipe_smoke(tmp_path):
    """bench_recipe.py's cost part at a tiny size: a row against the plain one in its JSON, and its
    chart (the numbers themselves are docs/benchmarks.md's; the accuracy part is the same runs, longer)."""
    out = tmp_path / "bench"
    run_script(
        "bench_recipe.py", "--only", "cost", "--cost-steps", "2", "--parts", "mixup", "--out", str(out)
    )
    got = json.loads((out / "recipe.json").read_text())
    assert [r["part"] for r in got["cost"]] == ["plain (experiment=demo)", "mixup_cutmix"]
    assert got["cost"][0]["vs_plain"] == 1.0 and all(r["images_per_s"] > 0 for r in got["cost"])
    assert (out / "recipe.png").stat().st_size > 0
