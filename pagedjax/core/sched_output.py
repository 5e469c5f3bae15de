"""What one step hands from the scheduler to the model runner, and back to the output processor.

`Scheduler.schedule()` returns a `SchedulerOutput`: the requests it scheduled and, for the model
runner, each one's share of the step (`ScheduledSequence`) and the tokens to sample
(`SampleRow`). The runner returns a `ModelRunnerOutput`; `Scheduler.update_from_output` turns
it into one `EngineCoreOutput` per sequence that progressed or finished (a steady decode
step's rows that run on: one `DecodeOutputs`), which the output processor detokenizes into
`RequestOutput`s. Plain data: no JAX on this side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedjax.core.engine_request import EngineRequest, RequestStatus
    from pagedjax.sampling_params import SamplingParams


def placeholder_token(row: int, iteration: int = 0, stride: int = 0) -> int:
    """The token id standing for the token that sample row `row` of a step will produce (in
    its `iteration`-th decode step, where a step runs several: rows are `stride` apart per
    iteration on the device): the scheduler appends it when it schedules the sample, and puts
    the real token in its place when the step's result comes back. A later step that
    computes it before then (async scheduling) reads the token from the device."""
    return -1 - (iteration * stride + row)


def placeholder_tokens(row: int, steps: int, stride: int) -> range:
    """Sample row `row`'s placeholders for its first `steps` decode steps of a step that runs
    several (`placeholder_token` of iterations 0 .. steps - 1)."""
    first = placeholder_token(row)
    return range(first, first - steps * stride, -stride)


def is_placeholder(token: int) -> bool:
    return token < 0


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: compute `token_ids` after its computed context. Its
    block table is the runner's persistent row for `request_id` with its entries from
    `table_start` on replaced by `new_block_ids` (`KVCacheManager.table_update`), and as
    much for each further KV cache group."""

    token_ids: Sequence[int]
    num_computed_tokens: int
    request_id: Any
    table_start: int
    new_block_ids: Sequence[int]
    # The other KV cache groups' (table_start, new_block_ids), in group order (a hybrid
    # model's: `HybridKVCacheManager.table_update`).
    group_tables: Sequence[tuple[int, Sequence[int]]] = ()
    # Prompt logprobs: token_ids[prompt_logprobs_offset + i] predicts prompt_logprob_targets[i].
    prompt_logprob_targets: Sequence[int] = ()
    prompt_logprobs_offset: int = 0
    # Speculative decoding by a draft model: the last this many of token_ids are drafts the
    # draft model proposes on the device within the step (their ids here are stand-ins).
    num_model_drafts: int = 0
    lora_id: int = 0  # its LoRA adapter, 0 for the base model


@dataclass
class SampleRow:
    """A token to sample from the logits of `seq_index`'s last new token."""

    seq_index: int
    params: SamplingParams
    token_ids: Sequence[int]  # the prompt, then the output so far (the sequence's own list)
    num_prompt_tokens: int
    seed: int
    extra_bias: dict[int, float] = field(default_factory=dict)
    # Tokens before the one sampled: the list grows by the sample's placeholder (and, with
    # async scheduling, later ones) before the runner reads it.
    num_tokens: int = -1
    # Its sequence's token constraints (`pagedjax/constraints.py`), None for none.
    constraints: Any = None
    # Speculative decoding: the logits are those of the sequence's new token `offset` before
    # its last, and the token verifies `draft_token` (-1: none, a plain sample).
    offset: int = 0
    draft_token: int = -1


@dataclass
class DecodeStep:
    """A steady decode step (`core/steady_batch.py`): the rows of the step that formed batch
    `batch_id`, in the same order, but for those removed since, each computing one token (or
    one a decode step, for `num_steps` steps).
    The runner keeps the rest of their inputs from that step (vLLM V1's persistent batch)
    and changes only these."""

    batch_id: int
    token_ids: list[int]  # each row's token (a placeholder: the previous step's sample)
    positions: list[int]  # its position (the row's computed tokens)
    # The requests whose block table changed: (request id, table_start, new_block_ids).
    table_updates: list[tuple[Any, int, Sequence[int]]] = field(default_factory=list)
    # Rows removed since the last step (finished), each numbered after the ones before it.
    removed: list[int] = field(default_factory=list)
    # Rows joined since the last step, after the removals: (request id, its sample row; the
    # request's block table is the runner's already).
    added: list[tuple[Any, SampleRow]] = field(default_factory=list)
    # Decode steps run in one dispatch (`decode_steps`), and how many of them each row takes
    # (fewer where its length limit comes first); empty for one.
    num_steps: int = 1
    row_steps: list[int] = field(default_factory=list)


@dataclass
class SteadyRows:
    """What the update of a steady decode step needs beyond its rows: each row's sequence
    as the outputs name it, a superset of the stop tokens that may end a row, the rows whose
    sample is their last (their length limit), and how many sequences had finished when the
    step was scheduled (the same number at its update: none of its rows finished since)."""

    group_ids: list[str]
    indices: list[int]
    stop_token_ids: frozenset[int]
    ending: list[int]
    num_finished: int


