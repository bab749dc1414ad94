"""Loading a checkpoint never runs code, and never uses a byte that differs from what was committed.

The attacker here can write to the checkpoint store: every tampered checkpoint below has its commit
record re-signed (sizes and checksums recomputed), so only the load-side defences stand in the way.
Each payload, if it ran, would create a marker file; each test asserts it did not, and that restore
fell back to the previous commit with a reason naming the file.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import pickletools
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_app, manager

from goodput.checkpoint.backends import SafeFileSystemReader, load_metadata
from goodput.checkpoint.layout import COMMIT, CommitError, parse_commit, parse_manifest
from goodput.storage.checksum import CHECKSUM, file_digest


def resign(step: os.PathLike) -> None:
    """What an attacker with write access does after tampering: make the commit record consistent."""
    path = Path(step, COMMIT)
    rec = json.loads(path.read_text())
    for name in rec["files"]:
        t = file_digest(os.path.join(step, name))
        rec["files"][name] = {"bytes": t.size, CHECKSUM: t.digest}
    path.write_text(json.dumps(rec))


def two_commits(tmp_path, backend: str, dist1):  # noqa: F811
    """Commits of step 1 (good) and step 2 (to be tampered with); returns (manager, step-2 dir)."""
    mgr = manager(tmp_path, backend, dist1)
    app, *_ = make_app(1)
    mgr.save(1, app)
    app.model.head.weight.data.add_(1.0)
    mgr.save(2, app)
    mgr.wait()
    return mgr, tmp_path / "remote" / "step-000000002"


def drop_local_copies(tmp_path) -> None:
    """Staging keeps the newest save for local-first restore; remove it to test the remote path."""
    for p in (tmp_path / "staging").glob("step-*"):
        shutil.rmtree(p)


def restore_expecting_fallback(mgr, marker, file_hint: str) -> None:
    target, *_ = make_app(7)
    rec, skipped = mgr.restore(target, mgr.committed())
    assert not marker.exists(), "the payload ran"
    assert rec is not None and rec["step"] == 1, skipped
    assert len(skipped) == 1 and "step-000000002" in skipped[0] and file_hint in skipped[0], skipped


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# -- hand-made pickles: the opcodes an attacker has, not just the obvious __reduce__ ----------------
def _str(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def stack_global(module: str, name: str, cmd: str, proto: int = 4) -> bytes:
    # PROTO 4, module, name, STACK_GLOBAL, (cmd,), REDUCE, STOP
    return bytes([0x80, proto]) + _str(module) + _str(name) + b"\x93" + _str(cmd) + b"\x85R."


def global_opcode(module: str, name: str, cmd: str) -> bytes:
    # protocol 0/1 GLOBAL with a text "module\nname\n"
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n" + b"(V" + cmd.encode() + b"\ntR."


def inst_opcode(module: str, name: str, cmd: str) -> bytes:
    return b"(V" + cmd.encode() + b"\ni" + module.encode() + b"\n" + name.encode() + b"\n."


def obj_opcode(module: str, name: str, cmd: str) -> bytes:
    return b"\x80\x02(" + b"c" + module.encode() + b"\n" + name.encode() + b"\n" + _str(cmd) + b"o."


def persistent_id(cmd: str) -> bytes:
    return b"\x80\x04" + _str(cmd) + b"Q."


def ext_opcode() -> bytes:
    return b"\x80\x02\x82\x01."  # EXT1 code 1: whatever the registry holds


def build_payloads(marker) -> dict[str, bytes]:
    """Payloads that run a command under plain `pickle.loads` (test_payloads_are_real shows each one
    does): refusing these is what the defence is counted by."""
    cmd = f"touch {marker}"
    dcp_fs = "torch.distributed.checkpoint.filesystem"
    return {
        "reduce": pickle.dumps(Payload(marker)),
        "allowed-module-other-name": stack_global(dcp_fs, "os.system", cmd),  # the bypass
        "builtins-eval": stack_global("builtins", "eval", f"__import__('os').system('{cmd}')"),
        "protocol-0-global": global_opcode("os", "system", cmd),
        "global-opcode-dotted-in-allowed-module": b"\x80\x04" + global_opcode(dcp_fs, "os.system", cmd),
        "inst": inst_opcode("os", "system", cmd),
        "obj": obj_opcode("subprocess", "getoutput", cmd),
        "protocol-2-reduce": pickle.dumps(Payload(marker), protocol=2),
    }


def build_oddities(marker) -> dict[str, bytes]:
    """Hostile-looking pickles that do nothing under plain `pickle.loads` (they need a loader's
    persistent_load, an extension registry or a callable at the dotted name): refused too, but not
    counted as payloads that would have run."""
    cmd = f"touch {marker}"
    return {
        "dotted-name-from-allowed-class": stack_global(
            "torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__", cmd
        ),
        "persistent-id": persistent_id(cmd),
        "extension-code": ext_opcode(),
        "torch-getattr": stack_global("torch", "__builtins__", cmd),
    }


def test_payloads_are_real(tmp_path):
    """Negative control: every counted payload does run when unpickled normally (so refusing it means
    something), and none of the oddities does (so they are not counted)."""
    marker = tmp_path / "ran"
    for name, data in {**build_payloads(marker), **build_oddities(marker)}.items():
        try:
            pickle.loads(data)
        except Exception:
            pass
        assert marker.exists() == (name in build_payloads(marker)), name
        marker.unlink(missing_ok=True)
    assert len(build_payloads(marker)) == 8  # the count docs/security.md gives
    pickletools.dis(build_payloads(tmp_path / "m")["allowed-module-other-name"])  # a well-formed pickle


@pytest.mark.parametrize("payload", sorted(build_payloads("x")) + sorted(build_oddities("x")))
def test_malicious_metadata_never_runs(tmp_path, dist1, payload):  # noqa: F811
    mgr, step2 = two_commits(tmp_path, "dcp_sync", dist1)
    marker = tmp_path / "pwned"
    (step2 / ".metadata").write_bytes({**build_payloads(marker), **build_oddities(marker)}[payload])
    resign(step2)
    restore_expecting_fallback(mgr, marker, ".metadata")


def test_metadata_allow_list_is_exact():
    from goodput.checkpoint.backends import _ALLOWED

    assert all("." not in name for _, name in _ALLOWED)
    assert ("torch.distributed.checkpoint.filesystem", "os") not in _ALLOWED
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        load_metadata(stack_global("torch.distributed.checkpoint.metadata", "os", "x"))


def _dcp_with_entry(tmp_path, dist1, entry_value):  # noqa: F811
    """A DCP checkpoint (through the manager) whose `extra.param_groups` is replaced by `entry_value`."""
    import torch.distributed.checkpoint as dcp

    mgr, step2 = two_commits(tmp_path, "dcp_sync", dist1)
    reader = SafeFileSystemReader(str(step2))
    md = reader.read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    for f in os.listdir(step2):
        if f.endswith(".distcp") or f == ".metadata":
            os.remove(step2 / f)
    sd["extra.param_groups"] = entry_value
    dcp.save(sd, checkpoint_id=str(step2), no_dist=True)
    rec = json.loads((step2 / COMMIT).read_text())
    rec["files"] = {f: {} for f in os.listdir(step2) if f.endswith(".distcp") or f == ".metadata"}
    (step2 / COMMIT).write_text(json.dumps(rec))
    resign(step2)
    return mgr


def test_byte_io_entry_is_never_unpickled(tmp_path, dist1):  # noqa: F811
    """The issue's first payload: a non-tensor (BYTE_IO) entry that DCP's planner would read with
    torch.load(weights_only=False). Here it sits exactly where a tensor entry is expected."""
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    mgr = _dcp_with_entry(tmp_path, dist1, io.BytesIO(buf.getvalue()))
    restore_expecting_fallback(mgr, marker, "extra.param_groups")


def test_reader_refuses_byte_io_items_outright(tmp_path, dist1):  # noqa: F811
    """Defence in depth: even a plan that asks for a BYTE_IO item is refused before any read."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    d = tmp_path / "ckpt"
    dcp.save({"x": io.BytesIO(buf.getvalue()), "t": torch.ones(2)}, checkpoint_id=str(d), no_dist=True)
    with pytest.raises(BaseException, match="not a tensor: refusing to unpickle"):  # CheckpointException
        dcp.load({"x": io.BytesIO(), "t": torch.zeros(2)}, storage_reader=SafeFileSystemReader(str(d)),
                 no_dist=True)  # fmt: skip
    assert not marker.exists()


