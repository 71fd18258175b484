#!/usr/bin/env bash
# The runs behind docs/benchmarks.md, as made on the device machine (one H200), from the
# repository root: `bash benchmarks/run_h200.sh STAGE`. Needs the wheels of
# ../shared/scripts/gpu-wheels.sh in .whl/ (carried), plus `gpu-wheels.sh fastapi-offline` (the
# ingress serves /docs from it; not in the script's default list). The package is installed (editable, no
# dependencies: the image has torch, triton and transformers); results land in
# benchmarks/results/h200/ and in $OUT. CONVEYOR_COMMIT names the commit measured.
#
# STAGE "tests": the GPU kernel tests (the dense and LoRA ones) and, when /tmp/smol.gguf is there,
#   the real-model GPU test.
#   The GGUF (98 MB) is over a call's 64 MiB (the tracked files, ~7 MB, and .whl, ~9 MB, count
#   too): split it here into two ignored folders (`head -c 44000000 G > .diag/gguf_a/p` and
#   `tail -c +44000001 G > .diag/gguf_b/p`, G = ~/.cache/conveyor/SmolLM2-135M-Instruct.gguf),
#   carry .whl and the first and `cp .diag/gguf_a/p /tmp/smol_a`, then at once (the machine stays
#   warm ~30 s; /tmp/site from the first call serves the second) carry the second alone and
#   `cat /tmp/smol_a .diag/gguf_b/p > /tmp/smol.gguf` before this stage.
# STAGE "ab BEFORE_DIR": batch-1 decode and the ShareGPT-shaped workload for the tree in
#   BEFORE_DIR (an older commit, run the way that commit's own run_h100.sh ran it) and for this
#   tree, alternating, in one call: a before/after comparison free of machine-to-machine spread.
#   AB_PART=gen|sharegpt picks one; AB_PROMPTS the ShareGPT requests; AB_TP=2 runs ShareGPT at
#   tp=2. BEFORE_DIR must travel: `git worktree add .diag/before <commit>`, carry ".diag".
#   ShareGPT runs in AB_PAIRS pairs (default 2: before, after, after, before; records
#   ab_{before,after}_sharegpt, then _2, _3, ...) and ends with each pair's after/before ratio and
#   their median (benchmarks/ab_summary.py; run it on the returned records of a call cut short).
#   Each run is cut at 280 s and a device call at 10 minutes: for several pairs, AB_PART=sharegpt
#   and, if that is still too long, fewer AB_PROMPTS.
# STAGE "tp BEFORE_DIR" / "tp2": tensor parallel (see their blocks below; tp2 packs its output into $OUT/tp2.tgz).
# STAGE "bench": this tree's Llama-2-7B grid and ShareGPT run.
# STAGE "served": offline against served throughput (see its block below).
# STAGE "quant": the W4A16/W8A8 kernel tests and microbenchmarks, then Llama-2-7B fp16 and AWQ
#   (random 4-bit weights), W8A8 (random int8 weights) generation in the same call, fp16 first and last.
# STAGE "issue35": issue 35's whole table in one call (see its block below).
set -u
STAGE=${1:-bench}
REPO=$PWD
source "$REPO/benchmarks/tree_package.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 BENCH_OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"

pytest_here() { timeout "$1" python3 -m pytest -q -p no:cacheprovider "${@:2}" 2>&1 | tail -15; }

if [ "$STAGE" = tests ]; then
  pytest_here 300 tests/unit/test_kernels.py tests/unit/test_sampling_kernel.py tests/unit/test_rotary.py
  pytest_here 200 -m gpu tests/unit/test_kernels_lora.py  # the one-row GEMV's LoRA epilogue among them
  if [ -f /tmp/smol.gguf ]; then
    timeout 120 python3 -m conveyor.default_model --gguf /tmp/smol.gguf --dest /tmp/smol >/dev/null 2>&1
    CONVEYOR_TEST_MODEL=/tmp/smol CONVEYOR_OFFLINE=1 pytest_here 200 tests/integration/test_gpu_real_model.py
  fi
fi

