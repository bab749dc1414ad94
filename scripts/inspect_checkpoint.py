"""List a run's checkpoints, verify them byte for byte, or export a model from one as one file.

python scripts/inspect_checkpoint.py outputs/checkpoints/demo-1a2b3c4d
python scripts/inspect_checkpoint.py --verify outputs/checkpoints/demo-1a2b3c4d     # every commit of a run
python scripts/inspect_checkpoint.py --verify outputs/checkpoints/demo-1a2b3c4d/step-000000300  # one step
python scripts/inspect_checkpoint.py outputs/checkpoints/demo --export model.safetensors [--step 250]

A path that is not there but names exactly one run dir `<it>-<8 hex digits>` beside it
(`outputs/checkpoints/demo` for the one `demo-1a2b3c4d` there) is taken as that dir, saying so;
with several, one line lists them newest first (exit 2).

--verify streams every file of every committed checkpoint through its checksum and compares it with
the commit record; it exits 1 and names each bad file (missing, wrong size, wrong checksum, or a commit
record that does not parse). Step dirs without a commit are listed as incomplete: they are never
loaded, so they fail the check only when named directly.

--export writes the model's full state dict (DCP shards of any world size gathered) as safetensors:
tensors only, loadable without unpickling anything (safetensors.torch.load_file), the step, backend
and world size in its metadata, and the run's model record (its `_target_` node, class names, image
size, mean and std: what scripts/predict.py needs). Load it into the model class the run used
(`model.load_state_dict`).
`--weights ema` exports the EMA of the weights instead (a run with trainer.ema_decay; the weights
trainer.eval_on=ema evaluated and logged to MLflow).
"""

import argparse
import atexit
import gc
import json
import os
import sys

from goodput.checkpoint.export import ExportError, SourceError, model_state, run_dir, save_safetensors
from goodput.checkpoint.layout import COMMIT, CommitError, parse_commit, parse_step
from goodput.checkpoint.spec import ModelSpec, SpecError
from goodput.storage.checksum import CHECKSUM, TooLarge
from goodput.storage.remote import Storage
from goodput.untrusted import printable


def say(line: str) -> None:
    """Print one line of what records hold (a backend, a stop reason, file names): escaped, so a `\\r`
    or an escape sequence in a record cannot rewrite what the line shows."""
    print(printable(line))


def status(store: Storage, name: str) -> dict:
    files = store.ls(name)
    row = {"dir": name, "step": parse_step(name), "bytes": sum(s for s in files.values() if s > 0)}
    if COMMIT not in files:
        return {**row, "status": "incomplete"}
    try:
        rec = parse_commit(store.read_bytes(f"{name}/{COMMIT}"), name)
    except CommitError as e:
        return {**row, "status": f"bad commit record: {e}"}
    bad = [f for f, m in rec["files"].items() if files.get(f) != m["bytes"]]
    return {
        **row,
        "backend": rec.get("backend"),
        "world_size": rec.get("world_size"),
        "bytes": rec.get("bytes", row["bytes"]),
        "status": f"files missing/wrong size: {bad[:3]}" if bad else "committed",
        "metric": rec.get("metric"),  # the monitored metric of this step's evaluation (keep_best_by)
        "best": rec.get("best"),  # the best so far when this step was saved
        "stop_reason": rec.get("stop_reason"),
        "record": rec,
    }


def verify(store: Storage, name: str) -> list[str]:
    """Every problem with committed step dir `name`, one line per bad file (empty = intact)."""
    try:
        rec = parse_commit(store.read_bytes(f"{name}/{COMMIT}"), name)
    except FileNotFoundError:
        return [f"{store.url(name)}: no {COMMIT} (incomplete, never loaded)"]
    except CommitError as e:
        return [f"{store.url(f'{name}/{COMMIT}')}: {e}"]
    problems = []
    for file, want in rec["files"].items():
        url = store.url(f"{name}/{file}")
        try:
            got = store.digest(f"{name}/{file}", limit=want["bytes"])  # a padded file: read no further
        except FileNotFoundError:
            problems.append(f"{url}: missing")
            continue
        except TooLarge:
            problems.append(f"{url}: longer than the {want['bytes']} bytes its commit records")
            continue
        except (OSError, ValueError) as e:  # a link or special file (refused unread), an I/O error
            problems.append(f"{url}: unreadable: {e}")
            continue
        if got.size != want["bytes"] or got.digest != want[CHECKSUM]:
            problems.append(
                f"{url}: expected {want['bytes']} bytes with {CHECKSUM} {want[CHECKSUM]}, "
                f"found {got.size} bytes with {got.digest}"
            )
    return problems