@dataclass
class SchedulerOutput:
    """One step: what runs, in batch order, and what the runner needs to run it."""

    scheduled: list[tuple[EngineRequest, int]] = field(default_factory=list)  # (request, tokens)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # CoW, before the step
    # Swapping, before the block copies: (device, host) blocks out, then (host, device) in.
    swaps_out: list[tuple[int, int]] = field(default_factory=list)
    swaps_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[EngineRequest] = field(default_factory=list)
    seqs: list[ScheduledSequence] = field(default_factory=list)  # one per scheduled request
    # Requests whose blocks were freed since the last step that ran: the runner forgets their
    # tables (before this step's updates: an id freed and admitted again starts afresh).
    freed_request_ids: list = field(default_factory=list)
    rows: list[SampleRow] = field(default_factory=list)
    row_requests: list[EngineRequest] = field(default_factory=list)  # who samples each row
    row_positions: list[int] = field(default_factory=list)  # where each row's token goes
    # Speculative decoding: scheduled index -> its draft tokens; a drafted request's first
    # sample row -> its number of drafts (its rows follow it).
    drafts: dict[int, list[int]] = field(default_factory=dict)
    spec_rows: dict[int, int] = field(default_factory=dict)
    # n > 1: children that sample their first token from their parent's row this step and
    # then share its blocks.
    forks: list[tuple[EngineRequest, EngineRequest]] = field(default_factory=list)
    # Requests whose prompt logprobs this step computes, with how many, in batch order.
    prompt_logprob_requests: list[tuple[EngineRequest, int]] = field(default_factory=list)
    # Decode steps the step runs on the device (num_scheduler_steps), and how many of them
    # each row's sequence takes (fewer where its length limit comes first); empty for one.
    num_steps: int = 1
    row_steps: list[int] = field(default_factory=list)
    # A steady decode step (then `seqs` and `rows` are only the sequences scheduled beside
    # the batch's rows, which the runner has: theirs come first), or the id of the steady
    # batch this step forms (the runner keeps its inputs; 0: none).
    decode: DecodeStep | None = None
    steady: SteadyRows | None = None  # with `decode`
    batch_id: int = 0

    def chunks(self) -> list[tuple[int, int]]:
        """Each scheduled sequence's (computed tokens before the step, tokens it computes),
        whichever way the step was scheduled."""
        chunks = [(s.num_computed_tokens, len(s.token_ids)) for s in self.seqs]
        if self.decode is not None:  # the batch's rows, then the sequences beside them
            return [(position, 1) for position in self.decode.positions] + chunks
        return chunks

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The most top logprobs any prompt-logprobs request of the step asks for."""
        asked = (request.params.prompt_logprobs for request, _ in self.prompt_logprob_requests)
        return max(asked, default=None)


@dataclass
class ModelRunnerOutput:
    """What a step computed (numpy arrays, one entry per sample row or prompt target)."""

    token_ids: Any  # [rows] int32 ([rows, num_steps] for a step of several decode steps)
    finite: Any  # [rows] bool ([rows, num_steps]): False when the row's logits held NaN or inf
    logprobs: Any = None  # TokenLogprobs of the sampled tokens, when asked for
    prompt_logprobs: Any = None  # TokenLogprobs of the prompt targets, in batch order
    accepted: Any = None  # [rows] bool: whether a row's draft token was accepted (drafts only)


@dataclass(slots=True)
class EngineCoreOutput:
    """One sequence's progress in a step: its new token (if any) and whether it finished."""

    request_id: str  # the user's request (the group of its n sequences)
    index: int  # which of the n sequences
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: Any = None  # TokenLogprobs holding the tokens' logprobs from `logprobs_row` on
    logprobs_row: int = 0
    status: RequestStatus | None = None  # set when the sequence finished
    stop_reason: int | None = None  # a user stop token that finished it
    # The parent's prompt logprobs computed this step: rows [first, first + count) of the
    # step's TokenLogprobs.
    prompt_logprobs: Any = None
    prompt_logprobs_rows: tuple[int, int] = (0, 0)
    num_cached_tokens: int | None = None  # the user request's prompt tokens the cache served


@dataclass(slots=True)
class DecodeOutputs:
    """A steady decode step's rows that run on, column by column (one object, not an
    `EngineCoreOutput` a row): row i's sequence (request_ids[i], indices[i]) got
    token_ids[i] (a token, or the list of a step of several decode steps). The rows in
    `skip` are not reported here: they finished before the step's result came back, or
    ended with it (each in an `EngineCoreOutput` of its own)."""

    request_ids: list[str]
    indices: list[int]
    token_ids: list[int] | list[list[int]]  # a list of `steps` tokens a row, steps > 1
    logprobs: Any = None  # TokenLogprobs: row i's from row i * steps on
    skip: frozenset[int] | set[int] = frozenset()
    steps: int = 1  # decode steps the step ran


CoreOutput = EngineCoreOutput | DecodeOutputs  # what a step reports


def ended_groups(outputs: Sequence[CoreOutput]) -> set[str]:
    """The user requests a sequence of which ended in `outputs` (only those can have
    finished); a `DecodeOutputs` ends none: the rows that end come one by one."""
    return {
        out.request_id
        for out in outputs
        if isinstance(out, EngineCoreOutput) and out.status is not None
    }