def test_tensor_bytes_replaced_by_a_pickle_never_run(tmp_path, dist1):  # noqa: F811
    """Tensor entries are read with torch.load(weights_only=True): a payload in the shard is refused."""
    mgr, step2 = two_commits(tmp_path, "dcp_sync", dist1)
    marker = tmp_path / "pwned"
    shard = next(p for p in step2.iterdir() if p.suffix == ".distcp")
    md = SafeFileSystemReader(str(step2)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn.startswith("model."))
    evil = io.BytesIO()
    torch.save(Payload(marker), evil)
    data = bytearray(shard.read_bytes())
    blob = evil.getvalue()[: info.length].ljust(info.length, b"\0")
    data[info.offset : info.offset + info.length] = blob
    shard.write_bytes(bytes(data))
    resign(step2)
    restore_expecting_fallback(mgr, marker, ".distcp")


def test_torch_save_file_with_payload(tmp_path, dist1):  # noqa: F811
    mgr, step2 = two_commits(tmp_path, "torch_save", dist1)
    marker = tmp_path / "pwned"
    obj = torch.load(step2 / "state.pt", weights_only=True)
    obj["model"]["head.weight"] = Payload(marker)
    torch.save(obj, step2 / "state.pt")
    resign(step2)
    restore_expecting_fallback(mgr, marker, "state.pt")


