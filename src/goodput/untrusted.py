"""Input the code did not write itself: paths that come from data, and the small records in a store.

Whoever can write to the dataset or the checkpoint store controls these (see docs/security.md), so
each is checked by one rule before it is used:

- `safe_rel`: a path from data (a manifest row, a listed key, a shard index entry, a commit record)
  is a plain relative path: normalised, no `..`, not absolute, no drive, `~`, URL, backslash or NUL.
  `os.path.join(cache, "/abs/path")` is `/abs/path`; this is what stops it.
- `confined`: the local file of such a path under its root, resolved: no symbolic link below the
  root (a link in a store can point anywhere, also at another run's committed checkpoint).
- `regular`: a local file about to be read is a regular file (a FIFO blocks a reader forever).
- `printable`: a string from a record (or a name from a store), escaped for a terminal: a `\r` or
  an escape sequence in it cannot rewrite the line it is printed on.
- `parse_record`: a JSON record (commit, rank manifest, lock, attempt, fault marker, shard index)
  parsed as untrusted: any parser exception (RecursionError from deep nesting too) or a wrong
  top-level type is a `RecordError` naming the file; `field` checks one key's type and range;
  `set_aside` moves a malformed record out of the way, kept and named in a warning.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
import time

from goodput.errors import UserError

log = logging.getLogger(__name__)

_DRIVE = re.compile(r"^[A-Za-z]:")


class UnsafePath(UserError, ValueError):
    """A path from data that could reach outside its root; the message names where it came from."""


class RecordError(UserError, ValueError):
    """A record that does not parse or has a field of the wrong type or range; names the file."""


def why_unsafe(rel: object) -> str | None:
    """Why `rel` is not a plain relative path, or None when it is."""
    if not isinstance(rel, str):
        return f"is a {type(rel).__name__}, not a string"
    if not rel:
        return "is empty"
    if "\x00" in rel:
        return "contains a NUL byte"
    if "\\" in rel:
        return "contains a backslash"
    if rel.startswith("/"):
        return "is absolute"
    if rel.startswith("~"):
        return "starts with ~"
    if _DRIVE.match(rel):
        return "names a drive"
    if "://" in rel:
        return "is a URL"
    parts = rel.split("/")
    if ".." in parts:
        return "climbs out of its root with '..'"
    if any(p in ("", ".") for p in parts):
        return "is not normalised (empty or '.' component)"
    return None


def safe_rel(rel: object, what: str) -> str:
    """`rel` itself when it is a plain relative path (see `why_unsafe`); else UnsafePath naming `what`
    (the file and row or entry it came from)."""
    why = why_unsafe(rel)
    if why is not None:
        raise UnsafePath(f"{what}: path {rel!r} {why}; refused (paths from data must stay under their root)")
    return rel  # type: ignore[return-value]


def real_root(root: str) -> str:
    """The resolved local directory `root` (its own symlinks, set up by whoever configured it, are fine)."""
    return os.path.realpath(root)


def confined(root: str, rel: str, what: str, resolved: bool = False) -> str:
    """The local path of `rel` under the local directory `root`, checked: `rel` passes `safe_rel` and
    no component below the root is a symbolic link, so the path cannot lead outside the root (nor
    anywhere else inside it). `resolved`: `root` is already `real_root(root)` (saves the lookups)."""
    safe_rel(rel, what)
    base = root if resolved else real_root(root)
    path = os.path.join(base, *rel.split("/"))
    if os.path.realpath(path) != path:
        raise UnsafePath(f"{what}: {rel!r} goes through a symbolic link under {root}; refused")
    return path


def regular(path: str, what: str) -> str:
    """`path` when it is a regular file (FileNotFoundError when missing); a directory, FIFO, socket or
    device is refused: reading one blocks or returns what the file never held."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in _KINDS if test(mode)), "a special file")
        raise UnsafePath(f"{what}: {path} is not a regular file ({kind}); refused")
    return path


_KINDS = [(stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")]  # fmt: skip


def printable(value: object) -> str:
    """`str(value)` with every character that is not printable (control characters such as `\r`,
    `\n` and ESC, line separators, bidi overrides) escaped as Python writes it (`\r`, `\x1b`,
    `\u202e`): one line that shows what the record holds, never a terminal instruction. What a
    record says is printed through this, as identity values are printed as JSON
    (goodput.identity.describe). Printable text, accents and other scripts included, stays as is."""
    s = str(value)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)


def parse_record(data: bytes | str, what: str, kind: type = dict):
    """The JSON value of a record, checked to be a `kind` (dict by default). Anything the parser
    raises (bad UTF-8, bad JSON, RecursionError from deep nesting, huge integers) is a RecordError
    naming `what`."""
    try:
        rec = json.loads(data)
    except Exception as e:  # RecursionError is not a ValueError; none of them may escape as a crash
        raise RecordError(f"{what}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(rec, kind):
        raise RecordError(f"{what}: expected a JSON {kind.__name__}, got {type(rec).__name__}")
    return rec


_MISSING = object()


def field(rec: dict, key: str, kind, what: str, default=_MISSING, minimum=None):
    """`rec[key]`, checked to be of `kind` (a type or tuple; bool is never an int here, a float is
    finite) and >= `minimum`.
    Missing: `default` if given, else RecordError naming `what` and the key."""
    if key not in rec:
        if default is _MISSING:
            raise RecordError(f"{what}: no {key!r}")
        return default
    v = rec[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(v, bool) and bool not in kinds) or not isinstance(v, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise RecordError(f"{what}: {key!r} is {v!r}, expected {names}")
    if isinstance(v, float) and not math.isfinite(v):  # NaN passes every comparison below, then poisons sums
        raise RecordError(f"{what}: {key!r} is {v!r}, expected a finite number")
    if minimum is not None and v < minimum:
        raise RecordError(f"{what}: {key!r} is {v!r}, expected >= {minimum}")
    return v


def set_aside(storage, rel: str, error: Exception) -> None:
    """Move the malformed record `rel` of `storage` (a goodput.storage.Storage) to
    `<rel>.malformed-<time>`, with a warning naming the error and where it went: kept for a look, no
    longer read (the next start does not trip on it again). A store that cannot move it: warned."""
    aside = f"{rel}.malformed-{int(time.time())}"
    log.warning("%s; moving it to %s", error, storage.url(aside))
    try:
        storage.mv(rel, aside)
    except Exception as e:
        log.warning("could not move %s aside: %s", storage.url(rel), e)
