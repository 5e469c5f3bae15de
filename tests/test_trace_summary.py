"""benchmarks/trace_summary.py: a profiler trace of engine steps read into device ops, busy and
idle time and the gaps between steps (what `host_overhead.py --trace` and gpu_check report)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from trace_summary import STEP, load_trace, step_trace, summarise  # noqa: E402


def _op(pid: int, ts: float, dur: float, module: str = "jit_forward_step") -> dict:
    return {"ph": "X", "pid": pid, "tid": 1, "ts": ts, "dur": dur, "name": "fusion",
            "args": {"hlo_op": "fusion", "hlo_module": module}}  # fmt: skip


def _gpu_trace() -> list[dict]:
    """Two steps on a GPU's stream lane (pid 2, tid 1): three kernels each, 100 us apart; the
    host (pid 1) has the step marks and an event that names an op too (a launch), and the
    GPU's derived "XLA Ops" lane (tid 2) repeats a kernel: neither is counted."""
    names = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 1, "name": "thread_name",
         "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 2, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]  # fmt: skip
    host = [
        {"ph": "X", "pid": 1, "tid": 7, "ts": 0.0, "dur": 40.0, "name": STEP},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 150.0, "dur": 60.0, "name": STEP},
        _op(1, 5.0, 3.0),  # the launch, on the host
        {**_op(2, 10.0, 20.0), "tid": 2},  # the derived lane's copy of the first kernel
    ]
    device = [_op(2, 10.0, 20.0), _op(2, 30.0, 20.0), _op(2, 45.0, 15.0, "jit_sample")]
    device += [_op(2, 160.0, 20.0), _op(2, 180.0, 20.0), _op(2, 200.0, 10.0, "jit_sample")]
    return names + host + device


def test_a_gpu_trace_counts_the_cards_ops_and_the_gap_between_steps():
    summary = summarise(_gpu_trace(), num_steps=2)
    assert summary["device_ops_per_step"] == 3  # neither the launch nor the derived lane
    # Busy: 10-60 (overlapping kernels merged) and 160-210: 100 us over 2 steps.
    assert summary["device_busy_ms_per_step"] == pytest.approx(0.050)
    assert summary["device_idle_ms_per_step"] == pytest.approx(0.050)  # 60-160, halved
    assert summary["device_idle_share"] == pytest.approx(0.5)
    assert summary["step_gap_ms_median"] == pytest.approx(0.100)
    assert summary["host_ms_per_step_median"] == pytest.approx(0.050)
    assert summary["marked_steps"] == 2
    forward = summary["modules"]["jit_forward_step"]
    assert forward["ops_per_step"] == 2 and forward["ms_per_step"] == pytest.approx(0.040)
    assert list(summary["modules"]) == ["jit_forward_step", "jit_sample"]  # the costliest first


def test_a_trace_without_device_ops_is_an_error():
    with pytest.raises(ValueError, match="no device ops"):
        summarise(_gpu_trace()[:8], num_steps=2)  # the names, the host, the derived lane


def test_a_real_cpu_trace_of_marked_steps(tmp_path):
    step = jax.jit(lambda x: jnp.tanh(x @ x) + 1.0)
    x = jnp.ones((64, 64))
    step(x).block_until_ready()
    with step_trace(tmp_path) as mark:
        for _ in range(3):
            with mark():
                step(x).block_until_ready()
    summary = summarise(load_trace(tmp_path), num_steps=3)
    assert summary["marked_steps"] == 3
    assert summary["device_ops_per_step"] >= 1
    assert any("jit" in name for name in summary["modules"])
    assert 0 < summary["device_busy_ms_per_step"] <= summary["host_ms_per_step_median"]


def test_a_gpu_trace_without_stream_lanes_counts_every_gpu_event():
    events = [e for e in _gpu_trace() if e.get("name") != "thread_name"]
    assert summarise(events, num_steps=2)["device_ops_per_step"] == 3.5  # the copy too