if [ "$STAGE" = ab ]; then
  tree_package "$2" /tmp/pkg_before || exit 1
  before() { (cd /tmp/pkg_before && CONVEYOR_COMMIT=${BEFORE_COMMIT:-before} PYTHONPATH=/tmp/pkg_before:/tmp/site \
               BENCH_OUT=$BENCH_OUT/before timeout "$1" python3 -m "${@:2}"); }
  after() { (CONVEYOR_COMMIT=${CONVEYOR_COMMIT:-after} BENCH_OUT=$BENCH_OUT/after timeout "$1" python3 -m "${@:2}"); }
  GEN="benchmarks.profile_generation --model llama2-7b -b 1 -c 128:512"
  # AB_TP=2 (kind nvidia-h200-x2): both trees at tensor parallel 2, NVLink multicast off.
  TPUT="benchmarks.profile_throughput --model llama2-7b --num-prompts ${AB_PROMPTS:-3000} ${AB_TP:+--tp $AB_TP}"
  [ -z "${AB_TP:-}" ] || export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  case ${AB_PART:-all} in
    gen|all) before 120 $GEN --name ab_before_gen; after 120 $GEN --name ab_after_gen
             after 120 $GEN --name ab_after_gen2; before 120 $GEN --name ab_before_gen2 ;;
  esac
  case ${AB_PART:-all} in
    sharegpt|all)
      B=(); A=()
      for i in $(seq "${AB_PAIRS:-2}"); do
        s=""; [ "$i" = 1 ] || s="_$i"
        if [ $((i % 2)) = 1 ]; then  # ABBA: a machine warming or cooling during the call cancels out
          before 280 $TPUT --name ab_before_sharegpt$s; after 280 $TPUT --name ab_after_sharegpt$s
        else
          after 280 $TPUT --name ab_after_sharegpt$s; before 280 $TPUT --name ab_before_sharegpt$s
        fi
        B+=("$BENCH_OUT/before/ab_before_sharegpt$s.json"); A+=("$BENCH_OUT/after/ab_after_sharegpt$s.json")
      done
      python3 -m benchmarks.ab_summary --before "${B[@]}" --after "${A[@]}" ;;
  esac
fi

if [ "$STAGE" = bench ]; then
  timeout 170 python3 -m benchmarks.profile_generation --model llama2-7b -b 1 -b 64 -c 128:128 -c 128:512 -c 2048:1
  timeout 330 python3 -m benchmarks.profile_throughput --model llama2-7b
fi

if [ "$STAGE" = quant ]; then
  pytest_here 400 tests/unit/test_kernels_w4a16.py tests/unit/test_kernels_w8a8.py
  timeout 200 python3 -m benchmarks.bench_w4a16 ${QUICK:+--quick} --out "$BENCH_OUT/bench_w4a16.json"
  timeout 200 python3 -m benchmarks.bench_w8a8 ${QUICK:+--quick} --out "$BENCH_OUT/bench_w8a8.json"
  GEN="benchmarks.profile_generation --model llama2-7b -b 1 -b 64 -c 128:512 -c 128:128 -c 2048:1"
  timeout 200 python3 -m $GEN --name quant_fp16
  timeout 200 python3 -m $GEN --model-format awq --name quant_awq
  timeout 200 python3 -m $GEN --model-format smooth_quant --name quant_w8a8
  timeout 200 python3 -m $GEN --name quant_fp16_last
fi

