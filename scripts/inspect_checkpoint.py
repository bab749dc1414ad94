"""List a run's checkpoints, or export a model from one as a single torch.save file (for inference).

python scripts/inspect_checkpoint.py outputs/checkpoints/demo
python scripts/inspect_checkpoint.py outputs/checkpoints/demo --export model.pt [--step 250]
"""

import argparse
import json
import os
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from goodput.checkpoint.backends import SafeFileSystemReader
from goodput.checkpoint.manager import COMMIT, parse_step
from goodput.storage import Storage


def status(store: Storage, name: str) -> dict:
    files = store.ls(name)
    row = {"dir": name, "step": parse_step(name), "bytes": sum(s for s in files.values() if s > 0)}
    if COMMIT not in files:
        return {**row, "status": "incomplete"}
    try:
        rec = json.loads(store.read_bytes(f"{name}/{COMMIT}"))
    except ValueError:
        return {**row, "status": "corrupt commit"}
    bad = [f for f, size in rec.get("files", {}).items() if files.get(f) != size]
    return {
        **row,
        "backend": rec.get("backend"),
        "world_size": rec.get("world_size"),
        "bytes": rec.get("bytes", row["bytes"]),
        "status": f"files missing/wrong size: {bad[:3]}" if bad else "committed",
    }


def export(store: Storage, row: dict, out: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, size in store.ls(row["dir"]).items():
            if size >= 0:
                store.get(f"{row['dir']}/{name}", os.path.join(tmp, name))
        if row["backend"] == "torch_save":
            model = torch.load(os.path.join(tmp, "state.pt"), map_location="cpu", weights_only=True)["model"]
        else:
            reader = SafeFileSystemReader(tmp)
            md = reader.read_metadata()
            sd = {
                k: torch.empty(m.size, dtype=m.properties.dtype)
                for k, m in md.state_dict_metadata.items()
                if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
            }
            dcp.load(sd, storage_reader=reader, no_dist=True)
            model = {k[len("model.") :]: v for k, v in sd.items()}
    torch.save(model, out)
    print(f"wrote {len(model)} tensors of step {row['step']} ({row['backend']}) to {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="a run's checkpoint.dir (path or fsspec URL)")
    p.add_argument("--export", metavar="FILE", help="write the model state dict of a committed checkpoint")
    p.add_argument("--step", type=int, help="which step to export (default: the newest committed)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    store = Storage(a.dir)
    names = sorted(n for n, s in store.ls().items() if s == -1 and parse_step(n) is not None)
    if not names:
        p.error(f"no step-* checkpoint directories in {a.dir}")
    rows = [status(store, n) for n in names]
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'step':>10}  {'backend':<10} {'world':>5} {'MB':>9}  status")
        for r in rows:
            mb = r["bytes"] / 1e6
            backend, world = r.get("backend") or "-", r.get("world_size") or "-"
            print(f"{r['step']:>10}  {backend:<10} {world:>5} {mb:>9.2f}  {r['status']}")
    if a.export:
        ok = [r for r in rows if r["status"] == "committed" and (a.step is None or r["step"] == a.step)]
        if not ok:
            p.error(f"no committed checkpoint{'' if a.step is None else f' at step {a.step}'} in {a.dir}")
        export(store, ok[-1], a.export)


if __name__ == "__main__":
    main()
