#!/usr/bin/env bash
# The CUDA paths the template claims, in one short run (<= 5 min on one GPU), one line per check:
#
#   make venv && scripts/gpu_check.sh            # from the repository root of a fresh clone
#
#   pg           NCCL (CUDA tensors) + gloo (checkpoint group) process groups, as the worker makes them
#   staging      dcp_async's staging copy lands in pinned host memory (CUDA) and equals the source
#   resume       a run killed at step 10 and relaunched == the uninterrupted run (model_sha256), dcp_async
#   cuda_rng     the checkpoint of that run holds the CUDA RNG state, and it restores the generator
#   compile      bf16 + trainer.compile on the entry point (bf16 where this checkout has trainer.precision)
#   rescue       the step's own error on CUDA (fault.raise_at_step=7): the rescue copies the state to host
#                memory and the relaunch resumes step 6 == the uninterrupted run; with 2+ GPUs also
#                rank 1 of a 2-rank NCCL job killed at step 7: the survivor, stuck in NCCL until its
#                grace or the collective timeout, rescues step 7 and the restart resumes it
#   hsdp         4 GPUs: parallel=hsdp, 2 replica groups x 2 shards on NCCL, bf16, rank 3 killed at step 10
#                -> the survivors' rescue of step 10 -> == the uninterrupted run; SKIP with fewer GPUs
#   recipe       the V2 recipe's parts (MixUp/CutMix, TrivialAugmentWide, ...) killed and resumed by
#                scripts/check.py == the uninterrupted run; syncbn: the same on 2 GPUs with SyncBatchNorm
#   spares       3 GPUs: parallel.spares=1 on 2 NCCL ranks, rank 1 killed at step 12 -> a spare takes its
#                place without a restart (NCCL communicator aborted, CUDA context kept) -> == the
#                uninterrupted run; SKIP with fewer GPUs
#   bench        scripts/bench_step.py: images/s per switch (resnet18 on GPU), compile restart cold vs warm
#
# Without CUDA it says so and runs what a CPU can (the entry-point checks, gloo); the CUDA-only ones
# print SKIP. Exit status: 1 if any check FAILs. Output: outputs/gpu_check/ (bench JSON, logs).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ ! -x "$PY" ]; then
  echo "FAIL setup: $PY not found: run 'make venv' first (or PY=/path/to/python $0)"
  exit 1
fi
OUT=${OUT:-outputs/gpu_check}
ROOT=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-XXXXXX")
trap 'rm -rf "$ROOT"' EXIT
mkdir -p "$OUT"
FAILS=0
line() {  # STATUS NAME DETAIL
  printf '%-4s %-9s %s\n' "$1" "$2" "$3" | tee -a "$OUT/results.txt"
  [ "$1" = FAIL ] && FAILS=$((FAILS + 1))
  return 0
}
: >"$OUT/results.txt"
train() {  # NAME OVERRIDES... : the entry point on the smoke experiment, log in $OUT/NAME.log
  local name=$1
  shift
  # In a subshell that waits (`; exit`): timeout re-raises the injected SIGKILL on itself, and the
  # shell that waited for it prints "Killed", here into /dev/null instead of among the check lines.
  (timeout 240 "$PY" scripts/train.py experiment=smoke "paths.root=$ROOT" "run.name=$name" "$@" \
    >"$OUT/$name.log" 2>&1; exit $?) 2>/dev/null
}
summary() {  # NAME KEY (a Python expression on the summary dict `s`)
  "$PY" - "$ROOT" "$1" "$2" <<'EOF'
import glob, json, os, sys
root, name, expr = sys.argv[1:]
files = sorted(glob.glob(f"{root}/runs/{name}/**/summary.json", recursive=True), key=os.path.getmtime)
s = json.load(open(files[-1]))
print(eval(expr))
EOF
}

CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
if [ "$CUDA" = 1 ]; then
  GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)")
  echo "CUDA: available ($GPU)"
