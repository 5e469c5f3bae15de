"""Paper estimate of tensor-parallel communication against compute for Llama 3 8B/70B on H200s.

    python benchmarks/parallel_estimate.py [--markdown] [--busbw-gbs 360] [--latency-us 10]
        [--smoke (the same run: it is arithmetic, done in a moment)]

Sharding, as pagedjax does it (Megatron-style): q/k/v and gate/up are column-parallel, o_proj
and down_proj row-parallel, so each decoder layer does 2 all-reduces of the activations
[tokens, hidden] in bf16; each step adds one all-reduce of the vocab-parallel embedding
[tokens, hidden] (bf16) and one all-gather of the vocab-sharded logits [rows, vocab] (float32).
KV heads are sharded over the T devices (one per device when num_kv_heads < T).

Assumptions (flags change them): H200 SXM, 141 GB HBM3e at 4.8 TB/s, 989 TFLOP/s dense bf16,
both taken as reached. NVLink 4 through NVSwitch, 450 GB/s each way per GPU; NCCL reaches a bus
bandwidth (nccl-tests' busbw) of ~360 GB/s on large all-reduces, and every collective pays a
10 µs latency floor on top (NCCL's small-message all-reduce on NVSwitch: ~8-15 µs; NVLS or a
one-shot custom all-reduce gets lower). Ring all-reduce moves 2(T-1)/T x bytes per GPU,
all-gather (T-1)/T x, so a collective takes latency + moved bytes / busbw.
Compute per layer per device is a roofline, max(flops / peak, bytes / HBM bandwidth), with
bytes = bf16 weights / T + the KV read by attention, flops = 2 x tokens x weights / T +
attention (4 x query-key pairs x head_dim per head); activation traffic is ignored. The LM head
(vocab-sharded, on sampled rows only) is added per step. Communication is not overlapped with
compute (the engine has no overlap yet), so a step takes their sum.
Decode: `batch` sequences of `context` tokens, one new token each. Prefill: the first chunk of
N tokens of one sequence (causal: N(N+1)/2 query-key pairs), one logits row.
An estimate, not a measurement.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from report import add_smoke_flag  # (benchmarks/ is the script directory)

BF16 = 2
FP32 = 4


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def kv_heads_per_device(self, t: int) -> int:
        # With fewer KV heads than devices a head is replicated, not split.
        return max(self.kv_heads // t, 1)

    def layer_weight_bytes(self, t: int) -> float:
        """bf16 bytes of one decoder layer's projection weights held by each of T devices."""
        h, d = self.hidden, self.head_dim
        q_and_o = 2 * h * self.q_heads * d / t
        k_and_v = 2 * h * self.kv_heads_per_device(t) * d
        return BF16 * (q_and_o + k_and_v + 3 * h * self.intermediate / t)

    def weight_bytes(self, t: int) -> float:
        """bf16 bytes per device: the layers plus the (untied) embedding and LM head."""
        return self.layers * self.layer_weight_bytes(t) + 2 * BF16 * self.vocab * self.hidden / t

    def kv_bytes_per_token(self, t: int) -> float:
        """KV cache bytes per token per device, over all layers (bf16 K and V)."""
        return self.layers * 2 * self.kv_heads_per_device(t) * self.head_dim * BF16


LLAMA3_8B = Model("Llama 3 8B", 4096, 32, 32, 8, 128, 14336, 128256)
LLAMA3_70B = Model("Llama 3 70B", 8192, 80, 64, 8, 128, 28672, 128256)


@dataclass(frozen=True)
class Hardware:
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bw: float  # bytes/s
    hbm_bytes: float
    busbw: float  # NCCL bus bandwidth, bytes/s
    latency: float  # seconds per collective


@dataclass(frozen=True)
class Regime:
    name: str
    tokens: int  # query tokens in the step (rows of the activations)
    rows: int  # logits rows computed and gathered
    kv_tokens: int  # K/V positions read per layer, summed over sequences
    qk_pairs: int  # query-key pairs per layer, summed over sequences


def decode(batch: int, context: int) -> Regime:
    return Regime(f"decode b={batch} ctx={context}", batch, batch, batch * context, batch * context)


