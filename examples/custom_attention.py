"""Your own attention over pagedjax's paged KV pool: write it, check it, decode with it.

Every attention implementation meets one contract (`kernels_pallas.backend.AttentionBackend`):
q [T, Hq, D] for a step's flat batch of new tokens, the paged pool (K and V each [layers, KV
heads, blocks, block_size, D]), the layer, and the step's `AttentionMetadata` (block tables,
sequence lengths, where each sequence's tokens start). This example writes one in plain JAX
(gather the sequence's pages into one context, masked softmax), checks it against the oracle
`kernels_pallas.reference.ragged_paged_attention` on random inputs, then hands it to the
engine (`LLM(attention_backend=GATHER)`) and shows its greedy tokens equal the built-in
attention's.

    python examples/custom_attention.py           # SmolLM2-135M-Instruct
    python examples/custom_attention.py --small   # a tiny random Llama, a few seconds
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from _tiny import add_model_args, model_path

from kernels_pallas.backend import FunctionBackend
from kernels_pallas.kv_cache import KVCache
from kernels_pallas.metadata import build_metadata
from kernels_pallas.reference import ragged_paged_attention
from pagedjax import LLM, SamplingParams


def gather_attention(q, cache, layer, metadata, *, scale, sliding_window=None, soft_cap=None):
    """The user's attention: each token gathers its own sequence's pages (vmap over tokens)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = cache.k.shape[1]
    qsl = jnp.asarray(metadata.query_start_loc)  # sequence s owns tokens qsl[s]:qsl[s + 1]
    tables = jnp.asarray(metadata.block_tables)  # [S, B] logical -> physical block
    t = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(qsl, t, side="right") - 1, 0, qsl.shape[0] - 2)
    seq_len = jnp.asarray(metadata.seq_lens)[seq]
    pos = seq_len - (qsl[seq + 1] - t)  # a sequence's new tokens are the last of its context

    def one_token(q_t, seq_t, pos_t, len_t):
        pages = tables[seq_t]
        k = cache.k[layer][:, pages].reshape(num_kv_heads, -1, head_dim).astype(jnp.float32)
        v = cache.v[layer][:, pages].reshape(num_kv_heads, -1, head_dim).astype(jnp.float32)
        group = num_q_heads // num_kv_heads  # grouped-query attention: heads share a KV head
        k, v = jnp.repeat(k, group, axis=0), jnp.repeat(v, group, axis=0)
        scores = jnp.einsum("hd,hcd->hc", q_t.astype(jnp.float32), k) * scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        key = jnp.arange(k.shape[1])
        visible = (key <= pos_t) & (key < len_t)  # causal; padding sequences see nothing
        if sliding_window is not None:  # a traced int per layer; 0 means unlimited
            visible &= (sliding_window <= 0) | (key > pos_t - sliding_window)
        # Masked values are zeroed too: an unused slot may hold anything, and 0 * NaN = NaN.
        probs = jax.nn.softmax(jnp.where(visible, scores, -1e30), axis=-1)
        return jnp.einsum("hc,hcd->hd", probs, jnp.where(visible[None, :, None], v, 0.0))

    return jax.vmap(one_token)(q, seq, pos, seq_len).astype(q.dtype)


# The contract's wrapper: hashable (the jitted model takes it as a static argument), and its
# cost grows with the block-table width, which tells the engine's runner to bucket that width.
GATHER = FunctionBackend("gather", gather_attention, cost_follows_context=False)


def check_against_reference(seed: int = 0) -> float:
    """The largest |difference| from the oracle over a mixed, padded step of random data."""
    rng = np.random.default_rng(seed)
    layers, q_heads, kv_heads, dim, block_size, blocks = 2, 4, 2, 16, 8, 16
    k, v = rng.standard_normal((2, layers, kv_heads, blocks, block_size, dim), np.float32)
    cache = KVCache(jnp.asarray(k), jnp.asarray(v))
    # A prompt's middle chunk, a decode token and a whole prompt, on shuffled physical blocks,
    # padded to 16 tokens and 4 sequences as the engine pads its steps.
    q_lens, seq_lens = [5, 1, 7], [21, 30, 7]
    free = list(rng.permutation(np.arange(1, blocks)))  # block 0 is the null block
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    meta = build_metadata(
        q_lens, seq_lens, tables, block_size, num_tokens_padded=16, num_seqs_padded=4
    )
    q = jnp.asarray(rng.standard_normal((16, q_heads, dim), np.float32))
    cases = [
        {"scale": dim**-0.5, **extra} for extra in ({}, {"sliding_window": 4}, {"soft_cap": 5.0})
    ]

    @jax.jit  # every case in one compiled program: at this size compiling dominates
    def differences(q, cache, meta):
        mine = [GATHER(q, cache, 1, meta, **case) for case in cases]
        oracle = [ragged_paged_attention(q, cache, 1, meta, **case) for case in cases]
        return jnp.abs(jnp.stack(mine) - jnp.stack(oracle))

    return float(differences(q, cache, meta).max())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    worst = check_against_reference()
    print(f"gather_attention vs the reference on random inputs: max |diff| {worst:.2e}")
    with model_path(args) as model:
        tokens = {}
        for name, backend in (("built-in", "auto"), ("gather_attention", GATHER)):
            llm = LLM(model, max_model_len=512, attention_backend=backend)
            prompt = llm.get_tokenizer().encode(args.prompt)
            # ignore_eos: both engines run to max_tokens, so the whole sequences compare.
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            [output] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
            tokens[name] = list(output.outputs[0].token_ids)
            ran = llm.llm_engine.workers[0].attention.name  # the backend the engine ran
            print(f"engine, {name} attention: {tokens[name]} {output.outputs[0].text!r}")
    engine_tokens, custom_tokens = tokens["built-in"], tokens["gather_attention"]
    print(f"greedy tokens equal: {engine_tokens == custom_tokens}")
    return {
        "max_abs_diff": worst,
        "engine_tokens": engine_tokens,
        "custom_tokens": custom_tokens,
        "custom_backend": ran,
    }


if __name__ == "__main__":
    main()
