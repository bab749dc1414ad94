"""Code is part of what a run is: which code trains it, recorded in every commit.

`code_record` digests the goodput package and its Hydra plugins (every `.py` file) and conf/ (every
file), as they are on disk when the job starts (what it imports and composes), with the git commit
and whether the tree had changes. goodput.run.job compares it with the record of the commit a launch
would continue: other code is refused, naming the files that changed, unless
`run.allow_code_change=true` says to continue on purpose. So the edit-rerun loop never mixes two
programs in one run without a word, while a relaunch by the same code continues as before.

Out of scope, said in docs/recipe.md: code outside these trees (a module of your own named by a
`_target_` lives in them when it is in goodput/recipe/), and installed libraries (torch's version is
in the MLflow run's tags).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import goodput

PACKAGE = Path(goodput.__file__).resolve().parent
TREES = {"goodput": PACKAGE, "hydra_plugins": PACKAGE.parent / "hydra_plugins"}
CONF = PACKAGE.parent.parent / "conf"  # the repository's (a clone: src/goodput, conf/)
_SKIP = {"__pycache__"}


def _files(root: Path, suffix: str | None) -> list[Path]:
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(n for n in dirs if n not in _SKIP and not n.startswith("."))
        out += [Path(d) / n for n in sorted(names) if (suffix is None or n.endswith(suffix)) and n[0] != "."]
    return out


def code_record(conf_dir: str | os.PathLike | None = None) -> dict:
    """{"digest": 16 hex digits over every file, "files": {path: 12 hex digits}, "git": {"commit":
    ..., "dirty": bool} or None}. Paths are `goodput/...`, `hydra_plugins/...`, `conf/...`."""
    trees = [(name, root, ".py") for name, root in TREES.items() if root.is_dir()]
    conf = Path(conf_dir) if conf_dir is not None else CONF
    if conf.is_dir():
        trees.append(("conf", conf, None))
    files = {}
    for name, root, suffix in trees:
        for f in _files(root, suffix):
            files[f"{name}/{f.relative_to(root).as_posix()}"] = hashlib.sha256(f.read_bytes()).hexdigest()[
                :12
            ]
    total = hashlib.sha256("\n".join(f"{k} {v}" for k, v in sorted(files.items())).encode()).hexdigest()
    return {"digest": total[:16], "files": files, "git": git_state(PACKAGE)}


def git_state(where: Path) -> dict | None:
    """The commit checked out where the code lives and whether tracked files differ from it (None:
    not a git checkout, or no git)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where, capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def git_diff(where: Path = PACKAGE) -> str | None:
    """`git diff HEAD` of the checkout (the uncommitted edits a run trained with), or None."""
    try:
        out = subprocess.run(["git", "diff", "HEAD"], cwd=where, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def changed(old: object, new: dict) -> list[str] | None:
    """The files whose digest differs between a commit's code record `old` and `new` (added and
    removed ones too), or None when `old` is not a code record (written before commits had one).
    [] when the code is the same."""
    if not (
        isinstance(old, dict) and isinstance(old.get("digest"), str) and isinstance(old.get("files"), dict)
    ):
        return None
    if old["digest"] == new["digest"]:
        return []
    a, b = old["files"], new["files"]
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)) or ["(the digest)"]