# STAGE "issue35": issue 35's table in one call, each case as its row was made: fp16, AWQ and
#   W8A8 generation (batch 1 128/512, batch 64 128/128, a 2048-token first token), then the
#   ShareGPT-shaped workload with the fp16 KV cache (max batch 256), int8 and int4 (max batch
#   1,024); records issue35_table_*. ~9 minutes; a case that would start past 540 s is skipped
#   and says so (run the rest in a second call with ISSUE35_SKIP="gen").
if [ "$STAGE" = issue35 ]; then
  SECONDS=0
  left() { [ $SECONDS -lt 540 ] || { echo "issue35: $1 skipped at ${SECONDS}s (device call limit)"; return 1; }; }
  if [[ " ${ISSUE35_SKIP:-} " != *" gen "* ]]; then
    GEN="benchmarks.profile_generation --model llama2-7b"
    left fp16 && timeout 150 python3 -m $GEN -b 1 -b 64 -c 128:512 -c 128:128 -c 2048:1 --name issue35_table_fp16
    left awq && timeout 120 python3 -m $GEN --model-format awq -b 1 -b 64 -c 128:512 -c 128:128 --name issue35_table_awq
    left w8a8 && timeout 90 python3 -m $GEN --model-format smooth_quant -b 1 -c 2048:1 --name issue35_table_w8a8
  fi
  for case in 0:256 8:1024 4:1024; do
    p=${case%%:*}; b=${case##*:}
    left "sharegpt p$p" && timeout 200 python3 -m benchmarks.profile_throughput --model llama2-7b \
      --quant-policy "$p" --max-batch-size "$b" --name "issue35_table_sharegpt_p${p}_b${b}"
  done
  echo "issue35: ${SECONDS}s"
fi

# STAGE "w8a8": the W8A8 engine and kernel tests on the GPU, then Llama-2-7B generation in the formats
#   of $FORMATS (default: fp16 smooth_quant), each a record file quant_<format>.
if [ "$STAGE" = w8a8 ]; then
  [ -n "${SKIP_TESTS:-}" ] || pytest_here 200 tests/unit/test_w8a8_engine.py tests/unit/test_kernels_w8a8.py
  GEN="benchmarks.profile_generation --model llama2-7b -b 1 -b 64 -c 128:512 -c 128:128 -c 2048:1"
  declare -A seen=()
  for fmt in ${FORMATS:-fp16 smooth_quant}; do
    start=$(date +%s)
    seen[$fmt]=$(( ${seen[$fmt]:-0} + 1 ))
    name=quant_${fmt}${SUFFIX:-}; [ "${seen[$fmt]}" = 1 ] || name=${name}_${seen[$fmt]}  # repeats: _2, _3
    if [ "$fmt" = fp16 ]; then timeout 170 python3 -m $GEN --name "$name"
    else timeout 170 python3 -m $GEN --model-format "$fmt" --name "$name"; fi
    echo "$fmt: $(( $(date +%s) - start )) s"
  done
fi

# STAGE "kvq": the quantized KV cache (issue 12). Unless SKIP_TESTS: its GPU kernel tests and the
#   attention/cache kernel tests. Then, for each POLICY:MAX_BATCH_SIZE of $KVQ_TPUT (default
#   "0:256 8:256 4:256"; set but empty: none), the ShareGPT-shaped workload ($KVQ_PROMPTS prompts,
#   default all 3000), each a record file kvq_sharegpt_p<policy>_b<mbs> (a case given again, for
#   alternated runs, adds _2, _3); and, unless SKIP_GEN, generation (batch 1
#   128/512, batch 64 128/512) for each policy of $KVQ_GEN (default "0 8 4"), kvq_gen_p<policy>.
#   KVQ_PROFILE=START:COUNT profiles those steps of each ShareGPT run (profile_throughput --profile).
if [ "$STAGE" = kvq ]; then
  [ -n "${SKIP_TESTS:-}" ] || pytest_here 300 tests/unit/test_kernels_kv_quant.py tests/unit/test_kernels.py
  if [ -z "${SKIP_GEN:-}" ]; then
    for p in ${KVQ_GEN:-0 8 4}; do
      timeout 150 python3 -m benchmarks.profile_generation --model llama2-7b -b 1 -b 64 -c 128:512 \
        --quant-policy "$p" --name "kvq_gen_p$p"
    done
  fi
  declare -A runs=()  # a case given twice (alternated runs) saves its second record as ..._2
  for case in ${KVQ_TPUT-0:256 8:256 4:256}; do
    p=${case%%:*}; b=${case##*:}; runs[$case]=$(( ${runs[$case]:-0} + 1 ))
    suffix=""; [ "${runs[$case]}" = 1 ] || suffix="_${runs[$case]}"
    timeout 330 python3 -m benchmarks.profile_throughput --model llama2-7b ${KVQ_PROMPTS:+--num-prompts $KVQ_PROMPTS} \
      --quant-policy "$p" --max-batch-size "$b" ${KVQ_PROFILE:+--profile $KVQ_PROFILE} --name "kvq_sharegpt_p${p}_b${b}$suffix"
  done
fi

# STAGE "tp BEFORE_DIR": tensor parallel (issue 13) on the GPUs of this machine. Unless SKIP_TESTS:
#   the tensor-parallel tests (on one GPU: the NCCL path at world size 1 inside the decode graphs).
#   bench_tp_comm (all-reduce at decode sizes over every visible GPU, and the step plan's cost).
#   Then tp=1 generation (batch 1 and 64, 128/512) of the tree in BEFORE_DIR (the commit before
#   tensor parallel), of this tree, and of this tree with --process-group (a world-size-1 NCCL
#   group: every collective runs), alternating, names tp1_{before,after,nccl1}[2]. With TP_SIZES
#   (e.g. "2"): the same generation at those tp sizes, tp<N>_gen.
if [ "$STAGE" = tp ]; then
  [ -n "${SKIP_TESTS:-}" ] || pytest_here 200 tests/unit/test_tensor_parallel.py
  timeout 150 python3 -m benchmarks.bench_tp_comm
  GEN="benchmarks.profile_generation --model llama2-7b -b 1 -b 64 -c 128:512"
  if [ -n "${2:-}" ]; then
    tree_package "$2" /tmp/pkg_before || exit 1
    before() { (cd /tmp/pkg_before && CONVEYOR_COMMIT=${BEFORE_COMMIT:-before} PYTHONPATH=/tmp/pkg_before:/tmp/site \
                 timeout 150 python3 -m $GEN --name "$1"); }
    before tp1_before
    timeout 150 python3 -m $GEN --name tp1_after
    timeout 150 python3 -m $GEN --process-group --name tp1_nccl1
    timeout 150 python3 -m $GEN --name tp1_after2
    before tp1_before2
  fi
  for n in ${TP_SIZES:-}; do
    timeout 300 python3 -m $GEN --tp "$n" --name "tp${n}_gen"
  done
fi

# STAGE "tp2": issue 15 on a machine of two GPUs (kind nvidia-h200-x2). Each part writes its
#   output to a log and its records under /tmp/tp2, and after each part everything is packed into
#   $OUT/tp2.tgz (the device returns at most 8 files a call, and a part cut off by its timeout
#   loses nothing before it). Parts, in order (TP2_PARTS, default "comm gen check", ~350 s when
#   nothing hangs; "sharegpt 70b tests" fit a second call):
#   comm: the all-reduce across both GPUs (NCCL, the peer paths, and the fused all-reduce + norm
#     against NCCL + add_rms_norm, per batch) and the step plan;
#   gen: Llama-2-7B batch 1 and 64, 128/512 and 128/128, at tp=1, tp=2 with each all-reduce path
#     in $TP2_ALLREDUCE (default "nccl fused"), then tp=1 again, one process a run (the engine's
#     start-up, not the cases, is most of a run's time; records tp<N>_<path>);
#   check: a Llama-2-7B-shape checkpoint cut to 4 layers, tp=2 (NCCL, then fused) against tp=1 on
#     the same weights;
#   tests: the two-GPU tests (exits, SIGTERM, fused against NCCL; the tokenizer of $TP2_TOKENIZER,
#     default models/tokenizer, ignored by git: carry it; `cp $(python -m conveyor.default_model)/{tokenizer.json,
#     tokenizer_config.json,config.json} models/tokenizer/`) and
#     the tensor-parallel tests (the GPU ones at world size 1);
#   sharegpt: the ShareGPT-shaped workload's first $TP2_PROMPTS (500) requests at the tp sizes of
#     $TP2_SHAREGPT_RUNS (default "1 2 1 2"; tp=2 on $TP2_SHAREGPT_PATH, default fused), each with every rank's step times (wait, host,
#     GPU; engine/rank_timing.py) and the engine's Python stacks (--stack-samples);
#   profile: a batch-1 and batch-64 decode step from its graph, kernel by kernel, at tp=1 and tp=2
#     (rank 0's GPU; benchmarks/profile_step.py);
#   70b: Llama-2-70B shape (too big for one GPU) with each path in $TP2_ALLREDUCE.
if [ "$STAGE" = tp2 ]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device notes
  W=/tmp/tp2; mkdir -p $W; export BENCH_OUT=$W
  part() {  # part NAME TIMEOUT COMMAND...: run, log, print the log's tail, pack
    local name=$1 t=$2; shift 2; local s=$(date +%s)
    timeout "$t" "$@" > "$W/$name.log" 2>&1; echo "== $name: rc=$? in $(( $(date +%s) - s )) s"
    grep -v -E "^\s*$|Warning|warn\(" "$W/$name.log" | tail -${TAIL:-12}
    tar czf "${OUT:-/tmp/out}/tp2.tgz" -C $W .
  }
  path_at() { [ "$1" = 2 ] && echo "${TP2_SHAREGPT_PATH:-fused}" || echo nccl; }  # the all-reduce path at tp=$1
  # bf16 (TP2_DTYPE): the one_shot / two_shot peer paths refuse fp16, which torch's kernels lack.
  G="python3 -m benchmarks.profile_generation --model llama2-7b --dtype ${TP2_DTYPE:-bfloat16}"
  for p in ${TP2_PARTS:-comm gen check}; do case $p in
    comm) part comm 150 python3 -m benchmarks.bench_tp_comm --world 2 ;;
    gen) for run in 1:nccl $(for k in ${TP2_ALLREDUCE:-nccl fused}; do echo 2:$k; done) 1:nccl_again; do
           tp=${run%%:*}; k=${run##*:}
           part gen_tp${tp}_${k} 150 $G -b 1 -b 64 -c 128:512 -c 128:128 --tp $tp --tp-all-reduce ${k%_again} \
             --name tp${tp}_${k}
         done ;;
    check) part check 150 python3 -m benchmarks.tp_correctness --model llama2-7b --layers 4 --tp 2
           part check_fused 150 python3 -m benchmarks.tp_correctness --model llama2-7b --layers 4 --tp 2 \
             --tp-all-reduce fused ;;
    tests) part tests_2gpu 560 env CONVEYOR_TEST_MODEL="$(cd "${TP2_TOKENIZER:-models/tokenizer}" && pwd)" CONVEYOR_OFFLINE=1 \
             python3 -m pytest -q -p no:cacheprovider tests/integration/test_tp_two_gpus.py
           part tests 200 python3 -m pytest -q -p no:cacheprovider tests/unit/test_tensor_parallel.py ;;
    sharegpt) for tp in ${TP2_SHAREGPT_RUNS:-1 2 1 2}; do  # fp16, as the single-GPU table; tp=2 on $TP2_SHAREGPT_PATH (default fused)
                k=$(path_at $tp); n=$((${n:-0} + 1))
                part sharegpt_tp${tp}_$n 150 python3 -m benchmarks.profile_throughput --model llama2-7b \
                  --num-prompts ${TP2_PROMPTS:-500} --tp $tp --tp-all-reduce $k --rank-timing $W/rank_timing_tp${tp}_$n \
                  --stack-samples $W/stacks_tp${tp}_$n --name tp${tp}_${k}_sharegpt_$n
              done ;;
    profile) for tp in 1 2; do  # where a decode step goes on rank 0's GPU, from its graph
               part profile_tp$tp 150 python3 -m benchmarks.profile_step --model llama2-7b --dtype bfloat16 --decode-only \
                 --tp $tp --tp-all-reduce $(path_at $tp)
             done ;;
    70b) for k in ${TP2_ALLREDUCE:-nccl fused}; do
           part 70b_$k 250 python3 -m benchmarks.profile_generation --model llama2-70b --tp 2 -b 1 -b 64 -c 128:512 \
             --tp-all-reduce $k --name tp2_${k}_llama2_70b
         done ;;
  esac; done