else
  echo "CUDA: NOT available (torch.cuda.is_available() is False): running the CPU-capable checks;"
  echo "      the CUDA-only ones (NCCL, pinned staging, CUDA RNG) print SKIP. This is not a GPU check."
fi

# -- pg -------------------------------------------------------------------------------------------
detail=$("$PY" - <<'EOF' 2>"$OUT/pg.log"
import torch, torch.distributed as dist
from goodput.parallel import init_distributed, shutdown_distributed
d = init_distributed()
t = torch.ones(2, device=d.device); dist.all_reduce(t)          # the default group: NCCL for CUDA tensors
c = torch.ones(2); dist.all_reduce(c, group=d.ckpt_pg)          # the checkpoint group: gloo
ok = t.sum().item() == 2 and c.sum().item() == 2
print(("ok " if ok else "wrong sums ") + f"device={d.device} default={dist.get_backend()} ckpt={dist.get_backend(d.ckpt_pg)}")
shutdown_distributed()
EOF
)
rc=$?
if [ $rc -ne 0 ]; then line FAIL pg "exit $rc: $(tail -1 "$OUT/pg.log")"
elif [[ $detail != ok* ]]; then line FAIL pg "$detail"
elif [ "$CUDA" = 1 ] && [[ $detail != *nccl* ]]; then line FAIL pg "no NCCL backend: $detail"
elif [ "$CUDA" = 1 ]; then line PASS pg "${detail#ok }"
else line SKIP pg "no CUDA: gloo only (${detail#ok })"; fi

# -- staging --------------------------------------------------------------------------------------
if [ "$CUDA" = 1 ]; then
  detail=$("$PY" - <<'EOF' 2>"$OUT/staging.log"
import torch
from goodput.checkpoint.backends import DCPAsync
stager = DCPAsync()._make_stager()
sd = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(17, device="cuda")}
out = stager.stage(sd)
out = out.result() if hasattr(out, "result") else out
pinned = all(v.device.type == "cpu" and v.is_pinned() for v in out.values())
same = all(torch.equal(out[k], sd[k].cpu()) for k in sd)
print(f"{'ok' if pinned and same else 'bad'} pinned={pinned} equal={same}")
stager.close()
EOF
  )
  rc=$?
  if [ $rc -ne 0 ]; then line FAIL staging "exit $rc: $(tail -1 "$OUT/staging.log")"
  elif [[ $detail == ok* ]]; then line PASS staging "${detail#ok }"
  else line FAIL staging "$detail"; fi
else
  line SKIP staging "no CUDA: dcp_async stages without pinned memory on CPU"
fi

# -- resume (and cuda_rng, from its checkpoint) --------------------------------------------------
train ref checkpoint=dcp_async
rc_ref=$?
# Killed at step 10: dcp_async keeps one save in flight, so step 4's commit is done once step 8's
# save starts (a kill at 6 can land before step 4's background upload commits: nothing to resume).
train kill checkpoint=dcp_async fault.kill_at_step=10
rc_kill=$?
train kill checkpoint=dcp_async fault.kill_at_step=10
rc_again=$?
if [ $rc_ref -ne 0 ] || [ $rc_kill -ne 137 ] || [ $rc_again -ne 0 ]; then
  line FAIL resume "exits: uninterrupted $rc_ref, killed $rc_kill (137 expected), relaunch $rc_again; see $OUT/*.log"
else
  a=$(summary ref "s['model_sha256']")
  b=$(summary kill "s['model_sha256']")
  from=$(summary kill "s['resumed_from_steps']")
  if [ "$from" = "[]" ]; then line FAIL resume "the relaunch resumed from no checkpoint (nothing was committed)"
  elif [ "$a" = "$b" ]; then line PASS resume "resumed from $from, model_sha256 ${a:0:12} == uninterrupted"
  else line FAIL resume "model_sha256 ${b:0:12} != uninterrupted ${a:0:12} (resumed from $from)"; fi
