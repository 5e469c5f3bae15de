"""The model runner: turns a scheduled step into fixed-shape device arrays and runs it.

Every jitted call sees one of a few shapes: tokens padded to a bucket T, sequences to
S = min(T, max_num_seqs rounded up), sample rows to S, block copies to 0 or a power of two.
The block-table width is max_model_len's for a backend whose cost follows each sequence's
real context; for the others it is a power-of-two bucket B that follows the longest context
in the step. For a backend with a decode kernel, whether every sequence has one new token is
a static flag of the step too (no per-layer conditional on the device). Host buffers are
preallocated numpy arrays filled in place; the KV pool is donated, so it is updated in
place. Only sampled token ids (and requested logprobs) come back to the host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from itertools import accumulate
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kernels_pallas.backend import AttentionBackend
from kernels_pallas.kv_cache import (
    NULL_BLOCK,
    PAD_SLOT,
    KVCache,
    allocate_kv_cache,
    with_scales,
)
from kernels_pallas.kv_groups import KVCacheGroups, single_group
from kernels_pallas.metadata import AttentionMetadata, next_power_of_2
from models.config import ModelConfig
from models.llama import Params, forward_logits
from models.tensor_parallel import TensorParallel, layout_lora
from pagedjax.config import EngineConfig
from pagedjax.constraints import MaskFiller, apply_processors
from pagedjax.core.memory import KVCacheSpec
from pagedjax.core.sched_output import (
    DecodeStep,
    ModelRunnerOutput,
    SampleRow,
    ScheduledSequence,
)
from pagedjax.sampler import (
    SamplerOutput,
    SamplingKernels,
    SamplingMetadata,
    TokenLogprobs,
    build_sampling_metadata,
    prompt_logprobs,
)
from pagedjax.worker.batch_sampling import (
    BatchSampling,
    Packed,
    distinct_rows,
    edit_rows,
    packed_rows,
    padding_rows,
    row_kinds,
    same_arrays,
)
from pagedjax.worker.block_table import BlockTables
from pagedjax.worker.decode_batch import DecodeBatch
from pagedjax.worker.device_steps import (
    decode_steps,
    forward_step,
    sample_step,
    set_rows,
)
from pagedjax.worker.draft_model import (
    ChainInputs,
    DraftModel,
    chain_inputs,
    draft_chain,
    join_drafts,
    mark_model_drafts,
    verified_drafts,
    verify_index,
)
from pagedjax.worker.host_kv import HostKV
from pagedjax.worker.lora_slots import LoRASlots
from pagedjax.worker.step_inputs import PackedSampling, pack, pack_bits, padded, sender

logger = logging.getLogger(__name__)


def token_buckets(
    max_num_batched_tokens: int, extra: Sequence[int] = (), batch_invariant: bool = False
) -> list[int]:
    """1, 4, 16, 32, 64, 128, then steps of a quarter of the last power of two (at least 64):
    192, 256, ... 512, 640, 768, ... 1024, 1280, ..., ending at the budget itself; and the
    `extra` sizes below the budget (one sequence's step with its drafts: speculative decoding
    at batch 1 then pays for no padding).

    Padded rows cost as much as real ones in every matmul. A mixed step is its decode rows
    plus whatever prefill fits, so its size is spread over the whole range, and finer steps
    than powers of two pad fewer rows (benchmarks/README.md has the numbers).

    batch_invariant: 2 tokens at least. XLA:CPU turns a one-token step's KV write into a
    dynamic-update-slice with the rotary embedding fused in, where it rounds otherwise
    (`docs/batch_invariance.md`)."""
    smallest = 2 if batch_invariant else 1
    max_num_batched_tokens = max(max_num_batched_tokens, smallest)
    buckets = [b for b in (smallest, 4, 16, 32, 64, 128) if b < max_num_batched_tokens]
    while buckets and buckets[-1] >= 128:
        last = buckets[-1]
        bucket = last + max(64, (1 << (last.bit_length() - 1)) // 4)
        if bucket >= max_num_batched_tokens:
            break
        buckets.append(bucket)
    extra = [e for e in extra if e < max_num_batched_tokens]
    return sorted({*buckets, *extra, max_num_batched_tokens})


def seqs_bucket(config: EngineConfig) -> int:
    """The padded sequence count of a step: max_num_seqs up to a power of two (also the row
    stride between the iterations of a step of several decode steps)."""
    return next_power_of_2(config.max_num_seqs)


def activation_bytes(
    config: ModelConfig,
    params: Params,
    num_tokens: int,
    max_blocks_per_seq: int,
    attention: AttentionBackend,
    kv_spec: KVCacheSpec,
    kv_groups: KVCacheGroups | None = None,
) -> int:
    """Peak temporary memory of the forward at `num_tokens` tokens, from XLA's compiled memory
    analysis (compiled, never run) with a minimal pool, whose size does not change the
    temporaries. Used to size the KV pool from the device memory that is left. kv_groups:
    the KV cache groups (`kv_spec` counting their slabs as layers)."""
    cache = jax.eval_shape(lambda: allocate_kv_cache(kv_spec, 2, 16, config.num_layers))
    ints = jax.ShapeDtypeStruct((num_tokens,), jnp.int32)
    seqs = min(num_tokens, 256)
    groups = kv_groups.metadata_dims if kv_groups else ()
    metadata = AttentionMetadata(
        slot_mapping=jax.ShapeDtypeStruct((*groups, num_tokens), jnp.int32),
        block_tables=jax.ShapeDtypeStruct((*groups, seqs, max_blocks_per_seq), jnp.int32),
        seq_lens=jax.ShapeDtypeStruct((seqs,), jnp.int32),
        query_start_loc=jax.ShapeDtypeStruct((seqs + 1,), jnp.int32),
        num_seqs=jax.ShapeDtypeStruct((), jnp.int32),
        num_tokens=jax.ShapeDtypeStruct((), jnp.int32),
    )
    rows = jax.ShapeDtypeStruct((seqs,), jnp.int32)
    forward = jax.jit(forward_logits, static_argnames=("config", "attention_fn"))
    compiled = forward.lower(params, config, ints, ints, cache, metadata, rows, attention).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


@dataclass
class StepHandle:
    """A dispatched step: device arrays until `result()` waits for them (the step's one sync)."""

    token_ids: jax.Array | None  # [R] sampled tokens (None: no sample rows)
    finite: jax.Array | None
    logprobs: TokenLogprobs | None
    prompt_logprobs: TokenLogprobs | None
    num_rows: int
    num_targets: int
    accepted: jax.Array | None = None  # [R] drafts' verdicts (None: no drafts)
    # The tokens as the next step's placeholders read them (`fixed_rows`), left on the device.
    placeholders: jax.Array | None = None

    def prefetch(self) -> StepHandle:
        """Starts the copies `result` will wait for, behind the step on the device."""
        results = (self.token_ids, self.finite, self.logprobs, self.prompt_logprobs, self.accepted)
        for leaf in jax.tree.leaves(results):
            leaf.copy_to_host_async()
        return self

    def result(self) -> ModelRunnerOutput:
        n = self.num_rows
        if self.token_ids is None:
            empty = np.zeros(0, np.int32), np.zeros(0, bool)
            return ModelRunnerOutput(*empty, None, _fetch(self.prompt_logprobs, self.num_targets))
        if self.token_ids.ndim == 2:  # [steps, rows] of several decode steps: [rows, steps]
            tokens, finite = np.asarray(self.token_ids)[:, :n].T, np.asarray(self.finite)[:, :n].T
            return ModelRunnerOutput(tokens, finite, _fetch_steps(self.logprobs, n))
        return ModelRunnerOutput(
            np.asarray(self.token_ids)[:n],
            np.asarray(self.finite)[:n],
            _fetch(self.logprobs, n),
            _fetch(self.prompt_logprobs, self.num_targets),
            None if self.accepted is None else np.asarray(self.accepted)[:n],
        )


def _fetch(logprobs: TokenLogprobs | None, n: int) -> TokenLogprobs | None:
    """The first n rows, on the host."""
    return None if logprobs is None else jax.tree.map(lambda a: np.asarray(a)[:n], logprobs)


def _fetch_steps(logprobs: TokenLogprobs | None, n: int) -> TokenLogprobs | None:
    """[steps, rows, ...] logprobs of several decode steps on the host, row-major: row r's
    step i at r * steps + i."""
    if logprobs is None:
        return None

    def rows_first(a: jax.Array) -> np.ndarray:
        a = np.swapaxes(np.asarray(a)[:, :n], 0, 1)
        return a.reshape(-1, *a.shape[2:])

    return jax.tree.map(rows_first, logprobs)


def _draw_counters(rows: Sequence[SampleRow], num_rows: int) -> np.ndarray:
    """[num_rows] each sample row's tokens generated so far (SamplingMetadata.steps)."""
    counters = np.zeros(num_rows, np.int32)
    counters[: len(rows)] = [r.num_tokens - r.num_prompt_tokens for r in rows]
    return counters


def _logits_rows(
    seqs: Sequence[ScheduledSequence], rows: Sequence[SampleRow]
) -> tuple[list[int], list[int], list[int]]:
    """The step's logits rows: each sample row's token, then each prompt-logprobs token's; and
    the prompt tokens those rows score."""
    ends = list(accumulate(len(s.token_ids) for s in seqs))  # ints: numpy scalars index slowly
    sample_rows = [ends[r.seq_index] - 1 - r.offset for r in rows]
    prompt_rows, targets = [], []
    for index, seq in enumerate(seqs):
        if seq.prompt_logprob_targets:
            first = ends[index] - len(seq.token_ids) + seq.prompt_logprobs_offset
            prompt_rows += range(first, first + len(seq.prompt_logprob_targets))
            targets += seq.prompt_logprob_targets
    return sample_rows, prompt_rows, targets


class ModelRunner:
    """Owns the KV pool and the bucketed step; `execute` runs one scheduled step."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        params: Params,
        kv_spec: KVCacheSpec,
        num_blocks: int,
        attention: AttentionBackend,
        sampling: SamplingKernels,
        tp: TensorParallel | None = None,
        device: jax.Device | None = None,
        num_host_blocks: int = 0,
        draft: DraftModel | None = None,
        kv_groups: KVCacheGroups | None = None,
        prepare_lora: Callable[[dict], dict] | None = None,
        prefetch_results: bool = False,
    ):
        """tp: run split over its group (params placed by it); device: the one device of
        an engine that is not the default device's (a data-parallel replica's);
        num_host_blocks: the host tier's blocks (swapping), 0 for none; draft: speculative
        decoding's draft model (`draft_model.py`), whose pool gets the same blocks;
        kv_groups: the KV cache groups (`kernels_pallas/kv_groups.py`), whose slabs
        `kv_spec` counts as its layers (default: one group, a slab per layer); prepare_lora:
        the platform's view of the LoRA slots (`Platform.prepare_lora`); prefetch_results:
        start each step's results' copies to the host at dispatch (`Platform.
        prefetches_results`)."""
        self.prefetch_results = prefetch_results
        self.kv_groups = kv_groups or single_group(model_config.num_layers)
        self.model_config, self.params = model_config, params
        self.attention, self.sampling = attention, sampling
        self.kv_spec, self.tp = kv_spec, tp
        self.block_size = block_size = config.block_size
        self._pool_sharding = None
        if tp is not None:
            layers = model_config.num_layers
            shape = jax.eval_shape(lambda: allocate_kv_cache(kv_spec, 2, block_size, layers))
            self._pool_sharding = tp.shardings(tp.pool_spec(shape))
        elif device is not None:
            self._pool_sharding = jax.sharding.SingleDeviceSharding(device)
        self.kv_cache = self._allocate(num_blocks)
        # LoRA adapters' slots and host cache (`lora_slots.py`), None when LoRA is off.
        self.lora = self._lora_slots(config, model_config, params["final_norm"].dtype)
        self._prepare_lora = prepare_lora or (lambda slots: slots)
        self.draft = draft
        self.draft_cache = self._allocate(num_blocks, draft.kv_spec) if draft else None
        self.host_kv: HostKV | None = None
        self.draft_host_kv: HostKV | None = None
        if num_host_blocks:
            sharding = self._pool_sharding
            sharding = sharding.k if isinstance(sharding, KVCache) else sharding
            self.host_kv = HostKV(kv_spec, num_host_blocks, block_size, sharding)
            if draft is not None:
                self.draft_host_kv = HostKV(draft.kv_spec, num_host_blocks, block_size, sharding)
        self.kv_scales: tuple[np.ndarray, np.ndarray] | None = None  # None: the pool's own
        spec = config.speculative_config
        drafted_step = (1 + spec.num_speculative_tokens,) if spec is not None else ()
        self.token_buckets = token_buckets(
            config.max_num_batched_tokens, drafted_step, config.batch_invariant
        )
        self.max_seqs_bucket, self.max_num_seqs = seqs_bucket(config), config.max_num_seqs
        # Only then is decode-only a static flag of the step, and a key of its compilations.
        self.has_decode_kernel = attention.has_decode_kernel
        self.max_blocks_per_seq = -(-config.max_model_len // block_size)
        if attention.cost_follows_context:
            self.width_buckets = [self.max_blocks_per_seq]
        else:
            self.width_buckets = sorted(
                {min(w, self.max_blocks_per_seq) for w in (16, 32, 64, 128)}
                | {self.max_blocks_per_seq}
            )
        max_tokens, max_seqs = self.token_buckets[-1], self.max_seqs_bucket
        self._tokens = np.zeros(max_tokens, np.int32)
        self._positions = np.zeros(max_tokens, np.int32)
        self._table_buffers(max_tokens, max_seqs)
        self._seq_lens = np.zeros(max_seqs, np.int32)
        self._query_start = np.zeros(max_seqs + 1, np.int32)
        self.num_compilations = 0  # compilations this runner's steps triggered
        self.masks = MaskFiller(model_config.vocab_size)
        # The last step's sampling arrays and what they were built from (`_sampling_metadata`).
        self._last_sampling: tuple[BatchSampling, PackedSampling] | None = None
        self._last_batch: BatchSampling | None = None  # the last step's (`_batch_sampling`)
        self._decode_batch: DecodeBatch | None = None  # the steady batch's kept inputs
        self._padding_arrays: dict[int, PackedSampling] = {}  # `_padding_sampling`'s
        self.num_scheduler_steps = config.num_scheduler_steps
        # The previous step's samples as the next one reads them: a row stride per iteration.
        self._no_previous = self._put(jnp.zeros(max_seqs * self.num_scheduler_steps, jnp.int32))
        self._placeholder_layout = dict(stride=self.max_seqs_bucket, size=self._no_previous.size)
        self._no_copies = np.zeros((0, 2), np.int32)
        # With a draft model, placeholders name the previous step's samples, then the drafts:
        # [max_seqs + max_seqs * k], the shape of every step's `previous`.
        self.drafts_size = max_seqs * draft.num_speculative_tokens if draft else 0
        self._no_previous_or_drafts = self._no_previous
        self.chain_buckets: list[int] = []  # the chain's padded sequence counts
        if draft is not None:
            self._no_previous_or_drafts = join_drafts(self._no_previous, None, self.drafts_size)
            # A drafted sequence has 2 tokens at least; speculation stops above the batch size.
            most = min(config.max_num_seqs, max(1, config.max_num_batched_tokens // 2))
            if spec.disable_by_batch_size is not None:
                most = min(most, spec.disable_by_batch_size)
            self.chain_buckets = [1 << i for i in range(next_power_of_2(most).bit_length())]

    def _table_buffers(self, max_tokens: int, max_seqs: int) -> None:
        """The slots and tables a step fills, per KV cache group (one unless the model mixes
        attention kinds: `kv_groups`), and each running request's block ids, kept across
        steps (`worker/block_table.py`)."""
        num_groups, width = self.kv_groups.num_groups, self.width_buckets[-1]
        self._slots = np.full((num_groups, max_tokens), PAD_SLOT, np.int32)
        self._tables = np.full((num_groups, max_seqs, width), NULL_BLOCK, np.int32)
        self.block_tables = BlockTables(2 * max_seqs, self.width_buckets[0])
        self.group_block_tables = [
            BlockTables(2 * max_seqs, self.width_buckets[0]) for _ in range(num_groups - 1)
        ]

    def _lora_slots(
        self, config: EngineConfig, model_config: ModelConfig, dtype: jnp.dtype
    ) -> LoRASlots | None:
        if not config.enable_lora:
            return None
        slots = partial(
            LoRASlots,
            model_config,
            config.max_loras,
            config.max_lora_rank,
            config.max_cpu_loras or config.max_loras,
            dtype,  # the model's activations'
        )
        tp = self.tp
        if tp is None:
            return slots(place=self._put)
        # Split as the weights they add to are: slots[name]["a" or "b"] [L, S, ...].
        return slots(
            place=lambda tree: jax.device_put(tree, tp.shardings(tp.lora_specs(tree))),
            layout=partial(layout_lora, config=model_config, size=tp.size),
            slot_config=tp.config,
        )

    def _step_params(self, seqs: Sequence[ScheduledSequence], num_tokens: int) -> Params:
        """The weights a step runs with: with LoRA on, the adapters' slots, loaded for these
        sequences' adapters, and each of the step's `num_tokens` tokens' slot (0 past them)."""
        if self.lora is None:
            return self.params
        slot_of = self.lora.activate(s.lora_id for s in seqs)
        lengths = [len(s.token_ids) for s in seqs]
        slots = np.zeros(num_tokens, np.int32)
        slots[: sum(lengths)] = np.repeat([slot_of[s.lora_id] for s in seqs], lengths)
        weights = self._prepare_lora(self.lora.weights)
        return {**self.params, "lora": {"weights": weights, "slots": slots}}

    def _allocate(self, num_blocks: int, spec: KVCacheSpec | None = None) -> KVCache:
        """A zeroed pool (the target's, or `spec`'s), created where it lives (split by KV head
        under tensor parallelism)."""
        allocate = partial(allocate_kv_cache, spec or self.kv_spec, num_blocks, self.block_size)
        if spec is None:  # the target's: its fp8 scales are per layer, not per slab
            allocate = partial(allocate, num_scale_layers=self.model_config.num_layers)
        if self._pool_sharding is None:
            return allocate()
        return jax.jit(allocate, out_shardings=self._pool_sharding)()

    @property
    def _step_sharding(self) -> jax.sharding.Sharding | None:
        """Where the step's small arrays live: replicated over a tensor-parallel group, else
        the pool's device (None: the default device)."""
        if self.tp is not None:
            return jax.sharding.NamedSharding(self.tp.mesh, P())
        return self._pool_sharding

    def _put(self, tree: Any) -> Any:
        """Arrays the step reads, on its devices (replicated over a group)."""
        return jax.device_put(tree, self._step_sharding)

    def _put_sampling(self, meta: SamplingMetadata) -> PackedSampling:
        """Sampling arrays on the step's devices in one transfer, their bits packed (each
        array put alone is a transfer of its own), which the sampler's call takes apart. The
        sampler always gets its arrays this way: one compiled variant per layout."""
        return self._put_packed(pack_bits(meta))

    def _put_packed(self, packed: Packed) -> PackedSampling:
        """`_put_sampling` of arrays already in `pack_bits`' form."""
        bits, layout = packed
        return PackedSampling(sender(self._step_sharding)(padded(bits)), layout)

    def _forward(
        self,
        params,
        token_ids,
        positions,
        kv_cache,
        metadata,
        rows,
        copies,
        sources,
        previous,
        decode_only: bool | None = None,
        steps: np.ndarray | None = None,
    ):
        """(logits, kv_cache, the draw counters on the device): `steps` [R], the sample rows'
        counters (SamplingMetadata.steps), travel with the inputs (default zeros)."""
        if steps is None:
            steps = np.zeros(len(rows), np.int32)
        inputs = (token_ids, sources, positions, metadata, rows, copies, steps)
        model = (self.model_config, self.attention, decode_only, self.tp)
        return self._forward_packed(params, kv_cache, inputs, previous, *model)

    def _forward_packed(
        self, params, kv_cache, inputs, previous, config, attention, decode_only, tp
    ):
        """`forward_step` on `inputs` packed into one host array (`step_inputs`)."""
        packed, layout = pack(inputs)
        return self._compiled(
            forward_step,
            params,
            packed,
            previous,
            kv_cache,
            layout=layout,
            config=config,
            attention_fn=attention,
            decode_only=decode_only,
            tp=tp,
        )

    def _compiled(self, function, *args, **kwargs):
        """function(*args, **kwargs), a shared jitted step, counting what it compiles."""
        cached = function._cache_size()  # its compiled shapes so far
        out = function(*args, **kwargs)
        self.num_compilations += function._cache_size() - cached
        return out

    def _draft_fill(self, tokens, positions, metadata, copies, sources, previous, decode_only):
        """The draft's forward over the step's tokens (drafts in place): its KV, into the
        same slots as the target's (the one logits row is not used)."""
        draft = self.draft
        if not draft.attention.has_decode_kernel:
            decode_only = None
        one = np.zeros(1, np.int32)
        inputs = (tokens, sources, positions, metadata, one, copies, one)
        _, self.draft_cache, _ = self._forward_packed(
            draft.params, self.draft_cache, inputs, previous, draft.config, draft.attention,
            decode_only, None,
        )  # fmt: skip

    def _draft_chain(
        self, drafted, tokens, sources, metadata, previous, copies
    ) -> jax.Array | None:
        """The drafts [R, k] of the step's `drafted` sequences (see `prepare`), or None; the
        chain makes the step's copy-on-write copies in the draft's pool first."""
        if not drafted:
            return None
        k = self.draft.num_speculative_tokens
        inputs = chain_inputs(
            drafted,
            tokens,
            sources,
            np.asarray(metadata.slot_mapping),
            np.asarray(metadata.block_tables),
            k,
            self._bucket_chain(len(drafted)),
        )
        return self._run_chain(inputs, previous, copies)

    def _run_chain(self, inputs: ChainInputs, previous: jax.Array, copies) -> jax.Array:
        draft = self.draft
        drafts, self.draft_cache = self._compiled(
            draft_chain,
            draft.params,
            self.draft_cache,
            inputs,
            previous,
            copies,
            config=draft.config,
            attention_fn=draft.attention,
            decode_only=True if draft.attention.has_decode_kernel else None,
            vocab_size=draft.vocab_size,
        )
        return drafts

    def _bucket_tokens(self, num_tokens: int) -> int:
        for bucket in self.token_buckets:
            if num_tokens <= bucket:
                return bucket
        raise ValueError(f"{num_tokens} tokens exceed the step budget {self.token_buckets[-1]}")

    def _bucket_chain(self, num_drafted: int) -> int:
        return next(
            (b for b in self.chain_buckets if num_drafted <= b), next_power_of_2(num_drafted)
        )

    def _bucket_width(self, num_blocks: int) -> int:
        return next(w for w in self.width_buckets if num_blocks <= w)

    def _decode_only(self, seqs: Sequence[ScheduledSequence]) -> bool | None:
        """The step's static attention flag: True when every sequence has one new token (the
        backend's decode kernel then runs), False otherwise; None for backends without one."""
        if not self.has_decode_kernel:
            return None
        return all(len(s.token_ids) <= 1 for s in seqs)

    def _step_variants(self, t_pad: int) -> list[bool | None]:
        """The decode_only flags a step of bucket t_pad can take, one compilation each: True if
        the bucket's fewest tokens fit one per sequence, False if it can hold a 2-token chunk."""
        if not self.has_decode_kernel:
            return [None]
        variants = [True] if self._holds_decodes_only(t_pad) else []
        return variants + ([False] if t_pad > 1 else [])

    def _holds_decodes_only(self, t_pad: int) -> bool:
        """Whether a step of bucket t_pad can be one token per sequence: its fewest tokens
        are not more than max_num_seqs."""
        fewest = 1 + max((b for b in self.token_buckets if b < t_pad), default=0)
        return fewest <= self.max_num_seqs

    def prepare(
        self,
        seqs: Sequence[ScheduledSequence],
        num_rows: int,
        block_copies: Sequence[tuple[int, int]],
        rows_for_every_token: bool = False,
        head: tuple | None = None,
    ) -> tuple:
        """Fills the host buffers for a step; returns the forward's array arguments, the
        padded number of logits rows (at least the padded tokens with `rows_for_every_token`:
        prompt logprobs then cost one forward shape per token bucket, not one per row count),
        and the sequences with model drafts: (index, its last token's index in the step, that
        token's position, its number of drafts m). Their drafts' stand-ins become
        placeholders naming the drafts, after the previous step's samples. `head`: one-token
        sequences before `seqs` (a steady batch's rows: their table rows, the most table
        entries any uses, their tokens and positions; one KV cache group)."""
        num_tokens = sum(len(s.token_ids) for s in seqs)
        # Gathered in Python lists and written with one numpy call each: most sequences are
        # decodes of one token, for which a numpy call per sequence costs more than the work.
        table_rows, most, step_tokens, step_positions, ends, lens = [], 0, [], [], [], []
        if head is not None:
            head_rows, most, step_tokens, step_positions = head
            table_rows, step_tokens = head_rows.tolist(), list(step_tokens)
            step_positions = list(step_positions)
            ends, lens = list(range(1, len(table_rows) + 1)), [p + 1 for p in step_positions]
            num_tokens += len(table_rows)
        end = len(ends)
        # The sequences' rows of the persistent tables, brought up to date, in one gather.
        update = self.block_tables.update
        table_rows += [update(s.request_id, s.table_start, s.new_block_ids) for s in seqs]
        most = max(most, *(s.table_start + len(s.new_block_ids) for s in seqs))
        group_tables = [self.block_tables.gather(table_rows, most)]  # [sequences, most]
        for group, tables in enumerate(self.group_block_tables):  # every one as long
            rows = [tables.update(s.request_id, *s.group_tables[group]) for s in seqs]
            group_tables.append(tables.gather(rows, most))
        for seq in seqs:
            computed, token_ids = seq.num_computed_tokens, seq.token_ids
            q_len = len(token_ids)
            if q_len == 1:  # a decode: most sequences of most steps
                step_tokens.append(token_ids[0])
                step_positions.append(computed)
            else:
                step_tokens += token_ids
                step_positions += range(computed, computed + q_len)
            end += q_len
            ends.append(end)
            lens.append(computed + q_len)
        if num_tokens == len(ends):  # one token per sequence
            owner = np.arange(num_tokens)
        else:
            owner = np.repeat(np.arange(len(ends)), np.diff(ends, prepend=0))
        inputs = self._fill_inputs(
            group_tables, step_tokens, step_positions, owner, ends, lens, block_copies, seqs
        )
        r_pad = self._rows_bucket(num_rows, len(inputs[0]), rows_for_every_token)
        return *inputs[:3], r_pad, *inputs[3:]

    def _fill_inputs(
        self,
        group_tables: list[np.ndarray],
        step_tokens: Sequence[int],
        step_positions: Sequence[int],
        owner: np.ndarray,
        ends: Sequence[int],
        lens: Sequence[int],
        block_copies: Sequence[tuple[int, int]],
        seqs: Sequence[ScheduledSequence] = (),
    ) -> tuple:
        """The step's buffers from its tokens (`owner`: each one's sequence), the sequences'
        query ends and lengths, and each KV cache group's tables [seqs, blocks]; `seqs` for
        their model drafts. Returns (tokens, positions, metadata, copies, sources, drafted):
        views of buffers the next step refills (each consumer copies them before dispatch:
        the forward packs them, the draft chain gathers its rows)."""
        num_tokens, num_seqs = len(step_tokens), len(lens)
        t_pad = self._bucket_tokens(num_tokens)
        s_pad = min(t_pad, self.max_seqs_bucket)
        if num_seqs > s_pad:
            raise ValueError(f"{num_seqs} sequences exceed max_num_seqs {self.max_seqs_bucket}")
        width = self._bucket_width(group_tables[0].shape[1])
        bs = self.block_size
        tokens, positions, slots = (
            self._tokens[:t_pad],
            self._positions[:t_pad],
            self._slots[:, :t_pad],
        )
        tables, seq_lens = self._tables[:, :s_pad, :width], self._seq_lens[:s_pad]
        query_start = self._query_start[: s_pad + 1]
        slots[:, num_tokens:] = PAD_SLOT
        tokens[num_tokens:] = 0
        positions[num_tokens:] = 0
        tables.fill(NULL_BLOCK)
        for group, group_table in enumerate(group_tables):
            tables[group, :num_seqs, : group_table.shape[1]] = group_table
        seq_lens.fill(0)
        query_start.fill(num_tokens)
        tokens[:num_tokens] = step_tokens
        drafted = []
        if self.draft is not None:
            k = self.draft.num_speculative_tokens
            drafted = mark_model_drafts(seqs, tokens, self.max_seqs_bucket, k)
        # Placeholders (negative ids) name the previous step's sample rows: the forward reads
        # those tokens on the device (async scheduling).
        sources = np.where(tokens < 0, -1 - tokens, -1).astype(np.int32)
        np.maximum(tokens, 0, out=tokens)
        positions[:num_tokens] = step_positions
        # Each token's slot from its sequence's table row, for all tokens at once.
        step = positions[:num_tokens]
        slots[:, :num_tokens] = tables[:, owner, step // bs] * bs + step % bs
        seq_lens[:num_seqs] = lens
        query_start[0] = 0
        query_start[1 : num_seqs + 1] = ends
        copies = np.full(
            (next_power_of_2(len(block_copies)) if block_copies else 0, 2),
            NULL_BLOCK,
            np.int32,
        )
        if block_copies:
            copies[: len(block_copies)] = block_copies
        grouped = bool(self.kv_groups.metadata_dims)  # else without the group dimension
        metadata = AttentionMetadata(
            slot_mapping=slots if grouped else slots[0],
            block_tables=tables if grouped else tables[0],
            seq_lens=seq_lens,
            query_start_loc=query_start,
            num_seqs=np.int32(num_seqs),
            num_tokens=np.int32(num_tokens),
        )
        return tokens, positions, metadata, copies, sources, drafted

    def execute(
        self,
        seqs: Sequence[ScheduledSequence],
        freed_request_ids: Sequence[Hashable],
        rows: Sequence[SampleRow],
        block_copies: Sequence[tuple[int, int]] = (),
        num_prompt_logprobs: int | None = None,
        previous: StepHandle | None = None,
        swaps: tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]] = ((), ()),
    ) -> ModelRunnerOutput:
        """Runs one step and waits for its result."""
        handle = self.dispatch(
            seqs, freed_request_ids, rows, block_copies, num_prompt_logprobs, previous, swaps
        )
        return handle.result()

    def dispatch(
        self,
        seqs: Sequence[ScheduledSequence],
        freed_request_ids: Sequence[Hashable],
        rows: Sequence[SampleRow],
        block_copies: Sequence[tuple[int, int]] = (),
        num_prompt_logprobs: int | None = None,
        previous: StepHandle | None = None,
        swaps: tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]] = ((), ()),
        num_steps: int = 1,
        row_steps: Sequence[int] = (),
        decode: DecodeStep | None = None,
        batch_id: int = 0,
    ) -> StepHandle:
        """Dispatches one step without waiting for it: the swaps (device -> host copies,
        then host -> device), copy-on-write copies, the forward, a sample for each row, and
        the logprobs of the prompt tokens the sequences name (`num_prompt_logprobs` top
        ones). Placeholder tokens in `seqs` are `previous`'s samples, read on the device.
        num_steps > 1: that many decode steps (`decode_steps`), row r taking row_steps[r].
        decode: a steady decode step of the batch a step with that `batch_id` formed (whose
        inputs are kept: `decode_batch.py`), its rows before `seqs`' (then `rows` are
        only theirs)."""
        for tables in (self.block_tables, *self.group_block_tables):
            tables.forget(freed_request_ids)  # before the step's own updates
        self._swap(*swaps)
        if decode is not None:
            if seqs:  # sequences beside the batch's rows: a step of both, the general way
                batch = self._update_batch(decode)
                handle = self._dispatch_one(
                    seqs, rows, block_copies, num_prompt_logprobs, previous, (batch, decode)
                )
            elif num_steps > 1:
                handle = self._dispatch_decode_steps(decode, block_copies, previous)
            else:
                handle = self._dispatch_decode(decode, block_copies, previous)
            return handle.prefetch() if self.prefetch_results else handle
        self._decode_batch = None
        if not seqs:
            return StepHandle(None, None, None, None, 0, 0)
        if num_steps > 1:
            handle = self._dispatch_steps(seqs, rows, block_copies, previous, num_steps, row_steps)
        else:
            handle = self._dispatch_one(seqs, rows, block_copies, num_prompt_logprobs, previous)
        if batch_id:
            self._decode_batch = self._keep_batch(batch_id, seqs, rows, num_steps)
        return handle.prefetch() if self.prefetch_results else handle

    @property
    def supports_steady_decode(self) -> bool:
        """Whether this runner keeps a steady batch's inputs: none of the per-row state it
        does not keep (a draft model's, adapters', several KV cache groups' tables)."""
        return self.draft is None and self.lora is None and self.kv_groups.num_groups == 1

    def _keep_batch(
        self,
        batch_id: int,
        seqs: Sequence[ScheduledSequence],
        rows: Sequence[SampleRow],
        num_steps: int,
    ) -> DecodeBatch:
        """What a steady batch's steps keep of the step that formed it (one token and one
        plain sample row per sequence: the scheduler's `_forms_steady`), which ran
        `num_steps` decode steps."""
        if len(rows) != len(seqs) or any(len(s.token_ids) != 1 for s in seqs):
            raise RuntimeError("a steady batch needs one token and one sample row a sequence")
        request_ids = [s.request_id for s in seqs]
        table_rows, num_blocks = self.block_tables.rows_of(request_ids)
        counters = _draw_counters(rows, self._rows_bucket(len(rows)))
        kinds = row_kinds(r.params for r in rows)
        batch = DecodeBatch.of(
            batch_id, request_ids, table_rows, num_blocks, counters, self._last_batch, kinds,
            list(rows), self._decode_only(seqs),
        )  # fmt: skip
        batch.advance = num_steps
        return batch

    def _rows_bucket(
        self, num_rows: int, t_pad: int | None = None, rows_for_every_token: bool = False
    ) -> int:
        """The padded sample rows of a step of t_pad padded tokens (default: num_rows
        one-token sequences'): the padded sequences, or tokens (`prepare`)."""
        t_pad = self._bucket_tokens(num_rows) if t_pad is None else t_pad
        s_pad = min(t_pad, self.max_seqs_bucket)
        return max(t_pad if rows_for_every_token else s_pad, next_power_of_2(num_rows))

    def _rebuild(
        self, batch: DecodeBatch, removed: Sequence[int], added: Sequence[tuple[Any, SampleRow]]
    ) -> DecodeBatch:
        """The kept batch without the `removed` rows (finished) and with the `added` ones
        last (joined). Its arrays are edited, costing the rows named, not rebuilt."""
        request_ids, rows, gone, keep = batch.without(removed)
        table_rows, counters = batch.table_rows[keep], batch.counters[keep]
        num_blocks, kinds = batch.num_blocks, batch.kinds - row_kinds(r.params for r in gone)
        new_rows = [row for _, row in added]
        if added:
            new_ids = [request_id for request_id, _ in added]
            request_ids, rows = request_ids + new_ids, rows + new_rows
            new_table_rows, most = self.block_tables.rows_of(new_ids)
            table_rows = np.concatenate([table_rows, new_table_rows])
            counters = np.concatenate([counters, _draw_counters(new_rows, len(new_rows))])
            num_blocks, kinds = max(num_blocks, most), kinds + row_kinds(r.params for r in new_rows)
        r_pad = self._rows_bucket(len(rows))
        padded = np.zeros(r_pad, np.int32)
        padded[: len(rows)] = counters
        host = device = distinct = None  # a full build when first needed
        if (old := batch.host_sampling) is not None:
            joined = self.build_sampling_metadata(new_rows, len(new_rows)) if added else None
            distinct = batch.distinct[keep]
            if added:  # with a kept row differing, joined rows count as differing unchecked
                if distinct.any():
                    joined_distinct = np.ones(len(new_rows), bool)
                else:
                    joined_distinct = distinct_rows(joined, len(new_rows))
                distinct = np.concatenate([distinct, joined_distinct])
            if not distinct.any():  # greedy rows asking nothing else: no edit, no transfer
                host, device = padding_rows(r_pad), self._padding_sampling(r_pad)
            else:  # the joined rows packed only here: a batch like padding needs none
                host = edit_rows(old, keep, packed_rows(joined) if added else None, r_pad)
                if host is None:
                    distinct = None
                elif (kept := batch.device_sampling) is not None and same_arrays(host, old):
                    device = kept  # compared only where there is a copy to keep
        return DecodeBatch.of(
            batch.batch_id, request_ids, table_rows, num_blocks, padded,
            BatchSampling.of_kinds([], kinds), kinds, rows, batch.decode_only, host, device,
            distinct,
        )  # fmt: skip

    def _update_batch(self, decode: DecodeStep) -> DecodeBatch:
        """The kept batch for a steady step: each row's draw counter on by the last step's
        decode steps, the rows removed and joined since, the table changes."""
        batch = self._decode_batch
        if batch is None or batch.batch_id != decode.batch_id:
            kept = batch.batch_id if batch else None
            raise RuntimeError(
                f"a steady step of batch {decode.batch_id} but the runner keeps batch {kept}"
            )
        batch.counters[: len(batch.rows)] += batch.advance  # tokens each (not a joined row)
        if decode.removed or decode.added:
            batch = self._decode_batch = self._rebuild(batch, decode.removed, decode.added)
        for request_id, start, block_ids in decode.table_updates:
            self.block_tables.update(request_id, start, block_ids)
            batch.num_blocks = max(batch.num_blocks, start + len(block_ids))
        batch.advance = decode.num_steps
        return batch

    def prepare_decode(self, decode: DecodeStep, block_copies: Sequence[tuple[int, int]]) -> tuple:
        """`prepare` for a steady decode step, from the kept batch and the step's arrays:
        (tokens, positions, metadata, copies, sources)."""
        batch = self._update_batch(decode)
        tables = [self.block_tables.gather(batch.table_rows, batch.num_blocks)]
        positions = np.asarray(decode.positions, np.int32)
        tokens = np.asarray(decode.token_ids, np.int32)
        inputs = self._fill_inputs(
            tables, tokens, positions, batch.owner, batch.ends, positions + 1, block_copies
        )
        return inputs[:5]

    def _dispatch_decode(
        self,
        decode: DecodeStep,
        block_copies: Sequence[tuple[int, int]],
        previous: StepHandle | None,
    ) -> StepHandle:
        """A steady decode step: the forward over the kept batch, a sample for each row."""
        tokens, positions, metadata, copies, sources = self.prepare_decode(decode, block_copies)
        batch = self._decode_batch
        logits, self.kv_cache, steps = self._forward(
            self.params,
            tokens,
            positions,
            self.kv_cache,
            metadata,
            batch.logits_rows,
            copies,
            sources,
            self._previous(previous),
            decode_only=batch.decode_only,
            steps=batch.counters,
        )
        sampling = batch.sampling
        meta = self._decode_sampling(batch, steps)
        layout = self._placeholder_layout
        out, placeholders = sample_step(logits, meta, self.sampling, **sampling.flags(), **layout)
        logprobs = out.logprobs if sampling.num_logprobs is not None else None
        handle = StepHandle(out.token_ids, out.finite, logprobs, None, len(batch.rows), 0)
        handle.placeholders = placeholders
        return handle

    def _dispatch_decode_steps(
        self,
        decode: DecodeStep,
        block_copies: Sequence[tuple[int, int]],
        previous: StepHandle | None,
    ) -> StepHandle:
        """A steady step of several decode steps over the kept batch (`decode_steps`), row
        r taking decode.row_steps[r]; its slots are reserved."""
        tokens, positions, metadata, copies, sources = self.prepare_decode(decode, block_copies)
        batch = self._decode_batch
        limits = np.zeros(len(tokens), np.int32)
        limits[: len(decode.row_steps)] = decode.row_steps
        inputs = (self.params, tokens, sources, self._previous(previous), positions, metadata)
        inputs += (copies, limits, batch.counters)
        meta = self._decode_sampling(batch, None)  # the counters travel with the inputs
        tokens_out, finite, logprobs, placeholders = self._decode_steps(
            inputs, meta, decode.num_steps, **batch.sampling.flags()
        )
        num_rows = len(batch.rows)
        return StepHandle(tokens_out, finite, logprobs, None, num_rows, 0, None, placeholders)

    def _decode_sampling(self, batch: DecodeBatch, steps: jax.Array | None) -> PackedSampling:
        """The kept batch's sampling arrays on the device, with `steps` as their draw
        counters: built once, sent again only after rows left or joined."""
        if batch.device_sampling is None:
            host = self._host_sampling(batch)
            if batch.distinct.any():
                batch.device_sampling = self._put_packed(host)
            else:
                batch.device_sampling = self._padding_sampling(len(batch.counters))
        return replace(batch.device_sampling, steps=steps)

    def _host_sampling(self, batch: DecodeBatch) -> Packed:
        """The kept batch's sampling arrays on the host, built the first time they are
        needed (then edited as rows leave and join), and which rows are not padding-like."""
        if batch.host_sampling is None:
            built = self.build_sampling_metadata(batch.rows, len(batch.counters))
            batch.host_sampling = packed_rows(built)
            batch.distinct = distinct_rows(built, len(batch.rows))
        return batch.host_sampling

    def _padding_sampling(self, num_rows: int) -> PackedSampling:
        """`padding_rows(num_rows)` on the device, sent once per row bucket: the arrays of
        every batch of greedy rows that ask nothing else (warmup's too)."""
        meta = self._padding_arrays.get(num_rows)
        if meta is None:
            meta = self._padding_arrays[num_rows] = self._put_packed(padding_rows(num_rows))
        return meta

    def _dispatch_one(
        self,
        seqs: Sequence[ScheduledSequence],
        rows: Sequence[SampleRow],
        block_copies: Sequence[tuple[int, int]],
        num_prompt_logprobs: int | None,
        previous: StepHandle | None,
        head: tuple[DecodeBatch, DecodeStep] | None = None,
    ) -> StepHandle:
        """One step: the forward, a sample for each row, the prompt logprobs asked. `head`:
        a steady batch's rows (and their step) before the sequences', a sample row each."""
        sample_rows, prompt_rows, targets = _logits_rows(seqs, rows)
        counters = _draw_counters(rows, len(rows))
        if head is not None:
            batch, decode = head
            n = len(batch.rows)
            sample_rows = list(range(n)) + [r + n for r in sample_rows]
            prompt_rows = [r + n for r in prompt_rows]
            counters = np.concatenate([batch.counters[:n], counters])
            rows = batch.rows + list(rows)
            head = (batch.table_rows, batch.num_blocks, decode.token_ids, decode.positions)
        num_rows = len(rows) + len(prompt_rows)
        tokens, positions, metadata, r_pad, copies, sources, drafted = self.prepare(
            seqs, num_rows, block_copies, rows_for_every_token=bool(prompt_rows), head=head
        )
        logits_rows = np.zeros(r_pad, np.int32)
        logits_rows[:num_rows] = sample_rows + prompt_rows
        sampled = self._previous(previous)
        decode_only = self._decode_only(seqs)
        drafts = None
        if self.draft is not None:
            drafts = self._draft_chain(drafted, tokens, sources, metadata, sampled, copies)
            sampled = join_drafts(sampled, drafts, self.drafts_size)
            fill_copies = copies if drafts is None else self._no_copies  # the chain made them
            self._draft_fill(
                tokens, positions, metadata, fill_copies, sources, sampled, decode_only
            )
        logits, self.kv_cache, steps = self._forward(
            self._step_params(seqs, len(tokens)),
            tokens,
            positions,
            self.kv_cache,
            metadata,
            logits_rows,
            copies,
            sources,
            sampled,
            decode_only=decode_only,
            steps=np.pad(counters, (0, r_pad - len(counters))),
        )
        prompt = None
        if prompt_rows:
            prompt = self._prompt_logprobs(logits, len(rows), targets, num_prompt_logprobs)
        if not rows:
            return StepHandle(None, None, None, prompt, 0, len(targets))
        sampled = None if head is None else self._sample_beside(logits, rows, r_pad, steps)
        if sampled is None:
            sampled = self._sample(logits, rows, r_pad, drafted, drafts, steps)
        out, placeholders, num_logprobs = sampled
        return StepHandle(
            out.token_ids,
            out.finite,
            out.logprobs if num_logprobs is not None else None,
            prompt,
            len(rows),
            len(targets),
            out.accepted,
            placeholders,
        )

    def _previous(self, previous: StepHandle | None) -> jax.Array:
        """The previous step's samples where this step's placeholders name them."""
        if previous is None or previous.placeholders is None:
            return self._no_previous
        return previous.placeholders

    def _dispatch_steps(
        self,
        seqs: Sequence[ScheduledSequence],
        rows: Sequence[SampleRow],
        block_copies: Sequence[tuple[int, int]],
        previous: StepHandle | None,
        num_steps: int,
        row_steps: Sequence[int],
    ) -> StepHandle:
        """num_steps decode steps of one token per sequence in one dispatch (`decode_steps`):
        the slots are reserved, each row's draws are those single steps would make."""
        tokens, positions, metadata, r_pad, copies, sources, _ = self.prepare(
            seqs, len(rows), block_copies
        )
        params = self._step_params(seqs, len(tokens))
        limits = np.zeros(len(tokens), np.int32)
        limits[: len(row_steps)] = row_steps
        batch = self._batch_sampling(rows, r_pad)
        # A row with a token mask takes one step: its mask is that step's.
        token_mask = self.masks.fill([r.constraints for r in rows], r_pad)
        tokens_out, finite, logprobs, placeholders = self._decode_steps(
            (
                params,
                tokens,
                sources,
                self._previous(previous),
                positions,
                metadata,
                copies,
                limits,
                _draw_counters(rows, r_pad),  # the first step's
            ),
            self._sampling_metadata(rows, batch, None, token_mask),
            num_steps,
            **batch.flags(),
        )
        return StepHandle(tokens_out, finite, logprobs, None, len(rows), 0, None, placeholders)

    def _decode_steps(
        self, inputs: tuple, meta: PackedSampling, num_steps: int, **flags: bool | int | None
    ) -> tuple[jax.Array, jax.Array, TokenLogprobs | None, jax.Array]:
        """`decode_steps` on the pool: inputs are (params, tokens, sources, previous,
        positions, metadata, copies, limits, draw counters); flags are its use_truncation,
        all_greedy, num_logprobs and use_penalties. Returns ([num_steps, R] tokens, finite,
        logprobs, the tokens as the next step's placeholders)."""
        args, options = self._decode_steps_call(inputs, meta, num_steps, flags)
        *out, self.kv_cache, placeholders = self._compiled(decode_steps, *args, **options)
        return (*out, placeholders)

    def _decode_steps_call(
        self, inputs: tuple, meta: PackedSampling, num_steps: int, flags: dict
    ) -> tuple[tuple, dict]:
        """`decode_steps`' arguments and options (every flag passed, always the same way: a
        keyword left to its default would be another compilation)."""
        params, tokens, sources, previous, positions, metadata, copies, limits, steps = inputs
        rows = np.arange(meta.num_rows, dtype=np.int32)
        packed, layout = pack((tokens, sources, positions, metadata, rows, copies, limits, steps))
        args = (params, packed, previous, self.kv_cache, meta)
        options = dict(
            layout=layout,
            config=self.model_config,
            attention_fn=self.attention,
            decode_only=True if self.has_decode_kernel else None,
            tp=self.tp,
            num_steps=num_steps,
            block_size=self.block_size,
            kernels=self.sampling,
            **self._placeholder_layout,
        )
        names = ("use_truncation", "all_greedy", "num_logprobs", "use_penalties")
        return args, options | {name: flags[name] for name in names}

    def _padding_decode_inputs(self, t_pad: int, width: int) -> tuple[tuple, PackedSampling]:
        """`_decode_steps`' inputs for a step of only padding at bucket t_pad and width, with
        greedy sampling arrays."""
        params, tokens, positions, _, metadata, _, copies, sources, previous = self._padding_step(
            t_pad, width
        )
        num_rows = min(t_pad, self.max_seqs_bucket)
        meta = self._padding_sampling(num_rows)
        limits, steps = np.zeros(t_pad, np.int32), np.zeros(num_rows, np.int32)
        inputs = (params, tokens, sources, previous, positions, metadata, copies, limits, steps)
        return inputs, meta

    # The flags of greedy rows with nothing else asked (warmup, inspection).
    _GREEDY_STEPS = dict(
        use_truncation=False, all_greedy=True, num_logprobs=None, use_penalties=False
    )

    def _warm_decode_steps(self, t_pad: int, width: int) -> None:
        """Compiles the loop of several decode steps (greedy) at each step count a step can
        take (powers of two below num_scheduler_steps, and it), if a step of bucket t_pad can
        hold only decodes."""
        most = self.num_scheduler_steps
        if most == 1 or not self._holds_decodes_only(t_pad):
            return
        inputs, meta = self._padding_decode_inputs(t_pad, width)
        counts = [1 << i for i in range(1, most.bit_length()) if 1 << i < most] + [most]
        for num_steps in counts:
            self._decode_steps(inputs, meta, num_steps, **self._GREEDY_STEPS)

    def lower_decode_steps(self, num_tokens: int, num_steps: int, **lowering) -> jax.stages.Lowered:
        """A step of num_steps greedy decode steps at num_tokens' bucket, lowered without
        running, for inspection (as `lower_step`)."""
        t_pad = self._bucket_tokens(num_tokens)
        inputs, meta = self._padding_decode_inputs(t_pad, self.width_buckets[0])
        args, options = self._decode_steps_call(inputs, meta, num_steps, self._GREEDY_STEPS)
        return decode_steps.trace(*args, **options).lower(**lowering)

    def _swap(self, swaps_out: Sequence[tuple[int, int]], swaps_in: Sequence[tuple[int, int]]):
        """The step's swaps, out first: a block swapped in may be one a victim just left."""
        if not swaps_out and not swaps_in:
            return
        self.host_kv.copy_out(self.kv_cache, swaps_out)
        self.kv_cache = self.host_kv.copy_in(self.kv_cache, swaps_in)
        if self.draft_host_kv is not None:
            self.draft_host_kv.copy_out(self.draft_cache, swaps_out)
            self.draft_cache = self.draft_host_kv.copy_in(self.draft_cache, swaps_in)

    def _prompt_logprobs(
        self, logits: jax.Array, first: int, targets: list[int], num_logprobs: int | None
    ) -> TokenLogprobs:
        """The prompt tokens' logprobs, from logits rows first.. (after the sample rows)."""
        p_pad = next_power_of_2(len(targets))
        which = np.zeros(p_pad, np.int32)
        which[: len(targets)] = range(first, first + len(targets))
        padded_targets = np.zeros(p_pad, np.int32)
        padded_targets[: len(targets)] = targets
        return prompt_logprobs(logits, which, padded_targets, num_logprobs or 0, self.sampling)

    def _sample(
        self,
        logits: jax.Array,
        rows: Sequence[SampleRow],
        r_pad: int,
        drafted: list,
        drafts: jax.Array | None,
        steps: jax.Array,
    ) -> tuple[SamplerOutput, jax.Array, int | None]:
        """A token for each sample row (verifying drafts), those tokens as the next step's
        placeholders read them, and the top logprobs wanted; steps: the rows' draw counters,
        on the device (the forward's)."""
        constraints = [r.constraints for r in rows]
        if any(c is not None and c.processors for c in constraints):
            logits = self._run_processors(logits, rows)
        # Built while the forward runs on the device.
        token_mask = self.masks.fill(constraints, r_pad)
        batch = self._batch_sampling(rows, r_pad)
        draft_ids = [r.draft_token for r in rows]
        draft_ids = draft_ids if any(d >= 0 for d in draft_ids) or drafted else None
        meta = self._sampling_metadata(rows, batch, steps, token_mask, draft_ids)
        if drafted:
            k = self.draft.num_speculative_tokens
            index = verify_index(drafted, [(r.seq_index, r.offset) for r in rows], k, r_pad)
            meta = replace(meta, draft_token_ids=verified_drafts(drafts, index))
        layout = self._placeholder_layout
        out, placeholders = sample_step(logits, meta, self.sampling, **batch.flags(), **layout)
        return out, placeholders, batch.num_logprobs

    def _sample_beside(
        self, logits: jax.Array, rows: Sequence[SampleRow], r_pad: int, steps: jax.Array
    ) -> tuple[SamplerOutput, jax.Array, int | None] | None:
        """`_sample` for a step beside the kept batch, its rows first (None: the rows need a
        full build, `_sample`)."""
        found = self._beside_sampling(rows, r_pad, steps)
        if found is None:
            return None
        sampling, meta = found
        layout = self._placeholder_layout
        out, placeholders = sample_step(logits, meta, self.sampling, **sampling.flags(), **layout)
        return out, placeholders, sampling.num_logprobs

    def _beside_sampling(
        self, rows: Sequence[SampleRow], r_pad: int, steps: jax.Array
    ) -> tuple[BatchSampling, PackedSampling] | None:
        """The kept batch's sampling arrays with the rows after its own edited in, as a
        join edits them, and their flags, on the device; None where a row needs what only
        `_sample` gives (a mask, a logits processor, a draft)."""
        batch = self._decode_batch
        n = len(batch.rows)
        new_rows = rows[n:]
        if any(r.constraints is not None or r.draft_token >= 0 for r in new_rows):
            return None
        joined = self.build_sampling_metadata(new_rows, len(new_rows))
        kept = self._host_sampling(batch)
        sampling = BatchSampling.of_kinds([], batch.kinds + row_kinds(r.params for r in new_rows))
        if not (batch.distinct.any() or distinct_rows(joined, len(new_rows)).any()):
            return sampling, replace(self._padding_sampling(r_pad), steps=steps)
        host = edit_rows(kept, np.arange(n), packed_rows(joined), r_pad)
        if host is None:
            return None
        if same_arrays(host, kept):  # greedy rows like the padding: the batch's own arrays
            return sampling, self._decode_sampling(batch, steps)
        return sampling, replace(self._put_packed(host), steps=steps)

    def _batch_sampling(self, rows: Sequence[SampleRow], r_pad: int) -> BatchSampling:
        """What the rows ask of the sampler: the last step's answer while the batch is
        steady (the same params and seeds in the same order), else worked out again."""
        key = [r_pad, *(r.params for r in rows), *(r.seed for r in rows)]
        last = self._last_batch
        if last is None or last.key != key:
            last = self._last_batch = BatchSampling.of(key, [r.params for r in rows])
        return last

    def _sampling_metadata(
        self,
        rows: Sequence[SampleRow],
        batch: BatchSampling,
        steps: jax.Array | None,
        token_mask: np.ndarray | None = None,
        draft_ids: list[int] | None = None,
    ) -> PackedSampling:
        """The rows' sampling arrays, on the step's devices, with `steps` as their draw
        counters (they travel with the forward's inputs: None for `decode_steps`, which
        unpacks them itself). The same requests in the same order as the last step, with
        neither per-step biases, penalties, masks nor drafts (`plain`), keep the last step's
        arrays there and send nothing more."""
        plain = token_mask is None and draft_ids is None and not any(r.extra_bias for r in rows)
        last = self._last_sampling
        if plain and last is not None and last[0] is batch:
            return replace(last[1], steps=steps)
        built = self.build_sampling_metadata(rows, batch.key[0], token_mask, draft_ids)
        meta = self._put_sampling(replace(built, steps=None))
        # Penalties read the histories, which change every step: those are always built.
        reusable = plain and not batch.use_penalties
        self._last_sampling = (batch, meta) if reusable else None
        return replace(meta, steps=steps)

    def build_sampling_metadata(
        self,
        rows: Sequence[SampleRow],
        r_pad: int,
        token_mask: np.ndarray | None = None,
        draft_ids: list[int] | None = None,
    ) -> SamplingMetadata:
        """The rows' sampling arrays, all built (`_sampling_metadata` reuses what it can)."""
        return build_sampling_metadata(
            [r.params for r in rows],
            [r.token_ids for r in rows],
            [r.num_prompt_tokens for r in rows],
            [r.seed for r in rows],
            num_rows=r_pad,
            extra_bias=[r.extra_bias for r in rows],
            history_width=self.max_blocks_per_seq * self.block_size,
            num_tokens=[r.num_tokens for r in rows],
            token_mask=token_mask,
            draft_token_ids=draft_ids,
        )

    def _run_processors(self, logits: jax.Array, rows: Sequence[SampleRow]) -> jax.Array:
        """vLLM's per-request logits processors, on the host: the rows that have them come
        back from the device (this step's one extra wait), and go back changed."""
        which = [i for i, r in enumerate(rows) if r.constraints and r.constraints.processors]
        index = np.zeros(next_power_of_2(len(which)), np.int32)
        index[: len(which)] = which
        # The padded index keeps the gather's shape to a power of two (few compilations).
        host = np.array(logits[index])[: len(which)]
        for j, i in enumerate(which):
            row = rows[i]
            prompt = list(row.token_ids[: row.num_prompt_tokens])
            output = list(row.token_ids[row.num_prompt_tokens : row.num_tokens])
            processors = row.constraints.processors
            host[j] = apply_processors(processors, prompt, output, host[j].copy())
        values = np.zeros((len(index), host.shape[1]), np.float32)
        values[: len(which)] = host
        return set_rows(logits, index, values, len(which))

    def reset_kv_cache(self) -> None:
        """A fresh, zeroed pool (and draft pool), when a failed step left the donated one
        unusable."""
        self.kv_cache = self._allocate(self.kv_cache.num_blocks)
        if self.draft is not None:
            self.draft_cache = self._allocate(self.kv_cache.num_blocks, self.draft.kv_spec)
        if self.kv_scales is not None:
            self.kv_cache = self._with_scales(*self.kv_scales)

    def set_kv_scales(self, k_scale: np.ndarray, v_scale: np.ndarray) -> None:
        """Sets the fp8 pool's [num_layers, num_kv_heads] scales (kept on the host too, so a
        reset pool gets them back); ValueError for a pool without scales or a wrong shape."""
        self.kv_cache = self._with_scales(k_scale, v_scale)
        self.kv_scales = (np.array(k_scale, np.float32), np.array(v_scale, np.float32))

    def _with_scales(self, k_scale: np.ndarray, v_scale: np.ndarray) -> KVCache:
        cache = with_scales(self.kv_cache, k_scale, v_scale)
        return cache if self._pool_sharding is None else jax.device_put(cache, self._pool_sharding)

    def kv_cache_lost(self) -> bool:
        pools = (self.kv_cache, self.draft_cache)
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(pools))

    def _padding_step(self, t_pad: int, width: int) -> tuple:
        """The forward's arguments for a step of only padding at bucket t_pad and width: it
        writes nothing and reads masked pages."""
        s_pad = min(t_pad, self.max_seqs_bucket)
        groups = self.kv_groups.metadata_dims
        metadata = AttentionMetadata(
            slot_mapping=np.full((*groups, t_pad), PAD_SLOT, np.int32),
            block_tables=np.full((*groups, s_pad, width), NULL_BLOCK, np.int32),
            seq_lens=np.zeros(s_pad, np.int32),
            query_start_loc=np.zeros(s_pad + 1, np.int32),
            num_seqs=np.int32(0),
            num_tokens=np.int32(0),
        )
        zeros = np.zeros(t_pad, np.int32)
        return (
            self._step_params((), t_pad),
            zeros,
            zeros,
            self.kv_cache,
            metadata,
            np.zeros(s_pad, np.int32),
            np.zeros((0, 2), np.int32),
            np.full(t_pad, -1, np.int32),
            self._no_previous_or_drafts,
        )

    def lower_step(self, num_tokens: int, **lowering) -> jax.stages.Lowered:
        """The step at num_tokens' bucket (decode-only if a step of it can be), lowered
        without running, for inspection: its HLO, its collectives under tensor parallelism.
        `lowering`: `Traced.lower`'s options (lowering_platforms=("cuda",) on a CPU)."""
        t_pad = self._bucket_tokens(num_tokens)
        (params, tokens, positions, cache, metadata, rows, copies, sources, previous) = (
            self._padding_step(t_pad, self.width_buckets[0])
        )
        steps = np.zeros(len(rows), np.int32)
        packed, layout = pack((tokens, sources, positions, metadata, rows, copies, steps))
        traced = forward_step.trace(
            params,
            packed,
            previous,
            cache,
            layout=layout,
            config=self.model_config,
            attention_fn=self.attention,
            decode_only=self._step_variants(t_pad)[0],
            tp=self.tp,
        )
        return traced.lower(**lowering)

    def _warm_chains(self, width: int) -> None:
        """Compiles the draft chain at every bucket of drafted sequences, at `width`."""
        none, tables = np.zeros(0, np.int32), np.zeros((0, width), np.int32)
        for bucket in self.chain_buckets:
            k = self.draft.num_speculative_tokens
            inputs = chain_inputs([], none, none, none, tables, k, bucket)
            self._run_chain(inputs, self._no_previous, self._no_copies)

    def warmup(self, probe: bool = False) -> float:
        """Compiles the forward for every token and width bucket (and decode_only variant a
        step of the bucket can take, and the loops of several decode steps), and the greedy
        sampler for every row bucket; returns the
        seconds spent. `probe`: only the smallest and the largest token bucket at the smallest
        width, so that an attention backend that cannot compile or run fails at start-up."""
        start = time.perf_counter()
        token_buckets = self.token_buckets
        if probe:
            token_buckets = sorted({token_buckets[0], token_buckets[-1]})
        for t_pad in token_buckets:
            s_pad = min(t_pad, self.max_seqs_bucket)
            for width in self.width_buckets[:1] if probe else self.width_buckets:
                for decode_only in self._step_variants(t_pad):
                    step = self._padding_step(t_pad, width)
                    logits, self.kv_cache, steps = self._forward(*step, decode_only=decode_only)
                    if self.draft is not None:
                        _, tokens, positions, _, metadata, _, copies, sources, previous = step
                        fill = (tokens, positions, metadata, copies, sources, previous)
                        self._draft_fill(*fill, decode_only)
                if self.draft is not None and t_pad == token_buckets[-1]:
                    self._warm_chains(width)
                if not probe:
                    self._warm_decode_steps(t_pad, width)
            # Its draw counters come from the forward, as a step's do: one compiled variant.
            meta = replace(self._padding_sampling(s_pad), steps=steps)
            greedy = self._GREEDY_STEPS
            sample_step(logits, meta, self.sampling, **greedy, **self._placeholder_layout)
        jax.block_until_ready(self.kv_cache)
        elapsed = time.perf_counter() - start
        logger.info("warmup: %d compilations in %.1f s", self.num_compilations, elapsed)
        return elapsed