fi

# STAGE "served": issue 14, part 4. The ShareGPT-shaped workload offline (profile_throughput,
#   record served_offline) and through `conveyor serve api_server --dummy-weights llama2-7b`
#   (profile_restful_api, records served_api_w<N>; $SERVED_MODEL is another shape): the same random token ids, max_tokens and
#   ignore_eos, all requests at t=0 (SERVED_CONCURRENCY caps the open ones), streamed, max batch
#   $SERVED_BATCH (256); $SERVED_PROMPTS prompts (default all 3000). The tokenizer comes from
#   $SERVED_TOKENIZER (default models/tokenizer, ignored by git: carry it; the default model's
#   tokenizer files, `cp $(python -m conveyor.default_model)/{tokenizer.json,tokenizer_config.json} models/tokenizer/`).
#   Prints served/offline out tok/s (target >= 0.95) and each stage's CPU per request.
if [ "$STAGE" = served ]; then
  B=${SERVED_BATCH:-256}; TOK=${SERVED_TOKENIZER:-models/tokenizer}; M=${SERVED_MODEL:-llama2-7b}; PORT=23333
  [ -f "$TOK/tokenizer.json" ] || { echo "served: no tokenizer in $TOK (SERVED_TOKENIZER)"; exit 1; }
  ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"  # every request is a connection, at both ends
  timeout 330 python3 -m benchmarks.profile_throughput --model "$M" --max-batch-size "$B" \
    ${SERVED_PROMPTS:+--num-prompts $SERVED_PROMPTS} --name served_offline
  # The engine is timed step by step as offline (benchmarks/timed_engine.py: steps, GPU busy, a
  # timeline of running/waiting) and every stage process samples its stacks (services/stack_sampler.py).
  # One fresh server per client setting in $SERVED_WORKERS (client processes; default 4): records
  # served_api_w<N>.json, served_engine_timeline_w<N>.json, served_stacks_w<N>/.
  for W in ${SERVED_WORKERS:-4}; do
    CONVEYOR_STACK_SAMPLES=$BENCH_OUT/served_stacks_w$W CONVEYOR_ENGINE_TIMELINE=$BENCH_OUT/served_engine_timeline_w$W.json \
      python3 -m conveyor.testing.serve api_server "$TOK" --dummy-weights "$M" --max-batch-size "$B" --server-name 127.0.0.1 \
      --server-port $PORT --max-queued-requests 8192 --max-connections 8192 --engine-factory benchmarks.timed_engine:build \
      --log-level WARNING > "$BENCH_OUT/served_server_w$W.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 150); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 2; done
    timeout 400 python3 -m benchmarks.profile_restful_api --port $PORT --server-pid $SERVER --batch "$B" \
      --precision float16 ${SERVED_PROMPTS:+--num-prompts $SERVED_PROMPTS} --workers $W \
      ${SERVED_CONCURRENCY:+--max-concurrency $SERVED_CONCURRENCY} --name served_api_w$W | grep -E "wall_s|out_tok_s|saved"
    kill -TERM $SERVER; wait $SERVER
    python3 -m benchmarks.stack_summary "$BENCH_OUT/served_stacks_w$W" --top 25 > "$BENCH_OUT/served_stacks_w$W.txt"
  done
  python3 - "$BENCH_OUT" ${SERVED_WORKERS:-4} <<'PY'
