"""Every benchmark script runs: its `--smoke` mode, seconds on a tiny workload, in a process of
its own. CI runs no benchmark otherwise, so without this they rot between measurements."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from report import SKIP_EXIT, SMOKE_RESULTS_ENV  # noqa: E402  (benchmarks/ is not a package)

# Modules the scripts import, with no run of their own.
LIBRARIES = {"report", "workloads", "llamacpp_peer", "trace_summary", "kernel_baseline"}
# Scripts another test runs already.
RUN_ELSEWHERE = {
    "gpu_check": "tests/test_gpu_check.py runs gpu_check.sh's dry run, which runs it",
    "gpu_throughput": "gpu_check.sh's dry run (tests/test_gpu_check.py) runs its smoke mode",
    "paged_kernels": "gpu_check.sh's dry run (tests/test_gpu_check.py) runs its smoke mode",
    "load_memory": "tests/test_loader.py measures a checkpoint with its functions",
    "moe": "gpu_check.sh's dry run (tests/test_gpu_check.py) runs its smoke mode",
}
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in LIBRARIES)


def _results_snapshot() -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in (BENCHMARKS / "results").glob("*")}


# Smoke runs at once: each is mostly one core's work (imports, a small model), and CI has two.
CONCURRENT_RUNS = 2


@dataclass(frozen=True)
class SmokeRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _smoke_run(name: str, results: Path) -> SmokeRun:
    env = dict(os.environ, **{SMOKE_RESULTS_ENV: str(results / name)})
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return SmokeRun(proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start)


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """Every script's smoke run, started together, CONCURRENT_RUNS at a time: name -> its
    future; and the results directory's snapshot from before any ran."""
    before = _results_snapshot()
    results = tmp_path_factory.mktemp("smoke_results")
    with ThreadPoolExecutor(CONCURRENT_RUNS) as pool:
        futures = {
            name: pool.submit(_smoke_run, name, results)
            for name in SCRIPTS
            if name not in RUN_ELSEWHERE
        }
        yield futures, before
        for future in futures.values():
            future.cancel()


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_smoke_mode_runs(name, smoke_runs):
    if name in RUN_ELSEWHERE:
        pytest.skip(RUN_ELSEWHERE[name])
    source = (BENCHMARKS / f"{name}.py").read_text()
    assert "add_smoke_flag" in source, f"benchmarks/{name}.py has no --smoke mode"
    futures, before = smoke_runs
    run = futures[name].result()
    output = run.stdout[-4000:] + run.stderr[-4000:]
    if run.returncode == SKIP_EXIT:
        reason = [line for line in run.stdout.splitlines() if line.startswith("skipped: ")]
        assert reason, f"exit {SKIP_EXIT} without a 'skipped: ' line:\n{output}"
        pytest.skip(f"benchmarks/{name}.py {reason[-1]}")
    assert run.returncode == 0, f"benchmarks/{name}.py --smoke failed:\n{output}"
    assert run.stdout.strip(), f"benchmarks/{name}.py --smoke printed nothing"
    assert _results_snapshot() == before, "a smoke run wrote into benchmarks/results/"
    print(f"benchmarks/{name}.py --smoke: {run.seconds:.1f} s")