fi

if [ "$CUDA" = 1 ]; then
  detail=$("$PY" - "$ROOT/checkpoints/ref" <<'EOF' 2>"$OUT/cuda_rng.log"
import sys, torch
import torch.distributed.checkpoint as dcp
from goodput.checkpoint.backends import SafeFileSystemReader
from goodput.checkpoint.layout import local_commits
from goodput.checkpoint.state import RNGState, decode
newest = str(local_commits(sys.argv[1])[-1][1])
reader = SafeFileSystemReader(str(newest))
md = reader.read_metadata().state_dict_metadata
sd = {"rank0.rng": torch.empty(md["rank0.rng"].size, dtype=torch.uint8)}
dcp.load(sd, storage_reader=reader, no_dist=True)
saved = decode(sd["rank0.rng"])
if "cuda" not in saved:
    print("bad: no CUDA RNG state in", newest); raise SystemExit
rng = RNGState(0, 0)
rng.load_state_dict(saved)
first = torch.rand(4, device="cuda")
rng.load_state_dict(saved)
again = torch.rand(4, device="cuda")
print(f"{'ok' if torch.equal(first, again) else 'bad'} {len(saved['cuda'])} device state(s) in {newest.rsplit('/', 1)[-1]}, restored draws equal")
EOF
  )
  rc=$?
  if [ $rc -ne 0 ]; then line FAIL cuda_rng "exit $rc: $(tail -1 "$OUT/cuda_rng.log")"
  elif [[ $detail == ok* ]]; then line PASS cuda_rng "${detail#ok }"
  else line FAIL cuda_rng "$detail"; fi
else
  line SKIP cuda_rng "no CUDA: the checkpoint holds CPU RNG states only"
fi

# -- compile (bf16 + compile) ------------------------------------------------------------------------
over=(trainer.compile=true checkpoint=dcp_sync)
has_precision=$("$PY" -c "import dataclasses; from goodput.run.config import TrainerConfig as T; print(int('precision' in {f.name for f in dataclasses.fields(T)}))")
[ "$has_precision" = 1 ] && over+=(trainer.precision=bf16-mixed)
if train compile "${over[@]}"; then
  c=$(summary compile "round(s['goodput']['compile_seconds'], 1)")
  loss=$(summary compile "round(s['final_loss'], 4)")
  what="compile (bf16 skipped: no trainer.precision on this checkout)"
  [ "$has_precision" = 1 ] && what="bf16 + compile"
  line PASS compile "$what: 12 steps, loss $loss, compile ${c} s"
else
  line FAIL compile "exit $?: $(tail -1 "$OUT/compile.log")"
fi

# -- rescue ------------------------------------------------------------------------------------------
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null)
rescue=(checkpoint=dcp_sync checkpoint.every_n_steps=5)
train rescue_ref "${rescue[@]}"
rc_ref=$?
train rescue_own "${rescue[@]}" fault.raise_at_step=7
rc_own=$?
train rescue_own "${rescue[@]}" fault.raise_at_step=7
rc_again=$?
if [ $rc_ref -ne 0 ] || [ $rc_own -eq 0 ] || [ $rc_again -ne 0 ]; then
  line FAIL rescue "exits: uninterrupted $rc_ref, failing step $rc_own (non-zero expected), relaunch $rc_again"
