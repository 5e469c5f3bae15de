#!/usr/bin/env bash
# GPU check of the Pallas attention kernels and of the engine on them, in two stages that each
# fit one 10-minute device call (the machine stays warm between the two calls):
#   tests  1. the kernel tests compiled (not interpreted): PAGEDJAX_PALLAS_INTERPRET=0, JAX on
#             CUDA (~25 kernel variants, plus the CUDA lowering tests);
#          2. the engine on the GPU with tiny random models: greedy tokens against transformers
#             and their invariance to block size, chunking, preemption and prefix caching, the
#             Pallas backend against the reference backend, fp8 pools, no compilation after
#             warmup, the pool updated in place, prompt logprobs; the model's logits against
#             transformers at 1e-4 (float32 matmuls, not TF32).
#   bench  benchmarks/kernels.py: our ragged and split-K kernels vs JAX's bundled Pallas paged
#          attention and the XLA reference, KV GB/s against a measured copy bandwidth.
# Usage, from the repository root on the GPU machine:
#   OUT=/path/to/results bash benchmarks/gpu_check.sh tests   # then: ... gpu_check.sh bench
# Writes under $OUT: env.txt; tests: kernels.log/.xml, engine.log/.xml; bench: bench.log,
# kernels.json (rewritten after every case, so a timeout leaves the finished cases).
set -uo pipefail

STAGE=${1:-all}
OUT=${OUT:-$PWD/gpu_check_results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export JAX_PLATFORMS=cuda  # tests/conftest.py defaults JAX to the CPU otherwise
export PAGEDJAX_PALLAS_INTERPRET=0
export TF_CPP_MIN_LOG_LEVEL=1

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PY" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())'
    "$PY" -m pip list 2>/dev/null | grep -i -E '^(jax|jaxlib|jax-cuda|triton|torch|transformers|safetensors|numpy) '
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
pytest_stage() {  # name, timeout in seconds, pytest arguments...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$PY" -m pytest -q -p no:cacheprovider -m 'not slow' \
        --junitxml="$OUT/$name.xml" "$@" 2>&1 | tee "$OUT/$name.log" || status=1
}

if [[ $STAGE == tests || $STAGE == all ]]; then
    pytest_stage kernels 240 tests/test_pallas_kernels.py
    pytest_stage engine 240 tests/test_model_parity.py tests/test_engine.py \
        -k 'greedy or pallas or fp8 or compiles_nothing or transformers or ask_for_float32 or donated_pool'
fi

if [[ $STAGE == bench || $STAGE == all ]]; then
    # 9 cases x up to 4 implementations, plus 3-stage tuning variants on the 5 bf16 cases.
    timeout 420 "$PY" benchmarks/kernels.py --out "$OUT" --iters 20 2>&1 | tee "$OUT/bench.log" \
        || status=1
fi

exit "$status"
