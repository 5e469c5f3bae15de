"""Speculative decoding with a draft model (pagedjax/worker/draft_model.py): drafts proposed on
the device within the step, the draft's KV pool kept with the target's blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedjax.config import EngineConfig
from pagedjax.sampling_params import SamplingParams
from tests.test_engine import make_engine, make_prompts, run, tokens_of
from tests.test_spec_decode import assert_stops_inside_drafts_match

PROMPTS = make_prompts(6, seed=7)
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def draft_config(tiny, name: str = "llama", k: int = 3, **options) -> dict:
    return {"model": str(tiny(name)[0]), "num_speculative_tokens": k, **options}


@pytest.fixture(scope="module")
def expected(tiny):
    return tokens_of(run(make_engine(tiny, block_size=8), PROMPTS, GREEDY))


# The target itself (every draft right: the draft's KV must be exact), another checkpoint
# with the same vocabulary (almost every draft wrong), the target's first layer (some right).
DRAFTS = {
    "itself": ("llama", {}),
    "other": ("qwen2", {}),
    "layer": ("llama", {"num_hidden_layers": 1}),
}


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_greedy_tokens_are_unchanged_and_drafts_are_counted(
    tiny, expected, draft, async_scheduling
):
    name, options = DRAFTS[draft]
    spec = draft_config(tiny, name, **options)
    engine = make_engine(
        tiny, block_size=8, speculative_config=spec, async_scheduling=async_scheduling
    )
    runner = engine.engine_core.worker.runner
    runner.warmup()
    compiled = runner.num_compilations
    assert tokens_of(run(engine, PROMPTS, GREEDY)) == expected
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 10
    rate = stats["spec_decode_acceptance_rate"]
    if draft == "itself":
        assert rate == 1.0 and stats["spec_decode_mean_acceptance_length"] > 3.5
    elif draft == "other":
        assert rate < 0.2
    else:
        assert 0 < rate < 1
    assert stats["num_generated_tokens"] == len(PROMPTS) * GREEDY.max_tokens
    assert stats["kv_blocks_used"] == 0
    # Chains, fills and verifying steps are bucketed: nothing compiled after warm-up.
    assert runner.num_compilations == compiled


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_prefix_caching_and_n_keep_the_tokens(tiny, expected, mode):
    """A pool for a fraction of the requests: drafted requests are preempted, swapped (both
    pools) or recomputed, prefixes hit, n=2 forks share blocks (copy-on-write in both pools).
    Every greedy draft of the target itself stays right, so the draft pool stays exact."""
    tight = dict(block_size=8, num_kv_blocks=11, max_num_batched_tokens=32, max_model_len=72)
    spec = draft_config(tiny)
    engine = make_engine(tiny, speculative_config=spec, preemption_mode=mode, **tight)
    forked = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True)
    outputs = run(engine, [*PROMPTS, PROMPTS[0]], [GREEDY] * len(PROMPTS) + [forked])
    assert tokens_of(outputs[:-1]) == expected
    assert [c.token_ids for c in outputs[-1].outputs] == [expected[0][:20]] * 2
    assert tokens_of(run(engine, PROMPTS[:2], GREEDY)) == expected[:2]
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swapped_preemptions"] > 0
    assert stats["prefix_cache_hit_rate"] + stats["prefix_cache_host_hit_rate"] > 0
    assert stats["spec_decode_num_drafts"] > 20 and stats["spec_decode_acceptance_rate"] == 1.0
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    assert [len(c.token_ids) for c in run(engine, [PROMPTS[1]], sampled)[0].outputs] == [12, 12]
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["host_kv_blocks_used"] == 0


def test_forks_draft_from_their_copied_blocks(tiny, expected):
    """n=3 forks share the prompt's partial last block; each one's first drafted step copies
    it (copy-on-write) and its chain reads the copy: every draft of the target itself holds."""
    prompt = make_prompts(1, seed=3, lo=11, hi=12)[0]  # 11 tokens: blocks of 8 and 3
    plain = run(make_engine(tiny, block_size=8), [prompt], GREEDY)
    engine = make_engine(tiny, block_size=8, speculative_config=draft_config(tiny))
    forked = SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True)
    (out,) = run(engine, [prompt], forked)
    assert [c.token_ids for c in out.outputs] == [plain[0].outputs[0].token_ids] * 3
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] >= 3 and stats["spec_decode_acceptance_rate"] == 1.0


def test_stops_and_logprobs_inside_accepted_drafts(tiny, expected):
    engine = make_engine(tiny, block_size=8, speculative_config=draft_config(tiny))
    assert_stops_inside_drafts_match(tiny, PROMPTS, expected, engine)


def _exact_marginals(hf_model, prompt: list[int], top_k: int) -> list[dict[int, float]]:
    """The exact distributions of output tokens 1, 2 and 3 under temperature 1 and top_k."""

    def step(prefixes: dict[tuple, float]) -> dict[tuple, float]:
        keys = list(prefixes)
        with torch.no_grad():
            logits = hf_model(torch.tensor([list(k) for k in keys])).logits[:, -1].double()
        out = {}
        for key, row in zip(keys, logits, strict=True):
            top = torch.topk(row, top_k)
            probs = torch.softmax(top.values, -1)
            for token, p in zip(top.indices.tolist(), probs.tolist(), strict=True):
                out[(*key, token)] = prefixes[key] * p
        return out

    prefixes, marginals = {tuple(prompt): 1.0}, []
    for _ in range(3):
        prefixes = step(prefixes)
        marginal: dict[int, float] = {}
        for key, p in prefixes.items():
            marginal[key[-1]] = marginal.get(key[-1], 0.0) + p
        marginals.append(marginal)
    return marginals


@pytest.mark.slow
def test_sampled_tokens_keep_the_target_distribution(tiny):
    """Tokens 2 and 3 come from drafted steps (the target's first two layers draft, so both
    accepted and rejected drafts occur): their frequencies over 4000 seeds match the exact
    marginals (total variation under 0.07, 0.02-0.04 measured; accepting every draft would
    give about 0.5)."""
    prompt, top_k, samples = PROMPTS[0], 4, 4000
    exact = _exact_marginals(tiny("llama")[1], prompt, top_k)
    spec = draft_config(tiny, k=2, num_hidden_layers=2)
    engine = make_engine(
        tiny, block_size=8, speculative_config=spec, max_num_batched_tokens=256, max_num_seqs=64
    )
    params = [
        SamplingParams(temperature=1.0, top_k=top_k, seed=s, max_tokens=3, ignore_eos=True)
        for s in range(samples)
    ]
    outputs = tokens_of(run(engine, [prompt] * samples, params))
    stats = engine.stats()
    assert 0.1 < stats["spec_decode_acceptance_rate"] < 0.9
    for position in (1, 2):
        counts = np.bincount([o[position] for o in outputs], minlength=128) / samples
        want = np.zeros(128)
        for token, p in exact[position].items():
            want[token] = p
        assert 0.5 * np.abs(counts - want).sum() < 0.07


def test_pool_sizing_counts_both_pools(tiny):
    spec = draft_config(tiny, num_hidden_layers=1)  # a third of the target's KV per token
    budget = 2**20
    plain = make_engine(tiny, block_size=8, num_kv_blocks=None, kv_cache_memory_bytes=budget)
    drafted = make_engine(
        tiny,
        block_size=8,
        num_kv_blocks=None,
        kv_cache_memory_bytes=budget,
        speculative_config=spec,
    )
    blocks = [e.engine_core.worker.num_blocks for e in (plain, drafted)]
    # K and V of 2 heads x 16 float32s per layer and token, 8 tokens a block: the target's 3
    # layers, and the draft's 1 beside them.
    layer_block = 2 * 2 * 16 * 4 * 8
    assert blocks == [budget // (3 * layer_block), budget // (4 * layer_block)]
    stats = drafted.stats()
    assert stats["kv_cache_bytes_total"] <= budget < stats["kv_cache_bytes_total"] * 1.01


def test_sleep_and_wake_up_keep_drafting(tiny, expected):
    engine = make_engine(tiny, block_size=8, speculative_config=draft_config(tiny))
    assert tokens_of(run(engine, PROMPTS[:2], GREEDY)) == expected[:2]
    engine.sleep(1)
    assert engine.engine_core.worker.runner.kv_cache_lost()
    engine.wake_up()
    assert tokens_of(run(engine, PROMPTS[:2], GREEDY)) == expected[:2]
    assert engine.stats()["spec_decode_acceptance_rate"] == 1.0


def test_bad_draft_configs_are_refused_before_anything_loads(tiny):
    path = str(tiny("llama")[0])
    for bad, message in (
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
        ({"method": "ngram", "model": path, "num_speculative_tokens": 2}, "needs a model"),
        ({"model": path, "num_speculative_tokens": 2, "num_hidden_layers": 0}, "num_hidden_layers"),
        ({"model": "/no/such/model", "num_speculative_tokens": 2}, "does not exist"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=bad)
    spec = {"model": path, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="one device per engine"):
        EngineConfig(speculative_config=spec, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="KV scales are the target"):
        EngineConfig(speculative_config=spec, kv_cache_dtype="fp8", calculate_kv_scales=True)
    with pytest.raises(ValueError, match="has 3 layers"):
        make_engine(tiny, speculative_config={**spec, "num_hidden_layers": 4})
    with pytest.raises(ValueError, match="the draft model: no model found"):
        make_engine(tiny, speculative_config={**spec, "model": str(tiny("llama")[0].parent)})


def test_new_weights_reach_a_draft_of_the_targets_own_layers(tiny):
    """update_weights (an RL trainer's new policy): a draft that is the target's checkpoint
    takes its layers of the new weights, so it keeps proposing the target's tokens."""
    import jax

    _, _, _, params = tiny("llama")
    new = jax.tree.map(lambda a: a * 1.05 if a.ndim == 3 else a, params)
    fresh = make_engine(tiny, block_size=8)
    fresh.update_weights(new)
    want = tokens_of(run(fresh, PROMPTS[:3], GREEDY))
    engine = make_engine(tiny, block_size=8, speculative_config=draft_config(tiny))
    run(engine, PROMPTS[:1], GREEDY)
    engine.update_weights(new)
    before = engine.stats()["spec_decode_num_draft_tokens"]
    assert tokens_of(run(engine, PROMPTS[:3], GREEDY)) == want
    stats = engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > before
    assert stats["spec_decode_acceptance_rate"] == 1.0