def prefill(n: int) -> Regime:
    return Regime(f"prefill {n}", n, 1, n, n * (n + 1) // 2)


@dataclass(frozen=True)
class Estimate:
    comm_bytes: float  # per layer per device
    comm_s: float  # per layer
    latency_s: float  # the latency floors within comm_s
    compute_s: float  # per layer
    hbm_bound: bool
    step_comm_s: float
    step_compute_s: float

    @property
    def comm_fraction(self) -> float:
        return self.step_comm_s / (self.step_comm_s + self.step_compute_s)


def all_reduce_s(nbytes: float, t: int, hw: Hardware) -> float:
    return hw.latency + 2 * (t - 1) / t * nbytes / hw.busbw


def all_gather_s(nbytes: float, t: int, hw: Hardware) -> float:
    return hw.latency + (t - 1) / t * nbytes / hw.busbw


def estimate(m: Model, t: int, r: Regime, hw: Hardware) -> Estimate:
    act = r.tokens * m.hidden * BF16
    weights = m.layer_weight_bytes(t)
    kv_read = r.kv_tokens * 2 * m.kv_heads_per_device(t) * m.head_dim * BF16
    # 2 FLOPs per bf16 weight per token equals the weight bytes per token.
    flops = r.tokens * weights + 4 * r.qk_pairs * (m.q_heads // t) * m.head_dim
    flops_s, hbm_s = flops / hw.peak_flops, (weights + kv_read) / hw.hbm_bw
    head = m.vocab * m.hidden * BF16 / t
    head_s = max(r.rows * head / hw.peak_flops, head / hw.hbm_bw)
    comm_s = 2 * all_reduce_s(act, t, hw)
    step_comm = m.layers * comm_s + all_reduce_s(act, t, hw)
    step_comm += all_gather_s(r.rows * m.vocab * FP32, t, hw)
    return Estimate(
        comm_bytes=2 * 2 * (t - 1) / t * act,
        comm_s=comm_s,
        latency_s=2 * hw.latency,
        compute_s=max(flops_s, hbm_s),
        hbm_bound=hbm_s >= flops_s,
        step_comm_s=step_comm,
        step_compute_s=m.layers * max(flops_s, hbm_s) + head_s,
    )


def comm_bound_ranges(
    m: Model, t: int, hw: Hardware, make: Callable[[int], Regime], limit: int
) -> str:
    """Token counts (1..limit) at which a layer's communication outlasts its compute."""

    def comm_bound(n: int) -> bool:
        e = estimate(m, t, make(n), hw)
        return e.comm_s > e.compute_s

    # Every n to 1024, then a grid of 16 with a bisection at each sign change.
    grid = list(range(1, 1024)) + list(range(1024, limit + 1, 16))
    ranges: list[list[int]] = []
    prev_n, prev = 0, False
    for n in grid:
        cur = comm_bound(n)
        if cur != prev:
            lo, hi = prev_n, n  # the flip happens after lo, at or before hi
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if comm_bound(mid) == prev else (lo, mid)
            if cur:
                ranges.append([hi, limit])
            else:
                ranges[-1][1] = lo
        prev_n, prev = n, cur
    if not ranges:
        return "none"
    return ", ".join(f"{a}-{b}" if b < limit else f">= {a}" for a, b in ranges)


def table(headers: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(x) for x in col) for col in zip(headers, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in [headers, *rows])


REGIMES = [decode(b, c) for c in (2048, 8192) for b in (1, 32, 256)] + [
    prefill(n) for n in (512, 2048, 8192)
]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="markdown tables")
    ap.add_argument("--busbw-gbs", type=float, default=360.0, help="NCCL bus bandwidth, GB/s")
    ap.add_argument("--latency-us", type=float, default=10.0, help="floor per collective, µs")
    ap.add_argument("--mem-util", type=float, default=0.9, help="share of HBM for weights+KV")
    add_smoke_flag(ap)  # changes nothing: the estimate takes a moment and writes no file
    args = ap.parse_args()
    hw = Hardware(989e12, 4.8e12, 141e9, args.busbw_gbs * 1e9, args.latency_us * 1e-6)
    models, md = (LLAMA3_8B, LLAMA3_70B), args.markdown
    out = [
        f"Assumed: {hw.peak_flops / 1e12:.0f} TFLOP/s bf16, {hw.hbm_bw / 1e12:.1f} TB/s HBM, "
        f"busbw {args.busbw_gbs:.0f} GB/s, {args.latency_us:g} µs per collective, no overlap."
    ]

    rows = []
    for m in models:
        for r in REGIMES:
            e = estimate(m, 8, r, hw)
            comm = f"{e.comm_s * 1e6:.1f} ({e.latency_s / e.comm_s:.0%} lat)"
            compute = f"{e.compute_s * 1e6:.1f} ({'HBM' if e.hbm_bound else 'FLOPs'})"
            step = f"{(e.step_comm_s + e.step_compute_s) * 1e3:.2f}"
            mb, share = f"{e.comm_bytes / 1e6:.3f}", f"{e.comm_fraction:.0%}"
            rows.append([m.name, r.name, mb, comm, compute, step, share])
    heads = ["model", "regime", "comm MB/layer/GPU", "comm µs/layer", "compute µs/layer"]
    out += ["", "T = 8, per decoder layer and per step:", ""]
    out.append(table(heads + ["step ms", "comm % of step"], rows, md))

    rows = [
        [m.name, r.name] + [f"{estimate(m, t, r, hw).comm_fraction:.0%}" for t in (2, 4, 8)]
        for m in models
        for r in REGIMES
    ]
    out += ["", "Communication's share of the step at T = 2, 4, 8:", ""]
    out.append(table(["model", "regime", "T=2", "T=4", "T=8"], rows, md))

    rows = [
        [m.name, str(t)]
        + [comm_bound_ranges(m, t, hw, lambda b, c=c: decode(b, c), 4096) for c in (2048, 8192)]
        + [comm_bound_ranges(m, t, hw, prefill, 131072)]
        for m in models
        for t in (2, 4, 8)
    ]
    heads = ["model", "T", "decode ctx 2048: batch", "decode ctx 8192: batch", "prefill: tokens"]
    caption = "Where a layer's communication outlasts its compute (scanned to batch 4096, prefill"
    out += ["", caption + " 131072 tokens); outside these ranges compute is longer:", ""]
    out.append(table(heads, rows, md))

    rows = []
    for m in models:
        for t in (1, 2, 4, 8):
            free = args.mem_util * hw.hbm_bytes - m.weight_bytes(t)
            tokens = max(free, 0) / m.kv_bytes_per_token(t)
            fits = (
                [f"{tokens / 1e3:,.0f}k", f"{tokens / 8192:,.0f}"]
                if free > 0
                else ["weights do not fit", "-"]
            )
            weights, kv = f"{m.weight_bytes(t) / 1e9:.1f}", f"{m.kv_bytes_per_token(t) / 1024:.0f}"
            rows.append([m.name, str(t), weights, kv, *fits])
    heads = ["model", "T", "weights GB/GPU", "KV KiB/token/GPU", "KV tokens", "8k sequences"]
    out += ["", f"Memory per tensor-parallel group ({args.mem_util:.0%} of 141 GB per GPU):", ""]
    out.append(table(heads, rows, md))
    print("\n".join(out))


if __name__ == "__main__":
    main()
