"""benchmarks/gpu_check.sh, the one prepared GPU check: its dry run on the CPU (so the script
cannot rot between the rare GPU sessions) and how it reports children that fail, hang or crash."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402  (imports no JAX: the driver only starts processes)

FILES = {"env.txt", "memory.log", "memory.json", "smoke.json", "kernel_tests.log",
         "kernel_tests.xml", "bench.log", "bench.json", "engine.json", "host.log", "host.json",
         "throughput.log", "throughput.json", "moe.log", "moe.json",
         "command_buffers_with_loops.log", "command_buffers_with_loops.json",
         "summary.txt"}  # fmt: skip


@pytest.mark.parametrize(
    "code,status",
    [
        ("pass", "PASS"),
        ("raise SystemExit(3)", "FAIL"),
        ("import time; time.sleep(60)", "TIMEOUT"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "CRASH(SIGSEGV)"),
    ],
)
def test_a_child_is_reported_and_never_outlives_its_limit(tmp_path, code, status):
    log = tmp_path / "log"
    got, _, seconds = gpu_check.run_child([sys.executable, "-c", code], 2, log, dict(os.environ))
    assert got == status and seconds < 10


@pytest.mark.skipif(not shutil.which("timeout"), reason="GNU timeout")
def test_gnu_timeout_around_a_child_reads_as_timeout(tmp_path):
    cmd = ["timeout", "--signal=INT", "1", sys.executable, "-c", "import time; time.sleep(60)"]
    assert gpu_check.run_child(cmd, 10, tmp_path / "log", dict(os.environ))[0] == "TIMEOUT"


@pytest.mark.slow
def test_cpu_dry_run_runs_every_stage_and_prints_the_table_last(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert {p.name for p in tmp_path.iterdir()} == FILES, proc.stdout[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.stdout.rstrip().endswith(summary.rstrip())  # the table comes last
    assert proc.stdout.rstrip().endswith("OVERALL: PASS"), proc.stdout[-3000:]
    assert proc.returncode == 0
    smoke = json.loads((tmp_path / "smoke.json").read_text())
    assert set(smoke) == set(gpu_check.SMOKE_CASES_CPU) <= set(gpu_check.SMOKE_CASES)
    assert all(case["status"] == "PASS" for case in smoke.values())
    for stage in gpu_check.STAGES:
        assert any(line.startswith(f"{stage} ") and " PASS " in line
                   for line in summary.splitlines()), stage  # fmt: skip
    assert "pallas_split_k" in summary and "GB/s" in summary
    assert json.loads((tmp_path / "memory.json").read_text())["xla_client_mem_fraction"] == "0.9"
    host = json.loads((tmp_path / "host.json").read_text())
    assert host["k1_async_on_trace_device_ops_per_step"] > 0  # the trace saw the device's ops
    assert "device ops" in summary and "with_loops: k1" in summary
    engine = json.loads((tmp_path / "engine.json").read_text())
    assert engine["token_identical"] and engine["attention_backend"] == "pallas"
    throughput = json.loads((tmp_path / "throughput.json").read_text())
    assert throughput["engine_output_tok_per_s"] > 0 and throughput["engine_over_peer"] > 0


def test_the_bench_table_flags_wrong_results_and_reads_the_targets(tmp_path):
    timing = dict(us=100.0, kv_gb_per_s=3500.0, fraction_of_copy_bw=0.82)
    report = {
        "device": "NVIDIA H200",
        "copy_bandwidth_gb_per_s": 4300.0,
        "cases": [
            {
                "case": "decode_64x2k",
                "kv_dtype": "bfloat16",
                "timings": {
                    "pallas_split_k": timing,
                    "pallas_ragged": dict(timing, us=150.0),
                    "jax_bundled_paged_attention": dict(timing, us=160.0),
                },
                "max_abs_error_vs_reference": {"pallas_split_k": 4e-3, "pallas_ragged": 0.5},
            },
            {
                "case": "large_pool_bf16_6g",
                "kv_dtype": "bfloat16",
                "timings": {"pallas_split_k": dict(timing, finite=False)},
            },
            {"case": "large_pool_fp8_6g", "kv_dtype": "float8_e4m3fn", "timings": {},
             "skipped": "needs a GPU with 14 GiB free"},
        ],
    }  # fmt: skip
    args = SimpleNamespace(cpu=False, out=tmp_path, budget=[], only="bench")
    check = gpu_check.Check(args)
    check.results["bench"] = dict(status="PASS", seconds=1.0, detail="", report=report)
    table = check.summary()
    shutil.rmtree(check.scratch)
    assert "82% of copy bandwidth (>= 80%: MET), 1.60x JAX's bundled kernel (>= 1.5x: MET)" in table
    assert "ERR 0.5 > 0.1" in table and "NOT FINITE" in table and "skipped: needs" in table
