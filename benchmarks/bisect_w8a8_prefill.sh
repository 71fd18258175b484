#!/usr/bin/env bash
# Bisect the W8A8 first-token time of one 2048-token prompt (Llama-2-7B shape, random weights)
# over several commits in ONE device call.
#
# The measured case is the one behind docs/benchmarks.md's W8A8 table (records
# results/h200/quant_smooth_quant{,_2}.json at 2817069: 35.97 / 34.82 ms; fp16 49.31 / 47.72):
#   python -m benchmarks.profile_generation --model llama2-7b -b 1 ... -c 2048:1 --model-format smooth_quant
# cut to batch 1 and the 2048:1 case, given REPS times (each with its own unmeasured warm-up,
# one engine per tree). fp16 runs on the first and last tree as a control.
#
#   bash benchmarks/bisect_w8a8_prefill.sh prepare SHA...   # here: worktrees .diag/bisect/<sha7>
#   bash benchmarks/bisect_w8a8_prefill.sh run [SHA7...]    # on the device, from the repository root
#   bash benchmarks/bisect_w8a8_prefill.sh clean            # here: remove the worktrees again
#
# prepare: one detached worktree per commit (git worktree add), with benchmarks/results, docs and
#   tests deleted (not needed to run; keeps the carried copy small), and .diag/bisect/ORDER listing
#   the trees in the order given. Prints each tree's size and the total, which must fit the
#   device call's carry limit (64 MiB in all, .whl included).
# run: device call with carry [".diag/bisect", ".whl"]. Trees run as `run_h200.sh ab` runs its
#   BEFORE tree: a package layout rebuilt under /tmp (benchmarks/tree_package.sh, which both
#   source) on PYTHONPATH before the wheels of .whl in /tmp/site. Order: the first and last tree's W8A8
#   run (the two ends), their fp16 controls, then the trees between. Each run is cut at RUN_TIMEOUT
#   s and none starts once the call's BUDGET_S is near; everything streams to $OUT/bisect.log, the
#   records land in $OUT/bisect/, and the summary (one line a commit, in ORDER) ends the log and
#   $OUT/bisect_summary.txt.
#
# Settings (environment): REPS (3), RUN_TIMEOUT (150 s), BUDGET_S (560 s of this call in all),
#   MODEL (llama2-7b), CASE (2048:1), CONTROL (1: fp16 on the first and last tree; 0: none),
#   PYTHON (python3), WHEELS (1; 0: leave .whl uninstalled, for a machine
#   whose Python has the packages), DRY (1: only `profile_generation --help` per tree, a check of
#   the imports). On a CPU machine the whole flow runs with MODEL=tiny CASE=64:1 (reference kernels):
#   WHEELS=0 PYTHON=$PWD/.venv/bin/python MODEL=tiny CASE=64:1 OUT=/tmp/bisect_cpu bash $0 run
set -u
CMD=${1:-}
shift || true
ROOT=$PWD
BISECT=.diag/bisect

die() { echo "bisect_w8a8_prefill: $*" >&2; exit 2; }

