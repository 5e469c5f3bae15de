#!/usr/bin/env bash
# GPU check of the Pallas attention kernels, sized for one 10-minute run on an H100/H200:
#   1. the kernel tests compiled (not interpreted): PAGEDJAX_PALLAS_INTERPRET=0, JAX on CUDA;
#   2. benchmarks/kernels.py: our ragged and split-K kernels vs JAX's bundled Pallas paged
#      attention and the XLA reference, KV GB/s against a measured copy bandwidth.
# Usage, from the repository root on the GPU machine:
#   OUT=/path/to/results bash benchmarks/gpu_check.sh
# Writes (5 files): env.txt, pytest.log, pytest.xml, bench.log, kernels.json under $OUT.
set -uo pipefail

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
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
# ~25 compiled kernel variants; the CPU suite's tolerances hold for compiled GPU runs too.
timeout 240 "$PY" -m pytest tests/test_pallas_kernels.py -q -p no:cacheprovider \
    --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log" || status=1

# 9 cases x up to 4 implementations; writes kernels.json after every case, so a timeout
# still leaves the finished cases behind.
timeout 300 "$PY" benchmarks/kernels.py --out "$OUT" --iters 20 2>&1 | tee "$OUT/bench.log" \
    || status=1

exit "$status"
