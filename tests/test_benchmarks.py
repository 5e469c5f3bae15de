"""Every benchmark script runs: its `--smoke` mode, seconds on a tiny workload, in a process of
its own. CI runs no benchmark otherwise, so without this they rot between measurements."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from report import SKIP_EXIT, SMOKE_RESULTS_ENV  # noqa: E402  (benchmarks/ is not a package)

# Modules the scripts import, with no run of their own.
LIBRARIES = {"report", "workloads"}
# Scripts another test runs already.
RUN_ELSEWHERE = {
    "gpu_check": "tests/test_gpu_check.py runs gpu_check.sh's dry run, which runs it",
    "paged_kernels": "gpu_check.sh's dry run (tests/test_gpu_check.py) runs its smoke mode",
    "load_memory": "tests/test_loader.py measures a checkpoint with its functions",
    "moe": "gpu_check.sh's dry run (tests/test_gpu_check.py) runs its smoke mode",
}
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in LIBRARIES)


def _results_snapshot() -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in (BENCHMARKS / "results").glob("*")}


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_smoke_mode_runs(name, tmp_path):
    if name in RUN_ELSEWHERE:
        pytest.skip(RUN_ELSEWHERE[name])
    source = (BENCHMARKS / f"{name}.py").read_text()
    assert "add_smoke_flag" in source, f"benchmarks/{name}.py has no --smoke mode"
    before = _results_snapshot()
    env = dict(os.environ, **{SMOKE_RESULTS_ENV: str(tmp_path)})
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    if proc.returncode == SKIP_EXIT:
        reason = [line for line in proc.stdout.splitlines() if line.startswith("skipped: ")]
        assert reason, f"exit {SKIP_EXIT} without a 'skipped: ' line:\n{output}"
        pytest.skip(f"benchmarks/{name}.py {reason[-1]}")
    assert proc.returncode == 0, f"benchmarks/{name}.py --smoke failed:\n{output}"
    assert proc.stdout.strip(), f"benchmarks/{name}.py --smoke printed nothing"
    assert _results_snapshot() == before, "a smoke run wrote into benchmarks/results/"
    print(f"benchmarks/{name}.py --smoke: {seconds:.1f} s")
