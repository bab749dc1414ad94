"""Shared helpers for scripts/bench_*.py: machine record, medians, markdown tables, JSON and PNG output,
and an S3 endpoint with latency and a bandwidth cap (`S3Endpoint`).

Not part of the runtime package: nothing in `goodput` imports it. The bench scripts import it as
`benchlib` because Python puts a script's own directory first on sys.path (`python
scripts/bench_data.py`), and spawned children inherit that path.

The benchmarks run on whatever machine is at hand, often a shared and noisy one: every figure is a
median of repeats, and comparisons are ratios of rows measured side by side in the same run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from goodput.parallel import LAUNCHER_ENV, free_port  # noqa: F401  (free_port: re-exported for the bench scripts)
from goodput.storage.local import atomic_file


def machine_info() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        model = platform.processor()
    try:
        import torchvision

        tv = torchvision.__version__
    except ImportError:
        tv = None
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "torchvision": tv,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def machine_line(m: dict) -> str:
    return (
        f"{m['cpu_count']} CPU ({m['cpu_model'] or 'unknown'}), GPU: {m['gpu'] or 'none'}, "
        f"torch {m['torch']}, python {m['python']}, {m['date']}"
    )


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds per call of fn, `repeats` times."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def fmt(v, digits: int = 3) -> str:
    if isinstance(v, float):
        if v != v:  # NaN
            return "-"
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    cells = [[str(h) for h in headers]] + [[fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def target(name: str, measured: float, limit: float, ok: bool, detail: str = "") -> dict:
    """A target is evaluated on the measured figure and reported either way: never tuned away."""
    return {"name": name, "measured": measured, "limit": limit, "pass": bool(ok), "detail": detail}


def target_line(t: dict) -> str:
    return f"{'PASS' if t['pass'] else 'MISS'}  {t['name']}: {t['detail']}"


def write_json(path: str | Path, obj: dict) -> None:
    with atomic_file(str(path), "w") as f:
        json.dump(obj, f, indent=1, default=str)


def bar_chart(
    path: str | Path, title: str, panels: Sequence[tuple[str, Sequence[str], Sequence[float]]]
) -> None:
    """One horizontal bar panel per (ylabel, labels, values), stacked vertically, written as PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    n = len(panels)
    height = sum(0.35 * len(p[1]) + 1.0 for p in panels)
    fig, axes = plt.subplots(n, 1, figsize=(8, max(3.0, height)), squeeze=False)
    for ax, (xlabel, labels, values) in zip(axes[:, 0], panels):
        ys = list(range(len(labels)))
        ax.barh(ys, values, color="#4c72b0")
        ax.set_yticks(ys, labels)
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        for y, v in zip(ys, values):
            ax.text(v, y, f" {fmt(float(v))}", va="center", fontsize=8)
        ax.margins(x=0.15)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def clean_dist_env() -> None:
    """A 1-rank run must not see a launcher's variables (init_distributed would wait for peers)."""
    for k in LAUNCHER_ENV:
        os.environ.pop(k, None)


_T0 = time.perf_counter()


def log(msg: str) -> None:
    """Progress on stderr with seconds since start, so a slow phase is easy to spot."""
    print(f"[{time.perf_counter() - _T0:5.0f}s] {msg}", file=sys.stderr, flush=True)


# -- a real S3 API on loopback, with latency and bandwidth injected in front of it --------------
_METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")


def _pump(src, dst, counts, lock, latency_s: float, bw_bytes_s: float, upstream: bool) -> None:
    """Copy one direction of a connection. Client->server: each chunk that opens with an HTTP method
    starts a request (count it, add the latency). Server->client: pace to the connection's bandwidth."""
    next_t = time.monotonic()
    try:
        while True:
            chunk = src.recv(1 << 16)
            if not chunk:
                break
            if upstream:
                if chunk.startswith(_METHODS):
                    method = chunk.split(b" ", 1)[0].decode()
                    with lock:
                        counts[method] = counts.get(method, 0) + 1
                    if latency_s:
                        time.sleep(latency_s)
            elif bw_bytes_s:
                next_t = max(next_t, time.monotonic()) + len(chunk) / bw_bytes_s
                delay = next_t - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(2)
            except OSError:
                pass


def _s3_server_main(conn, latency_ms: float, bandwidth_mb_s: float, max_connections: int) -> None:
    """Runs in its own process, so the server's and the proxy's CPU never count as the client's."""
    import logging
    import socket
    import socketserver
    import threading

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    up_host, up_port = server.get_host_and_port()
    counts: dict[str, int] = {}
    conns = [0]  # connections accepted: a client that reuses connections opens few
    lock = threading.Lock()
    slots = threading.BoundedSemaphore(max_connections)

    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            with lock:
                conns[0] += 1
            with slots:  # bounded: at most max_connections proxied at once
                up = socket.create_connection((up_host, up_port))
                for s in (self.request, up):
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                t = threading.Thread(
                    target=_pump,
                    args=(up, self.request, counts, lock, 0.0, bandwidth_mb_s * 1e6, False),
                    daemon=True,
                )
                t.start()
                _pump(self.request, up, counts, lock, latency_ms / 1000, 0.0, True)
                t.join()
                up.close()

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = allow_reuse_address = True
        # socketserver's default backlog is 5: a burst of new connections (moto's server closes
        # each one after its response, so every request is a new connection) overflowed it and
        # the kernel dropped SYNs, which clients resend only after 1 s. A real endpoint does not.
        request_queue_size = 1024

    proxy = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    conn.send(f"http://127.0.0.1:{proxy.server_address[1]}")
    while True:
        cmd = conn.recv()
        if cmd == "counts":
            with lock:
                conn.send(dict(counts))
        elif cmd == "connections":
            with lock:
                conn.send(conns[0])
        elif cmd == "reset":
            with lock:
                counts.clear()
                conns[0] = 0
            conn.send(True)
        else:
            break
    proxy.shutdown()
    server.stop()


