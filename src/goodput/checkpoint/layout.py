"""The checkpoint directory layout, in one place (the manager, the scripts and the tests use it).

Under `checkpoint.dir` (a path or fsspec URL):
    step-000000120/             one fresh directory per save
        __0_0.distcp ...        DCP shards (or state.pt for torch_save)
        .metadata               DCP's own marker, uploaded after every shard
        ranks/<r>.json          rank r's manifest: its files, sizes and checksums, written after its upload
        COMMIT.json             written last by rank 0 once every manifest is there
    step-000000073.rescue/      a rescue (goodput.checkpoint.rescue): the state of step 73 written by the
        __<s>_<i>.distcp ...    ranks that survived a failure, without a collective; each shard s by
        rescue-<s>.metadata     the one rank that claimed it (claims/<s>.json, an exclusive create),
        ranks/rescue-<s>.json   its manifest; .metadata (merged) and COMMIT.json (kind: rescue),
        .metadata, COMMIT.json  written by the rank that found every shard there
    step-000000080.superseded-<time>/   an abandoned lineage, moved aside (never loaded, never deleted)
    attempts/NNNN.json          one record per start of the run (restarts, lost steps)
    LOCK.json                   the job holding the run

A step directory is loadable only if COMMIT.json parses and passes `parse_commit`, and every file it
lists downloads with its recorded size and checksum. Everything in COMMIT.json is treated as
untrusted input: names are checked before they become local paths.
"""

from __future__ import annotations

import json
import math
import os
import re

from goodput.storage.checksum import CHECKSUM
from goodput.untrusted import RecordError, parse_record

COMMIT = "COMMIT.json"
RANKS = "ranks"
FORMATS = ("dcp", "torch_save")  # what a backend writes; dcp_sync and dcp_async share "dcp"

# A file of a checkpoint is a plain name inside its step dir: no separators, no "..", nothing hidden
# but DCP's `.metadata`. Anything else in a commit record is refused before it becomes a path.
_FILE = re.compile(r"^(\.metadata|[A-Za-z0-9_][A-Za-z0-9_.-]{0,200})$")
_DIGEST = re.compile(r"^[0-9a-f]{32}$")


class CommitError(RecordError):
    """A commit record that is missing, malformed or inconsistent: the checkpoint is not loadable."""


RESCUE = ".rescue"  # a rescue's step dir: step_dir(step) + RESCUE
KINDS = ("regular", "rescue")  # what a commit record's `kind` may be (absent: regular)


def step_dir(step: int, rescue: bool = False) -> str:
    return f"step-{step:09d}{RESCUE if rescue else ''}"


# ASCII digits only: str.isdigit() accepts digits int() refuses
_STEP = re.compile(r"step-([0-9]{9,})(" + re.escape(RESCUE) + ")?")


def parse_step(name: str) -> int | None:
    """The step of a step dir's name (a regular save's or a rescue's), or None. One spelling per
    step, the one `step_dir` writes (9 digits, more only past 999999999): `step-0000000120` or
    `step-١٢٠` is not step 120, so a copy of an old step under another spelling can never pass for
    a newer one."""
    m = _STEP.fullmatch(name)
    if m is None or step_dir(int(m.group(1)), m.group(2) is not None) != name:
        return None
    return int(m.group(1))


def is_rescue(name: str) -> bool:
    return parse_step(name) is not None and name.endswith(RESCUE)


def newest_first(names) -> list[str]:
    """Step dir names, newest first: by step, and of one step the regular save before its rescue
    (both hold the same state; the regular one was written by every rank)."""
    return sorted(names, key=lambda n: (parse_step(n), not is_rescue(n)), reverse=True)


def local_commits(ckpt_dir) -> list[tuple[int, str]]:
    """(step, path) of each step dir with a COMMIT.json under a local `ckpt_dir`, oldest first. For
    scripts and tests looking at a finished run; it does not check the record (parse_commit does)."""
    out = []
    for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []:
        step, path = parse_step(name), os.path.join(ckpt_dir, name)
        if step is not None and not os.path.islink(path) and os.path.isfile(os.path.join(path, COMMIT)):
            out.append((step, os.path.join(ckpt_dir, name)))
    return sorted(out)


def check_file_name(name: object) -> str:
    if not isinstance(name, str) or not _FILE.match(name) or ".." in name:
        raise CommitError(f"file name {name!r} is not a plain file name")
    return name


def check_files(files: object, allow_empty: bool = False) -> dict[str, dict]:
    """{name: {"bytes": int, "xxh3_128": hex}} with every part checked."""
    if not isinstance(files, dict) or not (files or allow_empty):
        raise CommitError("no file list")
    out = {}
    for name, entry in files.items():
        check_file_name(name)
        if not isinstance(entry, dict):
            raise CommitError(f"{name}: no size and checksum (written by an older version without checksums)")
        size, digest = entry.get("bytes"), entry.get(CHECKSUM)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CommitError(f"{name}: bad size {size!r}")
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            raise CommitError(f"{name}: bad {CHECKSUM} checksum {digest!r}")
        out[name] = {"bytes": size, CHECKSUM: digest}
    return out


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:  # JSON's numbers (NaN included: json writes it for a nan metric)
    return isinstance(v, int | float) and not isinstance(v, bool)