def export(store: Storage, row: dict, out: str, weights: str = "model") -> None:
    rec = row["record"]
    try:
        model = model_state(store, rec, weights)
    except ExportError as e:
        sys.exit(printable(f"{e}: not exporting"))
    meta = {"step": str(row["step"]), "backend": str(row["backend"]), "world_size": str(row["world_size"]),
            "weights": weights}  # fmt: skip
    if rec.get("model") is not None:  # (a commit of an older goodput has none: the export says less)
        try:
            meta.update(ModelSpec.parse(rec["model"], store.url(rec["dir"])).metadata())
        except SpecError as e:
            sys.exit(printable(f"{e}: not exporting"))
    save_safetensors(model, out, meta)
    say(
        f"wrote {len(model)} {weights} tensors of step {row['step']} ({row['backend']}) "
        f"to {out} (safetensors)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="a run's checkpoint.dir, or one step dir in it (path or fsspec URL)")
    p.add_argument("--verify", action="store_true", help="check every byte against the commit records")
    p.add_argument(
        "--export", metavar="FILE.safetensors", help="write a committed checkpoint's model as safetensors"
    )
    p.add_argument("--step", type=int, help="which step to export (default: the newest committed)")
    p.add_argument(
        "--weights", choices=["model", "ema"], default="model",
        help="the trained weights or their EMA (trainer.ema_decay: what trainer.eval_on=ema evaluates)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.export and not a.export.endswith(".safetensors"):
        p.error(f"--export writes safetensors: name the file *.safetensors, got {a.export}")
    try:
        a.dir = run_dir(a.dir, say=lambda line: print(f"inspect_checkpoint.py: {line}", file=sys.stderr))
    except SourceError as e:
        print(f"inspect_checkpoint.py: {printable(e)}", file=sys.stderr)
        sys.exit(2)
    one = parse_step(a.dir.rstrip("/").rsplit("/", 1)[-1])
    if one is not None:  # a single step dir
        parent, name = os.path.split(a.dir.rstrip("/"))
        store, names = Storage(parent or "."), [name]
    else:
        store = Storage(a.dir)
        names = sorted(
            (n for n, s in store.ls().items() if s == -1 and parse_step(n) is not None), key=parse_step
        )
    if not names:
        p.error(f"no step-* checkpoint directories in {a.dir}")
    if a.verify:
        bad = 0
        for name in names:
            problems = verify(store, name)
            incomplete = problems and problems[0].endswith("(incomplete, never loaded)")
            if incomplete and one is None:
                say(f"{name}: incomplete (no {COMMIT}), never loaded")
                continue
            for line in problems:
                say(f"BAD {line}")
            bad += len(problems)
            if not problems:
                say(f"{name}: ok")
        sys.exit(1 if bad else 0)
    rows = [status(store, n) for n in names]
    best = next((r["best"] for r in reversed(rows) if r["status"] == "committed" and r.get("best")), None)
    for r in rows:
        r["is_best"] = best is not None and r["step"] == best["step"]
    if a.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "record"} for r in rows], indent=1))
    else:
        print(f"{'step':>10}  {'backend':<10} {'world':>5} {'MB':>9}  status")
        for r in rows:
            mb = r["bytes"] / 1e6
            backend, world = r.get("backend") or "-", r.get("world_size") or "-"
            notes = "".join(
                [f"  {k}={v:.4g}" for k, v in (r.get("metric") or {}).items()]
                + (["  BEST"] if r["is_best"] else [])
                + ([f"  stopped: {r['stop_reason']}"] if r.get("stop_reason") else [])
            )
            say(f"{r['step']:>10}  {backend:<10} {world:>5} {mb:>9.2f}  {r['status']}{notes}")
        if best is not None:  # named by the newest commit: the best so far of checkpoint.keep_best_by
            say(f"best: step {best['step']} ({best['by']} = {best['value']:.6g}, {best['mode']})")
    if a.export:
        ok = [r for r in rows if r["status"] == "committed" and (a.step is None or r["step"] == a.step)]
        if not ok:
            p.error(f"no committed checkpoint{'' if a.step is None else f' at step {a.step}'} in {a.dir}")
        export(store, ok[-1], a.export, a.weights)


if __name__ == "__main__":
    atexit.register(gc.freeze)  # a fast exit: see scripts/train.py
    main()