else
  a=$(summary rescue_ref "s['model_sha256']")
  b=$(summary rescue_own "s['model_sha256']")
  from=$(summary rescue_own "s['resumed_from_steps']")
  detail="own error: resumed from $from ([6] expected), model_sha256 ${b:0:12} vs ${a:0:12}"
  if [ "$a" != "$b" ] || [ "$from" != "[6]" ]; then line FAIL rescue "$detail"
  elif [ "${NGPU:-0}" -ge 2 ]; then
    train rescue_ddp_ref "${rescue[@]}" parallel=ddp
    train rescue_ddp "${rescue[@]}" parallel=ddp parallel.max_restarts=1 fault.kill_at_step=7 fault.rank=1
    c=$(summary rescue_ddp_ref "s['model_sha256']")
    d=$(summary rescue_ddp "s['model_sha256']")
    from2=$(summary rescue_ddp "s['resumed_from_steps']")
    if [ "$c" = "$d" ] && [ "$from2" = "[7]" ]; then
      line PASS rescue "$detail; NCCL rank 1 killed: resumed from $from2, model_sha256 ${d:0:12} == uninterrupted"
    else line FAIL rescue "$detail; NCCL rank 1 killed: resumed from $from2 ([7] expected), ${d:0:12} vs ${c:0:12}"; fi
  elif [ "$CUDA" = 1 ]; then line PASS rescue "$detail (the NCCL kill needs 2 GPUs)"
  else line SKIP rescue "no CUDA: $detail (tests/e2e/test_rescue_runs.py has the gloo drills)"; fi
fi

# -- hsdp (needs 4 GPUs: 2 replica groups x 2 shards) -------------------------------------------------
if [ "${NGPU:-0}" -ge 4 ]; then
  hsdp=(parallel=hsdp parallel.nproc_per_node=4 parallel.shard_size=2 checkpoint=dcp_sync)
  [ "$has_precision" = 1 ] && hsdp+=(trainer.precision=bf16-mixed)
  train hsdp_ref "${hsdp[@]}"
  rc_ref=$?
  train hsdp_kill "${hsdp[@]}" parallel.max_restarts=1 fault.kill_at_step=10 fault.rank=3
  rc_kill=$?
  if [ $rc_ref -ne 0 ] || [ $rc_kill -ne 0 ]; then
    line FAIL hsdp "exits: uninterrupted $rc_ref, killed + restarted $rc_kill; see $OUT/hsdp_*.log"
  elif ! grep -q "hsdp: 2 replica group(s) x 2 shard(s)" "$OUT/hsdp_ref.log"; then
    line FAIL hsdp "no 2 x 2 mesh reported in $OUT/hsdp_ref.log"
  else
    a=$(summary hsdp_ref "s['model_sha256']")
    b=$(summary hsdp_kill "s['model_sha256']")
    from=$(summary hsdp_kill "s['resumed_from_steps']")
    if [ "$a" = "$b" ] && [ "$from" = "[10]" ]; then
      line PASS hsdp "2 groups x 2 shards, rank 3 killed, resumed from the rescue $from, model_sha256 ${a:0:12} == uninterrupted"
    else line FAIL hsdp "model_sha256 ${b:0:12} vs uninterrupted ${a:0:12}, resumed from $from ([10], the rescue, expected)"; fi
  fi
else
  line SKIP hsdp "needs 4 GPUs (2 replica groups x 2 shards), this machine has ${NGPU:-0}; CPU drills: tests/e2e/test_hsdp_runs.py"
fi

# -- recipe: the V2 recipe's parts killed and resumed by scripts/check.py (make check) on this device --
# (the batch transform draws on the CPU generator and mixes CUDA tensors; SyncBatchNorm is CUDA only)
check() {  # NAME OVERRIDES...: scripts/check.py's verdict, log in $OUT/NAME.log
  local name=$1
  shift
  PYTHONPATH="src:tests" timeout 300 "$PY" scripts/check.py --steps 6 --kill-at 3 experiment=smoke \
    "paths.root=$ROOT/$name" "$@" >"$OUT/$name.log" 2>&1
}
recipe=(task.loss.label_smoothing=0.1 batch_augment=mixup_cutmix augment=ta_wide optim.norm_weight_decay=0.0
        data.repeated_augment=2)