def test_metadata_pointing_outside_the_checkpoint(tmp_path, dist1):  # noqa: F811
    mgr, step2 = two_commits(tmp_path, "dcp_sync", dist1)
    md = pickle.loads((step2 / ".metadata").read_bytes())  # our own file: plain pickle is fine here
    for info in md.storage_data.values():
        info.relative_path = "../../../../etc/passwd"
    (step2 / ".metadata").write_bytes(pickle.dumps(md))
    resign(step2)
    restore_expecting_fallback(mgr, tmp_path / "nothing", "outside the checkpoint")


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: r["files"].update({"../../escaped": r["files"].pop(next(iter(r["files"])))}),
        lambda r: r["files"].update({"/tmp/abs": {"bytes": 1, CHECKSUM: "0" * 32}}),
        lambda r: r.update(files=["a list"]),
        lambda r: r.update(step=999),
        lambda r: r.update(format="pickle"),
        lambda r: r["files"][next(iter(r["files"]))].update(bytes="12"),
        lambda r: r["files"][next(iter(r["files"]))].update({CHECKSUM: "not hex"}),
        lambda r: r.update(world_size=0),
        lambda r: r.pop("checksum"),
    ],
    ids=[
        "traversal",
        "absolute",
        "files-not-dict",
        "step-mismatch",
        "format",
        "size-type",
        "digest",
        "world",
        "no-checksum",
    ],  # fmt: skip
)
def test_malicious_commit_record_is_refused(tmp_path, dist1, edit):  # noqa: F811
    mgr, step2 = two_commits(tmp_path, "dcp_sync", dist1)
    rec = json.loads((step2 / COMMIT).read_text())
    edit(rec)
    (step2 / COMMIT).write_text(json.dumps(rec))
    assert [r["step"] for r in mgr.committed()] == [1]  # not even a candidate
    target, *_ = make_app(7)
    got, _ = mgr.restore(target, mgr.committed())
    assert got["step"] == 1
    assert not list(tmp_path.rglob("escaped")) and not os.path.exists("/tmp/abs")


