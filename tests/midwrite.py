"""A SIGKILL that lands inside a cache fill's write, for the killed-fill drills.

A fill of a small file takes microseconds: a kill sent after a sleep nearly always lands before or
after the write, so a non-atomic fill passed such drills 25 times in 26. Here the child process runs
the fill with every file it opens for writing under the cache wrapped: the first write puts half of
the bytes on disk, flushes them, tells the parent, and blocks. The parent then SIGKILLs it: the kill
is inside the write by construction, whatever file name the fill writes to (temp or final).
"""

from __future__ import annotations

import builtins
import multiprocessing as mp
import os
import re
import signal
import time

from goodput.data.loader import frozen_for_fork


class _HalfThenBlock:
    def __init__(self, f, ready: str):
        self._f, self._ready = f, ready

    def write(self, data):
        view = memoryview(data).cast("B") if not isinstance(data, str) else data
        self._f.write(view[: len(view) // 2])
        self._f.flush()
        os.close(os.open(self._ready, os.O_WRONLY | os.O_CREAT))  # "half written"
        time.sleep(3600)  # the parent kills us here

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _child(fill, under: str, ready: str, where: str) -> None:
    real_open, real_fdopen = builtins.open, os.fdopen

    def wrap(f, path, mode):
        writing = any(c in str(mode) for c in "wax+")
        # an atomic_file temp name by its final name
        path = re.sub(r"/\.part-[0-9a-f]+-(.+)\.tmp$", r"/\1", os.path.realpath(path))
        return _HalfThenBlock(f, ready) if writing and path.startswith(under) and where in path else f

    builtins.open = lambda file, mode="r", *a, **kw: wrap(real_open(file, mode, *a, **kw), file, mode)
    os.fdopen = lambda fd, mode="r", *a, **kw: wrap(
        real_fdopen(fd, mode, *a, **kw), os.readlink(f"/proc/self/fd/{fd}"), mode
    )
    fill()


def kill_inside_the_write(fill, cache_dir: str, timeout: float = 60.0, where: str = "") -> None:
    """Run `fill()` in a forked child, SIGKILL it once it has half-written a file under `cache_dir`
    (the first whose path, a temp file's by its final name, contains `where`).
    Fails (AssertionError) if the fill never wrote there: the drill did not exercise the fill."""
    ready = os.path.join(os.path.dirname(os.path.realpath(cache_dir)), f".midwrite-{os.getpid()}")
    if os.path.exists(ready):
        os.unlink(ready)
    p = mp.get_context("fork").Process(target=_child, args=(fill, os.path.realpath(cache_dir), ready, where))
    with frozen_for_fork():  # forked as DataLoader workers are
        p.start()
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready) and p.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    wrote = os.path.exists(ready)
    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
    p.join()
    if wrote:
        os.unlink(ready)
    assert wrote, f"the fill never wrote {where!r} under {cache_dir} (exit code {p.exitcode})"
