"""llama.cpp as an offline-throughput peer (llama-cpp-python's low-level API, a benchmark
dependency: `pip install llama-cpp-python` builds it for this CPU, about 10 minutes on 2 cores).

Static batches of B sequences in one context (B sequence ids): each prompt prefilled on its
own, then one `llama_decode` of B tokens per step, greedy (argmax of each row's logits),
exactly `max_tokens` per request as the engine's ignore_eos runs. Batch 1 is llama.cpp's usual
single-user loop.
"""

from __future__ import annotations

import time

CHUNK = 512  # tokens per llama_decode call (n_batch)


class Context:
    """One llama.cpp context of `size` sequences and a batch to feed it."""

    def __init__(self, model_path: str, size: int, n_ctx: int, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=model_path, n_ctx=64, verbose=False)  # the model
        # A context of our own: Llama's own sets n_seq_max only for embeddings.
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, CHUNK, CHUNK
        params.n_seq_max, params.kv_unified = size, True
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.llm.model, params)
        self.batch = llama_cpp.llama_batch_init(CHUNK, 0, size)
        self.vocab = self.llm.n_vocab()

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) rows."""
        batch = self.batch
        batch.n_tokens = len(rows)
        for i, (token, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def greedy(self, row: int) -> int:
        import numpy as np

        logits = self.lib.llama_get_logits_ith(self.ctx, row)
        return int(np.argmax(np.ctypeslib.as_array(logits, (self.vocab,))))

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.llm.close()


def generate_group(context: Context, group: list[list[int]], steps: int) -> None:
    """Prefills each prompt of the group, then decodes `steps` tokens for all of them."""
    context.clear()
    tokens = []
    for seq, prompt in enumerate(group):
        for at in range(0, len(prompt), CHUNK):
            chunk = prompt[at : at + CHUNK]
            last = at + len(chunk) == len(prompt)
            context.decode([(t, at + i, seq, last and i == len(chunk) - 1)
                            for i, t in enumerate(chunk)])  # fmt: skip
        tokens.append(context.greedy(len(chunk) - 1))
    for step in range(steps - 1):
        context.decode([(t, len(p) + step, seq, True)
                        for seq, (t, p) in enumerate(zip(tokens, group, strict=True))])  # fmt: skip
        tokens = [context.greedy(row) for row in range(len(group))]


def run_llamacpp(
    model_path: str, prompts: list[list[int]], max_tokens: list[int], batches: list[int],
    threads: int,
) -> dict:  # fmt: skip
    """Output tokens/s of llama.cpp at each static batch size (and the best), on these ids."""
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
    result: dict = {}
    for size in batches:
        context = Context(model_path, size, size * longest, threads)
        generate_group(context, prompts[:1], 2)  # warm-up
        start = time.perf_counter()
        for first in range(0, len(prompts), size):
            group = prompts[first : first + size]
            generate_group(context, group, max(max_tokens[first : first + size]))
        seconds = time.perf_counter() - start
        context.close()
        result[f"llamacpp_batch_{size}_output_tokens_per_s"] = sum(max_tokens) / seconds
    result["llamacpp_best_output_tokens_per_s"] = max(
        result[f"llamacpp_batch_{size}_output_tokens_per_s"] for size in batches
    )
    return result