if check recipe "${recipe[@]}"; then line PASS recipe "$(grep '^check: resume' "$OUT/recipe.log")"
else line FAIL recipe "$(grep '^check:' "$OUT/recipe.log" | tail -2 | tr '\n' ' ') (see $OUT/recipe.log)"; fi
if [ "$CUDA" = 1 ] && [ "${NGPU:-0}" -ge 2 ]; then
  if check syncbn "${recipe[@]}" parallel=ddp parallel.nproc_per_node=2 model._target_=helpers.StochasticNet.build \
    model.width=8 trainer.sync_batchnorm=true; then line PASS syncbn "$(grep '^check: resume' "$OUT/syncbn.log")"
  else line FAIL syncbn "$(grep '^check:' "$OUT/syncbn.log" | tail -2 | tr '\n' ' ') (see $OUT/syncbn.log)"; fi
else
  line SKIP syncbn "trainer.sync_batchnorm needs 2 GPUs (torch's SyncBatchNorm is CUDA only), this machine has ${NGPU:-0}"
fi

# -- spares (needs 3 GPUs: 2 NCCL ranks and a spare on the third) --------------------------------------
if [ "${NGPU:-0}" -ge 3 ]; then
  spare=(parallel=ddp checkpoint=dcp_sync checkpoint.every_n_steps=20 trainer.max_steps=30
         fault.slow_rank=0 fault.slow_seconds=0.2)
  train spare_ref "${spare[@]}"
  rc_ref=$?
  # rank 1 killed after step 12: rank 0's watcher aborts its NCCL communicator (a collective with a
  # dead NCCL peer waits), the spare on GPU 2 takes rank 1's place, the state crosses over gloo
  train spare_kill "${spare[@]}" parallel.spares=1 fault.kill_at_step=12 fault.rank=1
  rc_kill=$?
  if [ $rc_ref -ne 0 ] || [ $rc_kill -ne 0 ]; then
    line FAIL spares "exits: uninterrupted $rc_ref, killed $rc_kill; see $OUT/spare_*.log"
  else
    a=$(summary spare_ref "s['model_sha256']")
    b=$(summary spare_kill "s['model_sha256']")
    n=$(summary spare_kill "s['recovery'].get('in_process', 0)")
    t=$(summary spare_kill "[r.get('total_seconds') for r in s['recovery']['per_restart']]")
    if [ "$a" = "$b" ] && [ "$n" = 1 ]; then
      line PASS spares "rank 1 killed, a spare took its place in-process ($t s), model_sha256 ${a:0:12} == uninterrupted"
    else line FAIL spares "in-process recoveries $n (1 expected), model_sha256 ${b:0:12} vs uninterrupted ${a:0:12}"; fi
  fi
else
  line SKIP spares "needs 3 GPUs (2 ranks and a spare), this machine has ${NGPU:-0}; CPU drills: tests/e2e/test_spares_runs.py"
fi

# -- bench ------------------------------------------------------------------------------------------
only=fp32,compile
[ "$has_precision" = 1 ] && only=fp32,bf16+compile  # the issue's comparison: bf16 + compile vs fp32 eager
if [ "$CUDA" = 1 ]; then
  bench=(--models resnet18 --steps 30 --batch 128 --image-size 64 --set demo_data.train_per_class=100
         --only "$only" --restart-models small_cnn)
else  # what a CPU runs in a minute or two: the script's path, not a measurement
  bench=(--models small_cnn --steps 5 --batch 16 --image-size 16 --only "$only" --restart-models "")
fi
if timeout 240 "$PY" scripts/bench_step.py "${bench[@]}" --out "$OUT" >"$OUT/bench.log" 2>&1; then
  rows=$(grep -cE "^\| (resnet18|small_cnn)" "$OUT/bench.log")
  restart=$(grep -E "^(PASS|MISS) " "$OUT/bench.log" | head -1)
  line PASS bench "$rows table rows in $OUT/bench.log, JSON $OUT/step.json; ${restart:-restart part not run}"
else
  line FAIL bench "exit $?: $(tail -1 "$OUT/bench.log")"
fi

echo "---- $FAILS failed; results in $OUT/results.txt"
[ $FAILS -eq 0 ]
