#!/usr/bin/env bash
# The runs behind docs/benchmarks.md, as made on the device machine (one H100 80GB), from the
# repository root: `bash benchmarks/run_h100.sh STAGE`. STAGE "bench": the engine's benchmarks;
# "extra": the GPU tests, the transformers baseline and the per-kernel profile. Needs the wheels
# of scripts/gpu-wheels.sh in .whl/; CONVEYOR_COMMIT names the commit measured; results land in
# benchmarks/results/h100/ and in $OUT.
set -u
STAGE=${1:-bench}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# The distribution maps top-level folders to conveyor.*; rebuild that layout without installing.
mkdir -p /tmp/pkg/conveyor && cp -r conveyor/* /tmp/pkg/conveyor/
for d in engine kernels protocol services; do ln -sfn "$PWD/$d" "/tmp/pkg/conveyor/$d"; done
ln -sfn "$PWD/benchmarks" /tmp/pkg/benchmarks
REPO=$PWD
# Run from /tmp/pkg: `python -m` puts the working directory first on sys.path, and the repository
# root's own conveyor/ folder (without engine/ etc. inside) would shadow the rebuilt package.
cd /tmp/pkg
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 BENCH_OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"

# The SmolLM2 GPU test, when the GGUF file has been assembled at /tmp/smol.gguf (two halves).
gpu_real_model_test() {
  if [ -f /tmp/smol.gguf ]; then
    timeout 120 python3 -m conveyor.default_model --gguf /tmp/smol.gguf --dest /tmp/smol >/dev/null 2>&1
    CONVEYOR_TEST_MODEL=/tmp/smol CONVEYOR_OFFLINE=1 timeout 150 python3 -m pytest -q -p no:cacheprovider \
      --rootdir "$REPO" -c "$REPO/pyproject.toml" "$REPO/tests/integration/test_gpu_real_model.py" -k "not cpu" 2>&1 | tail -15
  fi
}

if [ "$STAGE" = bench ]; then
  # A quick check that graphs capture and replay; without it, measure eagerly rather than nothing.
  if ! timeout 120 python3 -m benchmarks.profile_generation --model tiny -b 3 -c 16:16 --name smoke_tiny; then
    echo "!!! graph smoke failed: measuring with CONVEYOR_CUDA_GRAPHS=0"; export CONVEYOR_CUDA_GRAPHS=0
  fi
  timeout 170 python3 -m benchmarks.profile_generation --model llama2-7b -b 1 -b 16 -b 32 -b 64 \
    -c 128:128 -c 128:512 -c 2048:1
  timeout 330 python3 -m benchmarks.profile_throughput --model llama2-7b
fi

if [ "$STAGE" = llama3 ]; then
  timeout 120 python3 -m benchmarks.profile_generation --model llama3-8b -b 1 -b 64 -c 128:512 -c 2048:1 -c 128:128
  timeout 180 python3 -m benchmarks.profile_throughput --model llama3-8b
  timeout 100 python3 -m benchmarks.profile_throughput --model llama2-7b --num-prompts 1000 --name profile_throughput_llama2-7b_1000
  timeout 100 python3 -m benchmarks.profile_step --model llama2-7b
fi

if [ "$STAGE" = sharegpt ]; then
  timeout 200 python3 -m benchmarks.profile_throughput --model llama2-7b
  timeout 170 python3 -m benchmarks.profile_throughput --model llama3-8b
fi

# Session 2 (overlapped steps, seeded GPU sampling, per-sequence decode split): the GPU kernel
# tests, then the Llama-2 targets; "overlap2" the real-model GPU test and the Llama-3 shape.
if [ "$STAGE" = overlap1 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml" \
    "$REPO/tests/unit/test_kernels.py" "$REPO/tests/unit/test_sampling_kernel.py" 2>&1 | tail -4
  timeout 90 python3 -m benchmarks.profile_generation --model tiny -b 3 -c 16:16 --name smoke_tiny || exit 1
  timeout 150 python3 -m benchmarks.profile_generation --model llama2-7b -b 1 -b 64 -c 128:512 -c 128:128 -c 2048:1
  timeout 230 python3 -m benchmarks.profile_throughput --model llama2-7b
fi

if [ "$STAGE" = overlap2 ]; then
  gpu_real_model_test
  timeout 150 python3 -m benchmarks.profile_generation --model llama3-8b -b 1 -b 64 -c 128:512 -c 128:128 -c 2048:1
  timeout 200 python3 -m benchmarks.profile_throughput --model llama3-8b
fi

if [ "$STAGE" = extra ]; then
  gpu_real_model_test
  timeout 100 python3 -m benchmarks.profile_step --model llama2-7b
  timeout 220 python3 -m benchmarks.hf_baseline --model llama2-7b
fi
