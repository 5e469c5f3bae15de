"""Seeded fuzzing of whole workloads on a tiny model: random arrivals, prompt and output
lengths, sampling parameters, n, aborts, shared prefixes and tiny pools. After each workload:
every finished greedy request equals the same request run alone (and so do the prompt logprobs
of any request that asks for them), no block is leaked, and the prefix cache only holds keys of
real token chains."""

from __future__ import annotations

import random

import pytest

from pagedjax.core.hashing import hash_request_tokens
from pagedjax.errors import InvalidRequestError
from pagedjax.sampling_params import SamplingParams
from tests.test_engine import make_engine

NUM_WORKLOADS = int(__import__("os").environ.get("PAGEDJAX_FUZZ_WORKLOADS", 100))
MAX_PROMPT, MAX_OUTPUT = 24, 8
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
HOST_BYTES_PER_TOKEN = 2 * 3 * 32 * 4  # the tiny llama's K and V: 3 layers x 32 wide, float32


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model_dir):
    from models.loader import load_model

    path, hf_model = tiny_model_dir("llama")
    config, params = load_model(path)
    return lambda name: (path, hf_model, config, params)


def prompt_logprobs_of(output) -> list[float]:
    """The logprob of each prompt token after the first."""
    pairs = zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:], strict=True)
    return [entry[token].logprob for token, entry in pairs]


def test_fuzz_workloads(tiny_loaded):
    rng = random.Random(1234)
    reference = make_engine(tiny_loaded, max_model_len=64, num_kv_blocks=64)
    alone_cache: dict[tuple, tuple[list[int], list[float]]] = {}

    def alone(prompt: list[int], max_tokens: int, scored: bool) -> tuple[list[int], list[float]]:
        """Greedy tokens (and the prompt's logprobs if `scored`) of the request run on its own."""
        key = (tuple(prompt), max_tokens, scored)
        if key not in alone_cache:
            params = SamplingParams(
                temperature=0,
                max_tokens=max_tokens,
                ignore_eos=True,
                prompt_logprobs=0 if scored else None,
            )
            reference.add_request("ref", prompt, params)
            while reference.has_unfinished_requests():
                for out in reference.step():
                    scores = prompt_logprobs_of(out) if scored else []
                    alone_cache[key] = out.outputs[0].token_ids, scores
        return alone_cache[key]

    totals = {"requests": 0, "aborted": 0, "preemptions": 0, "swaps": 0, "hit_tokens": 0}
    totals["accepted_drafts"] = 0
    for workload in range(NUM_WORKLOADS):
        block_size = rng.choice([8, 16])
        engine = make_engine(
            tiny_loaded,
            block_size=block_size,
            max_model_len=MAX_PROMPT + MAX_OUTPUT,
            # Room for 1.5 max-length requests: preemption whenever several run. One size
            # per block size, so the workloads share compiled shapes (compiling dominates).
            num_kv_blocks=1 + 48 // block_size,
            max_num_batched_tokens=rng.choice([8, 32]),
            max_num_seqs=rng.choice([1, 4]),
            enable_prefix_caching=rng.random() < 0.7,
            # Victims swap to the host tier (a roomy one, or one of a few blocks that leaves
            # most to recompute) or recompute.
            preemption_mode=rng.choice(["auto", "swap", "recompute"]),
            swap_space=rng.choice([1.0, 3 * block_size * HOST_BYTES_PER_TOKEN / 2**30]),
            # Speculative decoding: drafts from 1-token lookups (often wrong) on half.
            speculative_config=rng.choice([None, SPEC]),
        )
        shared = [rng.randrange(3, 128) for _ in range(rng.randint(0, 16))]
        plans = []
        for i in range(rng.randint(1, 6)):
            prompt = (shared if rng.random() < 0.5 else []) + [
                rng.randrange(3, 128) for _ in range(rng.randint(1, 8))
            ]
            prompt = prompt[:MAX_PROMPT]
            greedy = rng.random() < 0.7
            params = SamplingParams(
                n=1 if greedy else rng.choice([1, 2, 3]),
                temperature=0 if greedy else rng.choice([0.5, 1.0]),
                top_p=1.0 if greedy else rng.choice([1.0, 0.9]),
                seed=rng.randrange(1000),
                max_tokens=rng.randint(1, MAX_OUTPUT),
                ignore_eos=True,
                prompt_logprobs=rng.choice([0, 2]) if rng.random() < 0.15 else None,
            )
            arrival = rng.randint(0, 6)
            abort_at = arrival + rng.randint(0, 8) if rng.random() < 0.15 else None
            plans.append((f"{workload}-{i}", prompt, params, arrival, abort_at))

        done, aborted, step, chains = {}, set(), 0, set()
        while step < 10 or engine.has_unfinished_requests():
            for request_id, prompt, params, arrival, abort_at in plans:
                if arrival == step:
                    if params.n > engine.config.max_num_seqs:
                        with pytest.raises(InvalidRequestError, match="max_num_seqs"):
                            engine.add_request(request_id, prompt, params)
                        aborted.add(request_id)  # refused up front: nothing to check
                        continue
                    engine.add_request(request_id, prompt, params)
                if abort_at == step and request_id not in done:
                    engine.abort_request(request_id)
                    aborted.add(request_id)
            live = engine.engine_core.scheduler.running + engine.engine_core.scheduler.waiting
            chains.update(tuple(r.all_token_ids) for r in live)  # every chain the cache may key
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            step += 1
            assert step < 500, f"no progress (livelock) in {engine.config}"

        for request_id, prompt, params, _, _ in plans:
            if request_id in aborted:
                continue
            completions = done[request_id].outputs
            assert len(completions) == params.n
            scored = params.prompt_logprobs is not None
            if scored or params.temperature == 0:
                tokens, prompt_logprobs = alone(prompt, params.max_tokens, scored)
            for completion in completions:
                assert len(completion.token_ids) == params.max_tokens
                if params.temperature == 0:
                    assert completion.token_ids == tokens, request_id
            if scored:
                got = prompt_logprobs_of(done[request_id])
                assert got == pytest.approx(prompt_logprobs, abs=1e-5), request_id
        pool = engine.engine_core.kv_cache_manager.block_pool
        assert pool.num_used_blocks == 0
        assert engine.engine_core.kv_cache_manager.host_pool.num_used_blocks == 0
        assert all(block.ref_cnt == 0 for block in pool.blocks[1:])
        real_chains = {h for chain in chains for h in hash_request_tokens(chain, block_size)}
        assert set(pool.cached_blocks) <= real_chains
        totals["requests"] += len(plans)
        totals["aborted"] += len(aborted)
        totals["preemptions"] += engine.engine_core.scheduler.num_preemptions
        totals["swaps"] += engine.engine_core.scheduler.num_swaps
        totals["hit_tokens"] += engine.engine_core.kv_cache_manager.prefix_cache_stats.hits
        totals["accepted_drafts"] += engine.engine_core.scheduler.spec_stats.num_accepted_tokens
    print(f"fuzz: {NUM_WORKLOADS} workloads, {totals}")
    assert totals["preemptions"] > totals["swaps"] > 0
    assert totals["hit_tokens"] > 0 and totals["aborted"] > 0 and totals["accepted_drafts"] > 0
