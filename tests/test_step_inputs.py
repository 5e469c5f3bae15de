"""A step's host inputs reach the device as one array, and a steady batch's sampling arrays
stay there (issue 41: one host-to-device transfer per step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.metadata import AttentionMetadata
from pagedjax.sampling_params import SamplingParams
from pagedjax.worker import model_runner
from pagedjax.worker.step_inputs import pack, unpack
from tests.test_engine import make_engine, make_prompts, run


def test_pack_and_unpack_give_back_every_array():
    rng = np.random.default_rng(0)
    metadata = AttentionMetadata(
        slot_mapping=rng.integers(0, 99, (2, 8), dtype=np.int32),  # two KV cache groups
        block_tables=rng.integers(0, 99, (2, 4, 3), dtype=np.int32),
        seq_lens=rng.integers(0, 99, 4, dtype=np.int32),
        query_start_loc=np.arange(5, dtype=np.int32),
        num_seqs=np.int32(3),
        num_tokens=np.int32(7),
    )
    inputs = (np.arange(8, dtype=np.int32), metadata, np.zeros((0, 2), np.int32))
    packed, layout = pack(inputs)
    assert packed.dtype == np.int32 and packed.ndim == 1
    got = jax.jit(unpack, static_argnums=1)(jnp.asarray(packed), layout)
    want_leaves, want_tree = jax.tree.flatten(inputs)
    got_leaves, got_tree = jax.tree.flatten(got)
    assert got_tree == want_tree
    for got_leaf, want_leaf in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(got_leaf), want_leaf)
        assert got_leaf.shape == np.shape(want_leaf)


def test_pack_bits_sends_32_bit_arrays_of_any_type_and_gives_back_their_bits():
    """The sampling arrays' way to the device (`ModelRunner._put_sampling`: packed, padded to
    a power of two, sent by a jitted identity): float32 (with -0.0, inf and a NaN), uint32 and
    int32 leaves, 1-D and 2-D, and None, bit for bit, on the device asked for."""
    from pagedjax.sampler import SamplingMetadata, build_sampling_metadata
    from pagedjax.worker.step_inputs import pack_bits, padded, sender, unpack

    params = [SamplingParams(temperature=0.7, top_p=0.9, logit_bias={3: -1.5, 9: 2.0})] * 3
    meta = build_sampling_metadata(params, [[1, 2]] * 3, [1] * 3, [2**32 - 1, 0, 7], num_rows=4)
    odd = np.array([-0.0, np.inf, np.nan, 1e-45], np.float32)
    inputs = (meta, odd, None)
    packed, layout = pack_bits(inputs)
    assert packed.dtype == np.int32 and packed.ndim == 1
    device = jax.devices()[-1]
    for sharding in (None, jax.sharding.SingleDeviceSharding(device)):
        sent = sender(sharding)(padded(packed))
        assert sent.shape[0] >= len(packed) and sent.shape[0] & (sent.shape[0] - 1) == 0
        assert sharding is None or sent.devices() == {device}
        got = jax.jit(unpack, static_argnames="layout")(sent, layout)
        assert isinstance(got[0], SamplingMetadata) and got[2] is None
        want_leaves, want_tree = jax.tree.flatten(inputs)
        got_leaves, got_tree = jax.tree.flatten(got)
        assert got_tree == want_tree
        for got_leaf, want_leaf in zip(got_leaves, want_leaves, strict=True):
            assert np.asarray(got_leaf).dtype == want_leaf.dtype
            assert np.asarray(got_leaf).tobytes() == want_leaf.tobytes()
    with pytest.raises(ValueError, match="32-bit"):
        pack_bits((np.zeros(2, np.int64),))


def test_a_step_sends_one_host_array_and_a_steady_batch_only_its_draw_counters(tiny, monkeypatch):
    """Every forward takes one host array (the packed inputs); the sampler's arrays are on
    the device, and a steady seeded batch's are the last step's but for the draw counters."""
    engine = make_engine(tiny, max_num_seqs=4)
    forward_hosts, metas = [], []
    forward, sample = model_runner.forward_step, model_runner.sample_step

    def spy_forward(params, packed, previous, kv_cache, **options):
        leaves = jax.tree.leaves((params, packed, previous, kv_cache))
        forward_hosts.append(sum(isinstance(leaf, np.ndarray) for leaf in leaves))
        return forward(params, packed, previous, kv_cache, **options)

    spy_forward._cache_size = forward._cache_size

    def spy_sample(logits, meta, *args, **options):
        metas.append(meta)  # kept: the arrays' identities stay unique while they live
        return sample(logits, meta, *args, **options)

    monkeypatch.setattr(model_runner, "forward_step", spy_forward)
    monkeypatch.setattr(model_runner, "sample_step", spy_sample)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)
    run(engine, make_prompts(3, seed=5), params)
    assert forward_hosts and set(forward_hosts) == {1}
    assert not any(isinstance(leaf, np.ndarray) for meta in metas for leaf in jax.tree.leaves(meta))
    sent = {id(meta.bits) for meta in metas}  # built and sent when the batch changed
    assert len(sent) <= 4 < len(metas)  # the prefills' batches, then one steady batch
    assert len({id(meta.steps) for meta in metas}) == len(metas)  # counters sent every step


def test_a_gpu_starts_the_results_copies_at_dispatch_and_the_tokens_stay_the_same(
    tiny, monkeypatch
):
    """`Platform.prefetches_results` (the GPU's): each step's sampled ids start their copy to
    the host when the step is dispatched, before the host asks for them; the CPU skips it."""
    from pagedjax.platforms.cpu import cpu_platform
    from pagedjax.platforms.gpu import GpuPlatform

    assert GpuPlatform().prefetches_results and not cpu_platform().prefetches_results
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = make_prompts(3, seed=7)
    plain = [
        o.outputs[0].token_ids for o in run(make_engine(tiny, max_num_seqs=4), prompts, params)
    ]
    engine = make_engine(tiny, max_num_seqs=4)
    runner = engine.engine_core.worker.runner
    assert not runner.prefetch_results  # the CPU's choice, passed down by the worker
    runner.prefetch_results = True
    prefetched, read = [], []
    handle = model_runner.StepHandle
    handle_prefetch, handle_result = handle.prefetch, handle.result

    def spy_prefetch(handle):
        prefetched.append(handle)
        return handle_prefetch(handle)

    def spy_result(handle):
        read.append(any(handle is p for p in prefetched))
        return handle_result(handle)

    monkeypatch.setattr(model_runner.StepHandle, "prefetch", spy_prefetch)
    monkeypatch.setattr(model_runner.StepHandle, "result", spy_result)
    assert [o.outputs[0].token_ids for o in run(engine, prompts, params)] == plain
    assert read and all(read)  # every step's results were on their way before they were read