class S3Endpoint:
    """moto's S3 server behind a loopback proxy adding `latency_ms` per request and capping each
    connection at `bandwidth_mb_s`; counts requests by method. Loopback only, one helper process.

    `url` is the endpoint for boto3/s3fs/obstore; `counts()` and `reset()` read and clear the tally.
    """

    def __init__(self, latency_ms: float = 10.0, bandwidth_mb_s: float = 100.0, max_connections: int = 256):
        import multiprocessing as mp

        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_s3_server_main, args=(child, latency_ms, bandwidth_mb_s, max_connections), daemon=True
        )
        self.proc.start()
        if not self._conn.poll(60):
            self.proc.kill()
            raise RuntimeError("the S3 endpoint (moto + proxy) did not start within 60 s")
        self.url: str = self._conn.recv()

    def counts(self) -> dict[str, int]:
        self._conn.send("counts")
        return self._conn.recv()

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the endpoint's process has used so far."""
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def connections(self) -> int:
        """TCP connections accepted since the last reset."""
        self._conn.send("connections")
        return self._conn.recv()

    def reset(self) -> None:
        self._conn.send("reset")
        self._conn.recv()

    def use_for_fsspec(self) -> None:
        """Point s3fs (this process and every child) at the endpoint."""
        import fsspec.config

        os.environ["FSSPEC_S3_ENDPOINT_URL"] = self.url
        os.environ["S3_ENDPOINT_URL"] = self.url  # MosaicML Streaming's boto3 client reads this
        os.environ["AWS_ENDPOINT_URL"] = self.url  # boto3 and obstore
        fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = self.url

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send("stop")
            except OSError:
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


def process_cpu_s(exclude_pids: Sequence[int] = ()) -> float:
    """CPU seconds (user + system) of this process and its live children (DataLoader workers),
    minus `exclude_pids` (the S3 endpoint's process): the client's cost of loading data."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system  # reaped children too
    for ch in me.children(recursive=True):
        if ch.pid in exclude_pids:
            continue
        try:
            c = ch.cpu_times()
            total += c.user + c.system
        except psutil.NoSuchProcess:
            pass
    return total


# A process's role in a job, by its depth below the job's process (scripts/train.py): the job runs
# the elastic agent, its children are the agent's helpers (the forkserver, multiprocessing's resource
# tracker), theirs are the ranks, and the ranks' children are DataLoader workers.
ROLES = ("job (elastic agent)", "agent helpers", "ranks", "data workers")


class TreeCPU:
    """CPU seconds (user + system) of a process tree, sampled on a thread every `interval_s`.

    A process's role (ROLES) is fixed when it is first seen. A process that lives and dies between
    two samples is missed; one that ends or leaves the tree (an orphan, reparented) counts up to its
    last sample in it. The sampler's own CPU (this process's) is `self_cpu_s`: it shares the machine
    with what it measures."""

    def __init__(self, root_pid: int, interval_s: float = 0.05):
        import psutil

        self.root, self.interval_s = psutil.Process(root_pid), interval_s
        self.roles: dict[int, str] = {}
        self.samples: list[tuple[float, dict[int, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-cpu", daemon=True)
        self._cpu0 = time.process_time()
        self.self_cpu_s = 0.0

    def start(self) -> TreeCPU:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.self_cpu_s = time.process_time() - self._cpu0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        import psutil

        now, cpu, parent = time.time(), {}, {}
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:  # the job has exited
            return
        for p in procs:
            try:
                with p.oneshot():
                    t, parent[p.pid] = p.cpu_times(), p.ppid()
            except psutil.Error:
                continue  # gone since the listing
            cpu[p.pid] = t.user + t.system
        for pid in cpu:
            if pid not in self.roles:
                depth, q = 0, pid
                while q != self.root.pid and q in parent and depth < 8:
                    q, depth = parent[q], depth + 1
                self.roles[pid] = ROLES[min(depth, len(ROLES) - 1)]
        self.samples.append((now, cpu))

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each role used between times t0 and t1: per process, its last sample up to t1
        minus its last sample up to t0 (0 for a process that started after t0)."""
        before: dict[int, float] = {}
        last: dict[int, float] = {}
        for t, cpu in self.samples:
            if t <= t0:
                before = cpu
            elif t <= t1:
                last.update(cpu)
        out = dict.fromkeys(ROLES, 0.0)
        for pid, c in last.items():
            out[self.roles[pid]] += max(0.0, c - before.get(pid, 0.0))
        return out