if [ "$CMD" = prepare ]; then
  [ $# -gt 0 ] || die "prepare needs commits"
  git rev-parse --git-dir >/dev/null 2>&1 || die "not in a git repository"
  git check-ignore -q .diag || die ".diag is not ignored here: put the worktrees elsewhere"
  mkdir -p "$BISECT"
  order=()
  for rev in "$@"; do
    full=$(git rev-parse --verify --quiet "$rev^{commit}") || die "no commit $rev"
    short=${full:0:7}
    dir=$BISECT/$short
    if [ ! -d "$dir" ]; then
      git worktree add --detach --quiet "$dir" "$full" || die "git worktree add $dir failed"
      rm -rf "$dir/benchmarks/results" "$dir/docs" "$dir/tests"
    fi
    echo "$full" > "$dir/.bisect_commit"
    order+=("$short")
  done
  printf '%s\n' "${order[@]}" > "$BISECT/ORDER"
  for s in "${order[@]}"; do
    printf '%s  %s  %s\n' "$(du -sh "$BISECT/$s" | cut -f1)" "$s" "$(git log -1 --format=%s "$s" | cut -c1-80)"
  done
  total_kib=$(du -sk "$BISECT" | cut -f1)
  whl_kib=$( [ -d .whl ] && du -sk .whl | cut -f1 || echo 0)
  echo "total $BISECT: $((total_kib / 1024)) MiB; with .whl: $(((total_kib + whl_kib) / 1024)) MiB (carry limit 64 MiB)"
  [ $((total_kib + whl_kib)) -lt $((60 * 1024)) ] || die "too large to carry"
  exit 0
fi

if [ "$CMD" = clean ]; then
  [ -d "$BISECT" ] || exit 0
  for d in "$BISECT"/*/; do
    [ -f "$d/.git" ] && git worktree remove --force "$d"
  done
  rm -f "$BISECT/ORDER"
  git worktree prune
  exit 0
fi

[ "$CMD" = run ] || die "usage: $0 prepare SHA... | run [SHA7...] | clean"

PYTHON=${PYTHON:-python3}
REPS=${REPS:-3}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
BUDGET_S=${BUDGET_S:-560}
MODEL=${MODEL:-llama2-7b}
CASE=${CASE:-2048:1}
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$OUTDIR/bisect"
LOG=$OUTDIR/bisect.log
START=$(date +%s)

if [ $# -gt 0 ]; then trees=("$@"); else
  [ -f "$BISECT/ORDER" ] || die "no $BISECT/ORDER: run prepare first (and carry $BISECT)"
  mapfile -t trees < "$BISECT/ORDER"
fi
for s in "${trees[@]}"; do [ -d "$BISECT/$s" ] || die "no tree $BISECT/$s (carried?)"; done

{
  echo "bisect_w8a8_prefill: ${#trees[@]} trees: ${trees[*]}; model $MODEL, case $CASE x $REPS"
  if [ -z "${DRY:-}" ] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv
  fi
  lscpu 2>/dev/null | grep -E '^Model name|^CPU\(s\)' || true
} 2>&1 | tee "$LOG"

SITE=/tmp/site
if [ "${WHEELS:-1}" != 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  # As run_h200.sh: the wheels the device image lacks (msgspec, pyzmq, ...), not the package itself.
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    2>&1 | tail -3 | tee -a "$LOG"
fi
"$PYTHON" -c "import torch; print('torch', torch.__version__)
try:
    import triton; print('triton', triton.__version__)
except Exception as e: print('triton: none', e)" 2>&1 | tee -a "$LOG"

# A tree's package layout under /tmp (benchmarks/tree_package.sh); prints the directory.
source "$ROOT/benchmarks/tree_package.sh"
pkg_of() {
  tree_package "$ROOT/$BISECT/$1" "/tmp/bisect_pkg/$1" && echo "/tmp/bisect_pkg/$1"
}

# run_one SHA7 FORMAT: one profile_generation run of the tree, streamed to the log.
run_one() {
  local s=$1 fmt=$2 pkg left limit t0 rc cases=() fmtargs=() i
  left=$((BUDGET_S - ($(date +%s) - START)))
  if [ "$left" -lt 45 ]; then
    echo "== $s $fmt: skipped, ${left}s of the call's budget left" | tee -a "$LOG"; return
  fi
  limit=$((left < RUN_TIMEOUT ? left : RUN_TIMEOUT))
  pkg=$(pkg_of "$s")
  for ((i = 0; i < REPS; i++)); do cases+=(-c "$CASE"); done
  [ "$fmt" = fp16 ] || fmtargs=(--model-format "$fmt")
  local args=(--model "$MODEL" -b 1 "${cases[@]}" "${fmtargs[@]}" --name "bisect_${s}_${fmt}")
  [ -z "${DRY:-}" ] || args=(--help)
  echo "== $s $fmt: $(cat "$BISECT/$s/.bisect_commit" 2>/dev/null) (timeout ${limit}s)" | tee -a "$LOG"
  t0=$(date +%s)
  (cd "$pkg" && env CONVEYOR_COMMIT="$s" PYTHONPATH="$pkg:$SITE" BENCH_OUT="$OUTDIR/bisect" PYTHONUNBUFFERED=1 \
     timeout -k 10 "$limit" "$PYTHON" -m benchmarks.profile_generation "${args[@]}") 2>&1 \
    | { if [ -n "${DRY:-}" ]; then tail -4; else cat; fi; } | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "== $s $fmt: rc=$rc, $(($(date +%s) - t0)) s" | tee -a "$LOG"
}

n=${#trees[@]}
first=${trees[0]}; last=${trees[$((n - 1))]}
run_one "$first" smooth_quant
[ "$n" -lt 2 ] || run_one "$last" smooth_quant
if [ "${CONTROL:-1}" != 0 ]; then
  run_one "$first" fp16
  [ "$n" -lt 2 ] || run_one "$last" fp16
fi
for ((i = 1; i < n - 1; i++)); do run_one "${trees[$i]}" smooth_quant; done

# One line a run, in ORDER: commit, format, first-token ms (median of the reps, then each), KV blocks.
"$PYTHON" - "$OUTDIR/bisect" "${trees[@]}" <<'EOF' 2>&1 | tee -a "$LOG" "$OUTDIR/bisect_summary.txt"
import json, statistics, sys
from pathlib import Path
out, trees = Path(sys.argv[1]), sys.argv[2:]
print(f"{'commit':<8} {'format':<13} {'ttft_ms':>8}  {'runs (ms)':<26} kv_blocks  record")
for s in trees:
    for fmt in ("smooth_quant", "fp16"):
        path = out / f"bisect_{s}_{fmt}.json"
        if not path.exists():
            if fmt == "smooth_quant":
                print(f"{s:<8} {fmt:<13} {'-':>8}  (no record)")
            continue
        recs = [r for r in json.loads(path.read_text()) if r.get("engine") == "conveyor" and r.get("ttft_ms")]
        ttft = [r["ttft_ms"] for r in recs]
        runs = " ".join(f"{t:.1f}" for t in ttft)
        med = statistics.median(ttft) if ttft else float("nan")
        kv = recs[0].get("kv_blocks") if recs else None
        print(f"{s:<8} {fmt:<13} {med:>8.2f}  {runs:<26} {kv!s:>9}  {path.name}")
EOF
echo "bisect_w8a8_prefill: done in $(($(date +%s) - START)) s" | tee -a "$LOG"
