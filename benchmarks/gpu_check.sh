#!/usr/bin/env bash
# One prepared GPU check of the Pallas kernels and of the engine on them, in one device call of
# under 10 minutes (the stages share a 570 s cap; give the call timeout_s=600). From the repo root:
#
#   OUT=$OUT bash benchmarks/gpu_check.sh
#
# Stages (benchmarks/gpu_check.py), each killed at its budget and reported, the next one run:
#   env           versions, nvidia-smi, jax.devices()
#   memory        gpu_memory_utilization=0.9 as the allocator's limit in a fresh process
#   smoke         8 kernel cases compiled, one process each, against the oracle
#   kernel_tests  tests/test_pallas_kernels.py, test_grouped_matmul.py, test_mosaic_decode.py
#                 compiled
#   bench         benchmarks/paged_kernels.py --quick --large-pool: vs JAX's bundled paged attention
#                 and a device copy; the Mosaic GPU decode kernel beside the Triton one
#   engine        a tiny random Llama, Pallas backend, greedy tokens against transformers
#   host          the engine's host cost per decode step at 256 rows, 1 and 8 steps per dispatch,
#                 and a profiler trace of each: device ops per step, idle time, gaps between steps
#   throughput    benchmarks/gpu_throughput.py: offline output tok/s on a random model of
#                 SmolLM2-135M's shape, 256 requests x 128 tokens, against transformers' generate
#   moe           a tiny gpt-oss through the engine vs transformers; benchmarks/moe.py: a mixture
#                 of experts' steps, grouped matmul vs every expert
#   command_buffers  the host stage's 1-step run with XLA's command buffers off, and with loops
#                 captured too (last: it gets what the others leave of the 570 s cap)
# The PASS/FAIL and GB/s table comes last. Under $OUT: env.txt, memory.log, memory.json,
# smoke.json, kernel_tests.log, kernel_tests.xml, bench.log, bench.json, engine.json, host.log,
# host.json, throughput.log, throughput.json, moe.log, moe.json,
# command_buffers_{off,with_loops}.{log,json}, summary.txt.
#
#   OUT=/tmp/gc bash benchmarks/gpu_check.sh --cpu    # dry run on a CPU (CI: test_gpu_check.py)
#   ... gpu_check.sh --only bench,engine --budget bench=300   # some stages, e.g. to rerun
# PYTHON picks the interpreter (default python3). Exit status 0 when every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_check.py --out "${OUT:-$PWD/gpu_check_results}" "$@"
