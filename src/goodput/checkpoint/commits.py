"""A read-only view of a run's committed checkpoints: list, check, verify, resolve a resume path.

It needs only the Storage of `checkpoint.dir` (no backend, no staging dir, no process group): the
job process checks the commits with it before any worker starts, and CheckpointManager lists and
verifies through it, so the rules are the same in both places. The layout is in `layout.py`.
"""

from __future__ import annotations

import logging
import os

from goodput.checkpoint.layout import COMMIT, CommitError, newest_first, parse_commit, parse_step, step_dir
from goodput.storage import CHECKSUM, DIR, FOREIGN, Storage, each, file_digest
from goodput.untrusted import regular

log = logging.getLogger(__name__)


class Commits:
    """The committed checkpoints in `storage`. `kept`: the node-local staging dir where the newest
    saves stay (read, never created or written): verifying reads those copies instead of the remote."""

    def __init__(self, storage: Storage, kept: str | None = None):
        self.storage, self.kept = storage, kept

    def committed(self, listing: dict[str, int] | None = None) -> list[dict]:
        """Committed checkpoints, newest first (by the parsed step, not the name; of one step the
        regular save before its rescue, layout.newest_first). Cheap checks only:
        COMMIT.json parses and every listed file exists with its size. Loading is the real test (see
        CheckpointManager.restore). An entry that is not a step dir in the one form `step_dir` writes
        (another spelling, a link, a file) is ignored with a warning naming it: it never decides what
        is loaded. `listing`: the root's `ls()`, when the caller has it already."""
        listing = self.storage.ls() if listing is None else listing
        steps = []
        for name, size in listing.items():
            step = parse_step(name)
            if step is not None and size == DIR:
                steps.append((step, name))
            elif step is not None or (name.startswith("step-") and ".superseded-" not in name):
                log.warning(
                    "ignoring %s: not a step directory (%s)", self.storage.url(name),
                    "a symbolic link or special file" if size == FOREIGN else
                    "a file" if step is not None else f"not named {step_dir(0)[:5]}<9 digits>",
                )  # fmt: skip
        recs = each(self.read_commit, newest_first(name for _, name in steps))  # two round trips each
        return [rec for rec in recs if rec is not None]

    def read_commit(self, rel: str) -> dict | None:
        """The checked commit record of step dir `rel`, or None (with a warning naming why)."""
        try:
            rec = parse_commit(self.storage.read_bytes(f"{rel}/{COMMIT}"), rel)
            present = self.storage.ls(rel)
        except FileNotFoundError:
            return None
        except CommitError as e:
            log.warning("skipping %s: %s", self.storage.url(f"{rel}/{COMMIT}"), e)
            return None
        foreign = [f for f in rec["files"] if present.get(f) == FOREIGN]
        if foreign:
            log.warning(
                "skipping %s: links or special files, never read: %s", self.storage.url(rel), foreign[:5]
            )
            return None
        bad = [f for f, m in rec["files"].items() if present.get(f) != m["bytes"]]
        if bad:
            log.warning("skipping %s: files missing or of the wrong size: %s", self.storage.url(rel), bad[:5])
            return None
        return rec

    def verify(self, rec: dict, local: bool = True) -> str | None:
        """None when every file of commit `rec` has its recorded size and checksum, else what is
        wrong, naming the file. Reads the node-local copy of that save where `kept` holds it (a
        local read; not with `local=False`), else streams the remote file through its checksum."""
        for name, want in rec["files"].items():
            try:
                if not local or self.kept is None:
                    raise FileNotFoundError(name)
                got = file_digest(regular(os.path.join(self.kept, rec["dir"], name), "staging"))
                if got.size == want["bytes"] and got.digest == want[CHECKSUM]:
                    continue
            except (OSError, ValueError):
                pass
            url = self.storage.url(f"{rec['dir']}/{name}")
            try:
                got = self.storage.digest(f"{rec['dir']}/{name}", limit=want["bytes"])
            except Exception as e:
                return f"{url}: unreadable ({e})"
            if got.size != want["bytes"] or got.digest != want[CHECKSUM]:
                return (
                    f"{url}: {got.size} bytes with {CHECKSUM} {got.digest}, the commit records "
                    f"{want['bytes']} bytes with {want[CHECKSUM]}"
                )
        return None

    def newest_verified(self, committed: list[dict]) -> dict | None:
        """The newest of `committed` whose bytes verify (`verify`); each one skipped is a warning."""
        for rec in committed:
            why = self.verify(rec)
            if why is None:
                return rec
            log.warning("not trusting %s: %s", self.storage.url(rec["dir"]), why)
        return None

    def resolve(self, resume: str) -> dict:
        """`run.resume=<path>`: the commit record of that step dir, which must be a committed step
        dir of this storage's root (checkpoint.dir), given by its path there or by its name alone."""
        ckpt_dir = self.storage.root
        parent, name = os.path.split(resume.rstrip("/"))
        if parent and os.path.normpath(parent) != os.path.normpath(ckpt_dir):
            raise FileNotFoundError(f"run.resume={resume}: not a step dir of checkpoint.dir={ckpt_dir}")
        rec = self.read_commit(name)
        if rec is None:
            raise FileNotFoundError(
                f"run.resume={resume}: not a committed checkpoint in checkpoint.dir={ckpt_dir}"
            )
        return rec