def test_malicious_rank_manifest_fails_the_save(tmp_path, dist1, monkeypatch):  # noqa: F811
    mgr = manager(tmp_path, "dcp_sync", dist1)
    app, *_ = make_app(1)
    mgr.save(1, app)
    real = mgr.storage.write_bytes

    def evil(rel, data):
        if rel.endswith("ranks/0.json"):
            data = json.dumps({"files": {"../../x": {"bytes": 1, CHECKSUM: "0" * 32}}}).encode()
        real(rel, data)

    monkeypatch.setattr(mgr.storage, "write_bytes", evil)
    mgr.cfg.on_error = "continue"
    mgr.save(2, app)
    monkeypatch.undo()
    assert not (tmp_path / "remote" / "step-000000002" / COMMIT).exists()
    assert [r["step"] for r in mgr.committed()] == [1]
    with pytest.raises(CommitError, match="ranks/3.json"):
        parse_manifest(b'{"files": {"a/b": {}}}', 3)


def test_parse_commit_roundtrip_names_the_problem():
    ok = {"step": 5, "format": "dcp", "world_size": 1, "checksum": CHECKSUM,
          "files": {"__0_0.distcp": {"bytes": 3, CHECKSUM: "a" * 32}}}  # fmt: skip
    assert parse_commit(json.dumps(ok).encode(), "step-000000005")["dir"] == "step-000000005"
    with pytest.raises(CommitError, match="does not match the directory"):
        parse_commit(json.dumps(ok).encode(), "step-000000006")
    with pytest.raises(CommitError, match="older version without checksums"):
        parse_commit(json.dumps({**ok, "files": {"__0_0.distcp": 3}}).encode(), "step-000000005")


# -- every byte verified: randomized corruption, zero silent loads ---------------------------------
def full_state(app) -> dict:
    """Everything a restore must bring back, as comparable values."""
    out = {f"model.{k}": v.detach().clone() for k, v in app.model.state_dict().items()}
    osd = app.optimizer.state_dict()
    for pid, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{pid}.{k}"] = v.clone() if torch.is_tensor(v) else v
    out["optim.param_groups"] = json.dumps(osd["param_groups"], sort_keys=True, default=str)
    for name, part in app.parts.items():
        out[f"part.{name}"] = json.dumps(part.state_dict(), sort_keys=True, default=str)
    out["rng.torch"] = torch.get_rng_state()
    out["rng.numpy"] = json.dumps([x.tolist() if hasattr(x, "tolist") else x for x in np.random.get_state()])
    out["rng.python"] = json.dumps(random.getstate())
    return out


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _damage(rng: random.Random, victim) -> str:
    how = rng.choice(["flip", "flip", "truncate", "delete", "append", "zero-run"])
    data = bytearray(victim.read_bytes())
    if how == "delete":
        victim.unlink()
    elif how == "truncate":
        victim.write_bytes(bytes(data[: rng.randint(0, max(0, len(data) - 1))]))
    elif how == "append":
        victim.write_bytes(bytes(data) + os.urandom(rng.randint(1, 64)))
    elif how == "zero-run" and data:
        i = rng.randrange(len(data))
        n = len(data[i : i + rng.randint(1, 32)])
        data[i : i + n] = b"\0" * n
        victim.write_bytes(bytes(data))
    elif data:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)  # single-bit flips, anywhere
        victim.write_bytes(bytes(data))
    return how


@pytest.mark.parametrize("backend", ["dcp_sync", "torch_save"])
def test_randomized_corruption_zero_silent_loads(tmp_path, dist1, backend):  # noqa: F811
    """100 trials per format (200 in all): damage 1-3 random files anywhere (shards, .metadata,
    COMMIT.json, ranks/*.json) of the three commits; restore must bring back exactly the saved
    state of some commit (model, optimizer, scheduler, RNG, data position), or refuse."""
    rng = random.Random(20261130 if backend == "dcp_sync" else 7)
    mgr = manager(tmp_path, backend, dist1, keep_last=10)
    app, counter, sched = make_app(1)
    saved = {}
    for step in (1, 2, 3):
        app.model(torch.randn(2, 3, 16, 16)).sum().backward()
        app.optimizer.step()
        sched.step()
        counter.n = 100 + step
        torch.randn(3)  # move the RNG
        saved[step] = full_state(app)
        mgr.save(step, app)
    mgr.wait()
    drop_local_copies(tmp_path)  # every byte must come from the damaged remote
    pristine = tmp_path / "pristine"
    shutil.copytree(tmp_path / "remote", pristine)
    outcomes = {"exact": 0, "refused": 0, "fell_back": 0}
    kinds = set()
    for trial in range(100):
        shutil.rmtree(tmp_path / "remote")
        shutil.copytree(pristine, tmp_path / "remote")
        files = sorted(p for p in (tmp_path / "remote").rglob("*") if p.is_file())
        for victim in rng.sample(files, rng.randint(1, 3)):
            kinds.add((victim.name.split("_")[0], _damage(rng, victim)))
        target, *_ = make_app(50 + trial)
        rec, skipped = mgr.restore(target, mgr.committed())
        if rec is None:
            outcomes["refused"] += 1
            continue
        assert same(full_state(target), saved[rec["step"]]), (
            f"trial {trial}: silent load of step {rec['step']}"
        )
        outcomes["exact"] += 1
        outcomes["fell_back"] += rec["step"] < 3
    print(backend, outcomes, len(kinds))
    assert outcomes["exact"] > 20 and outcomes["fell_back"] > 10  # both paths were exercised