import json, sys
out = sys.argv[1]
off = json.load(open(f"{out}/served_offline.json"))[0]
print(f"offline: {off['out_tok_s']:.0f} out tok/s, {off['steps']} steps, GPU busy {off['gpu_busy_s']:.1f} s of {off['wall_s']:.1f}")
for w in sys.argv[2:]:
    api = json.load(open(f"{out}/served_api_w{w}.json"))[0]
    tl = json.load(open(f"{out}/served_engine_timeline_w{w}.json"))
    c = api["client_cpu"]
    print(f"served, {w} client processes: {api['out_tok_s']:.0f} out tok/s = {api['out_tok_s'] / off['out_tok_s']:.3f} "
          f"of offline (target 0.95); errors {api['errors']}, short {api['short']}; mean TTFT {api['ttft_ms']:.0f} ms, "
          f"TPOT {api['tpot_ms']:.1f} ms; clients used {c['cores_mean']:.2f} cores, the busiest {c['cores_busiest_process']:.2f}")
    print(f"  engine: {tl['steps']} steps, GPU busy {tl['gpu_busy_s']:.1f} s over a {tl['gpu_span_s']:.1f} s span; first step "
          f"{tl['first_step_monotonic'] - c['start_monotonic']:.1f} s after the clients started, the last "
          f"{c['start_monotonic'] + api['wall_s'] - tl['last_step_monotonic']:.1f} s before the last reply")
    for stage, s in (api["stage_cpu"] or {}).items():
        print(f"  {stage:12s} {s['processes']} process(es): {s['cpu_ms_per_request']:.2f} CPU ms/request, "
              f"{s['cores_mean']:.2f} cores mean, busiest process {s['cores_peak_one_process']:.2f} cores")
PY
fi