def parse_commit(data: bytes, rel: str) -> dict:
    """Parse and check the COMMIT.json of step dir `rel`. Raises CommitError saying what is wrong."""
    try:
        rec = parse_record(data, COMMIT)
    except RecordError as e:
        raise CommitError(str(e)) from None
    step = rec.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step != parse_step(rel.rsplit("/", 1)[-1]):
        raise CommitError(f"step {step!r} does not match the directory {rel}")
    if rec.get("format") not in FORMATS:
        raise CommitError(f"unknown checkpoint format {rec.get('format')!r}")
    world = rec.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CommitError(f"bad world_size {world!r}")
    if rec.get("checksum") != CHECKSUM:
        raise CommitError(f"checksum algorithm {rec.get('checksum')!r}, expected {CHECKSUM}")
    best = rec.get("best")  # checkpoint.keep_best_by: retention keeps the step it names
    if best is not None and not (
        isinstance(best, dict) and _int(best.get("step")) and isinstance(best.get("by"), str)
        and best.get("mode") in ("max", "min") and _number(best.get("value"))
    ):  # fmt: skip
        raise CommitError(f"bad best record {best!r}")
    parts = rec.get("parts")  # AppState's global parts (a restore leaves out an optional one not here)
    if parts is not None and not (isinstance(parts, list) and all(isinstance(x, str) for x in parts)):
        raise CommitError(f"bad parts list {parts!r}")
    metric = rec.get("metric")  # this step's evaluation of the monitored metric (printed by inspect)
    if metric is not None and not (
        isinstance(metric, dict) and all(isinstance(k, str) and _number(v) for k, v in metric.items())
    ):
        raise CommitError(f"bad metric record {metric!r}")
    when = rec.get("time", 0.0)  # when the state was saved: a restart counts the stalls after it
    if not (_number(when) and math.isfinite(when)):
        raise CommitError(f"bad time {when!r}")
    if not isinstance(rec.get("stop_reason"), str | None):
        raise CommitError(f"bad stop_reason {rec.get('stop_reason')!r}")
    kind = rec.get("kind", "regular")
    if kind not in KINDS or (kind == "rescue") != is_rescue(rel.rsplit("/", 1)[-1]):
        raise CommitError(f"kind {kind!r} does not match the directory {rel}")
    if kind == "rescue":  # who wrote it: printed by inspect, counted in the summary
        by = rec.get("rescued_by")
        if not (isinstance(by, list) and by and all(_int(r) and 0 <= r < world for r in by)):
            raise CommitError(f"bad rescued_by {by!r} (the ranks that wrote it, each < world_size {world})")
        if not isinstance(rec.get("evaluate_first", False), bool):
            raise CommitError(
                f"bad evaluate_first {rec['evaluate_first']!r} (true: the step's evaluation is due)"
            )
        over = rec.get("regular_step", 0)
        if not (_int(over) and 0 <= over < step):
            raise CommitError(f"bad regular_step {over!r} (the newest regular commit before step {step})")
    ident = rec.get("identity")  # goodput.identity.record: compared with a relaunch's, printed in its refusal
    if ident is not None and not (
        isinstance(ident, dict)
        and isinstance(ident.get("digest"), str)
        and isinstance(ident.get("keys"), dict)
    ):
        raise CommitError(f"bad identity record {ident!r:.200}")
    if rec.get("max_steps") is not None and not (_int(rec["max_steps"]) and rec["max_steps"] > 0):
        raise CommitError(f"bad max_steps {rec['max_steps']!r}")
    # read by inspect_checkpoint.py, evaluate.py and predict.py (eval_on: which weights by default),
    # the relaunch (run, mlflow_run_id: whether to continue its MLflow run)
    for key in ("backend", "run", "mlflow_run_id"):
        if not isinstance(rec.get(key), str | None):
            raise CommitError(f"bad {key} {rec[key]!r:.200}")
    if rec.get("eval_on") not in (None, "model", "ema"):
        raise CommitError(f"bad eval_on {rec['eval_on']!r:.200} (model or ema)")
    if rec.get("bytes") is not None and not (_int(rec["bytes"]) and rec["bytes"] >= 0):
        raise CommitError(f"bad bytes {rec['bytes']!r:.200}")
    rec["files"] = check_files(rec.get("files"))
    rec["dir"] = rel
    return rec


def commit_record(step: int, backend, world: int, files: dict[str, dict], info: dict) -> bytes:
    """`backend`: what wrote the files (its `name` and `format`)."""
    record = {
        **info,
        "step": step,
        "backend": backend.name,
        "format": backend.format,
        "world_size": world,
        "files": files,
        "bytes": sum(f["bytes"] for f in files.values()),
        "checksum": CHECKSUM,
    }
    return json.dumps(record, indent=1, sort_keys=True).encode()


def manifest(files: dict[str, dict]) -> bytes:
    return json.dumps({"files": files}).encode()


def parse_manifest(data: bytes, rank: int) -> dict[str, dict]:
    what = f"{RANKS}/{rank}.json"
    try:
        return check_files(parse_record(data, what).get("files"), allow_empty=True)
    except CommitError as e:
        raise CommitError(f"{what}: {e}") from None
    except RecordError as e:
        raise CommitError(str(e)) from None