def test_verified_bytes_are_the_ones_loaded(tmp_path, dist1):  # noqa: F811
    """A single flipped bit in tensor data keeps every size: only the checksum sees it."""
    mgr, step2 = two_commits(tmp_path, "dcp_sync", dist1)
    drop_local_copies(tmp_path)
    shard = next(p for p in step2.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    target, *_ = make_app(7)
    rec, skipped = mgr.restore(target, mgr.committed())
    assert rec["step"] == 1
    assert shard.name in skipped[0] and "expected" in skipped[0] and CHECKSUM in skipped[0]


def _no_checkpoint(step: Path, tamper: str) -> None:
    """Bytes that are not a checkpoint, re-signed: what evaluate.py, predict.py and --export read."""
    if tamper in ("list", "group", "value"):
        full = torch.load(step / "state.pt", weights_only=True)
        if tamper == "value":
            full["model"][next(iter(full["model"]))] = 3
        torch.save([1, 2] if tamper == "list" else {**full, "model": "x"} if tamper == "group" else full,
                   step / "state.pt")  # fmt: skip
    elif tamper == "unlisted":  # a shard left out of the record (and so never downloaded)
        rec = json.loads((step / COMMIT).read_text())
        del rec["files"][next(n for n in rec["files"] if n.endswith(".distcp"))]
        (step / COMMIT).write_text(json.dumps(rec))
    else:  # "huge": the metadata declares a tensor far larger than the files
        md = pickle.loads((step / ".metadata").read_bytes())
        md.state_dict_metadata["model.head.weight"].size = torch.Size([1 << 20, 1 << 20])
        (step / ".metadata").write_bytes(pickle.dumps(md))
    resign(step)


@pytest.mark.parametrize(
    "backend, tamper, message",
    [
        ("torch_save", "list", "state.pt holds a list, not a checkpoint's dict"),
        ("torch_save", "group", "state.pt's 'model' is a str, not a state dict"),
        ("torch_save", "value", "is a int, not a tensor"),
        ("dcp_sync", "unlisted", "cannot read its model weights"),
        ("dcp_sync", "huge", r"its metadata declares 4398046\d{6} bytes of tensors in \d+ bytes of files"),
    ],
)
def test_verified_bytes_that_are_no_checkpoint_are_skipped_naming_the_dir(
    tmp_path,
    dist1,
    caplog,
    backend,
    tamper,
    message,  # noqa: F811
):
    import tempfile

    from goodput.checkpoint.export import CorruptCheckpoint, read_weights

    mgr, step2 = two_commits(tmp_path, backend, dist1)
    _no_checkpoint(step2, tamper)
    with caplog.at_level(logging.WARNING, logger="goodput.checkpoint.export"):
        assert read_weights(str(step2.parent)).step == 1  # the newest commit that reads
    assert f"skipping {step2}" in caplog.text and re.search(message, caplog.text)
    with pytest.raises(CorruptCheckpoint, match=message) as e:
        read_weights(str(step2))  # named: refused, with the step dir, not a temporary copy
    said = str(e.value)
    assert said.startswith(f"{step2}: ") and os.path.join(tempfile.gettempdir(), "tmp") not in said
    mgr.close()


# -- local-first restore ---------------------------------------------------------------------------
def test_restore_reads_the_verified_local_copy_and_not_a_bad_one(tmp_path, dist1, caplog):  # noqa: F811
    mgr, _ = two_commits(tmp_path, "dcp_sync", dist1)
    kept = tmp_path / "staging" / "step-000000002"
    assert sorted(os.listdir(kept)) == sorted(mgr.committed()[0]["files"])  # staging keeps the newest save
    assert not (tmp_path / "staging" / "step-000000001").exists()  # and only that one
    reads = []
    real_get = mgr.storage.get
    mgr.storage.get = lambda rel, dst, **kw: reads.append(rel) or real_get(rel, dst, **kw)

    caplog.set_level("INFO")
    target, *_ = make_app(7)
    rec, _ = mgr.restore(target, mgr.committed())
    assert rec["step"] == 2 and reads == []  # nothing came from the remote
    assert "all 2 files from the node-local copy" in caplog.text

    # a stale local copy (staging holds step 2, the candidate is step 1): the remote is read
    caplog.clear()
    target, *_ = make_app(6)
    rec, _ = mgr.restore(target, [r for r in mgr.committed() if r["step"] == 1])
    assert rec["step"] == 1 and len(reads) == 2 and "no local copy" in caplog.text
    reads.clear()

    # corrupt local copy: the remote is read for that file, and the log says why
    shard = next(p for p in kept.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    caplog.clear()
    target, *_ = make_app(8)
    rec, _ = mgr.restore(target, mgr.committed())
    assert rec["step"] == 2 and reads == [f"step-000000002/{shard.name}"]
    assert "local copy differs from the commit" in caplog.text

    # another lineage's step 2 in staging (same names, other bytes): never used
    reads.clear()
    other, *_ = make_app(3)
    other_mgr = manager(tmp_path / "other", "dcp_sync", dist1)
    other_mgr.save(2, other)
    shutil.rmtree(kept)
    shutil.copytree(tmp_path / "other" / "staging" / "step-000000002", kept)
    target, *_ = make_app(9)
    rec, _ = mgr.restore(target, mgr.committed())
    from goodput.model import model_sha256

    assert rec["step"] == 2 and len(reads) == 2  # both files from the remote
    expected, *_ = make_app(1)
    expected.model.head.weight.data.add_(1.0)
    assert model_sha256(target.model) == model_sha256(expected.model)


def test_inspect_verify_names_each_bad_file(tmp_path, dist1):  # noqa: F811
    import subprocess
    import sys

    from helpers import REPO

    mgr, step2 = two_commits(tmp_path, "dcp_sync", dist1)
    run = tmp_path / "remote"

    def verify(target):
        cmd = [sys.executable, "scripts/inspect_checkpoint.py", "--verify", str(target)]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)

    ok = verify(run)
    assert ok.returncode == 0 and ok.stdout.count(": ok") == 2, ok.stdout + ok.stderr
    shard = next(p for p in step2.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x04  # one bit, same size
    shard.write_bytes(bytes(data))
    (step2 / ".metadata").unlink()
    (run / "step-000000007").mkdir()  # an in-flight save: listed, not a failure of the run
    bad = verify(run)
    assert bad.returncode == 1
    assert f"BAD {shard}: expected" in bad.stdout and f"BAD {step2 / '.metadata'}: missing" in bad.stdout
    assert "step-000000001: ok" in bad.stdout and "step-000000007: incomplete" in bad.stdout
    one = verify(step2)
    assert one.returncode == 1 and shard.name in one.stdout
    assert verify(run / "step-000000001").returncode == 0
    assert verify(run / "step-000000007").returncode == 1
    script = str(REPO / "scripts" / "inspect_checkpoint.py")  # a bare step dir name, from the run dir
    bare = subprocess.run(
        [sys.executable, script, "--verify", "step-000000001"], cwd=run, capture_output=True, text=True
    )
    assert bare.returncode == 0 and "step-000000001: ok" in bare.stdout, bare.stdout + bare.stderr
