"""Steady decode steps (`core/steady_batch.py`, `worker/decode_batch.py`): the same steps as
the general way, scheduled from arrays, with the runner keeping the rest of the inputs."""

from __future__ import annotations

from itertools import repeat

import numpy as np
import pytest

from pagedjax.core.engine_request import EngineRequest, RequestStatus
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.sched_output import DecodeOutputs, DecodeStep, ModelRunnerOutput
from pagedjax.core.scheduler import Scheduler
from pagedjax.sampling_params import RequestOutputKind, SamplingParams
from pagedjax.worker.block_table import BlockTables
from tests.test_engine import GREEDY, make_engine, make_prompts, run

STOP = 2


def make(steady: bool, num_blocks: int, max_seqs: int = 8, **options) -> Scheduler:
    options.setdefault("placeholder_stride", 16)  # the runner's padded rows
    return Scheduler(
        KVCacheManager(num_blocks, 4),
        max_num_batched_tokens=32,
        max_num_seqs=max_seqs,
        max_model_len=64,
        steady_decode=steady,
        **options,
    )


def request(
    index: int, prompt_len: int, max_tokens: int, priority: int = 0, **params
) -> EngineRequest:
    # Prompts that share their first block: the prefix cache serves the later ones.
    prompt = [5, 6, 7, 8] + [10 + index + j for j in range(prompt_len - 4)]
    return EngineRequest(
        f"r{index}",
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        max_tokens=max_tokens,
        seed=index,
        stop_token_ids=frozenset({STOP, 40 + index % 3}),  # one stop token not each row's
        priority=priority,
    )


def sample(out) -> ModelRunnerOutput:
    """Each row's token from its request and position (the same in both schedulers): now and
    then the stop token, and more rarely NaN logits; [rows, steps] of them for a step of
    several decode steps."""
    keys = [
        [(sum(map(ord, r.request_id)) + q, 7 * q + len(r.request_id)) for q in range(p, p + n)]
        for r, p, n in zip(out.row_requests, out.row_positions, repeat(out.num_steps))
    ]
    tokens = np.array([[STOP if a % 23 == 0 else 3 + b % 40 for a, b in row] for row in keys])
    finite = np.array([[a % 59 != 30 for a, _ in row] for row in keys])
    if not out.row_steps:
        tokens, finite = tokens[:, 0], finite[:, 0]
    return ModelRunnerOutput(tokens.astype(np.int32), finite)


def step_view(scheduler: Scheduler, out, tables: BlockTables, batch_rows: list) -> dict:
    """What a step hands the runner, the same way whichever way it was scheduled; `tables`
    is the runner's persistent copy, brought up to date from the step's table changes, and
    `batch_rows` its steady batch's rows (request ids), from the rows each step removes and
    adds: they must be the step's first requests."""
    tables.forget(out.freed_request_ids)
    seqs = []
    if out.batch_id:  # a general step that forms a batch: its sequences are the rows
        batch_rows[:] = [s.request_id for s in out.seqs]
    if out.decode is not None:  # the batch's rows, then any sequences beside them
        for request_id, start, block_ids in out.decode.table_updates:
            tables.update(request_id, start, block_ids)
        decode = out.decode
        requests = [r for r, _ in out.scheduled[: len(decode.positions)]]
        for row in decode.removed:
            del batch_rows[row]
        batch_rows += [request_id for request_id, _ in decode.added]
        assert batch_rows == [r.request_id for r in requests]
        seqs = [
            (r.request_id, [int(t)], int(p))
            for r, t, p in zip(requests, decode.token_ids, decode.positions, strict=True)
        ]
    for seq in out.seqs:
        tables.update(seq.request_id, seq.table_start, seq.new_block_ids)
    seqs += [(s.request_id, list(s.token_ids), s.num_computed_tokens) for s in out.seqs]
    kv = scheduler.kv
    for request, _ in out.scheduled:  # the runner's tables are the manager's
        rows, length = tables.rows_of([request.request_id])
        assert tables.gather(rows, length)[0].tolist() == kv.get_block_ids(request)
    return {
        "seqs": seqs,
        "rows": list(zip([r.request_id for r in out.row_requests], out.row_positions, strict=True)),
        "copies": list(out.block_copies),
        "preempted": [r.request_id for r in out.preempted],
        "running": [
            (r.request_id, r.num_computed_tokens, list(r.all_token_ids)) for r in scheduler.running
        ],
        "waiting": [r.request_id for r in scheduler.waiting],
        "free_blocks": kv.num_free_blocks,
    }


def reported(outputs: list) -> list[tuple]:
    """What an update reports of each sequence, row by row whichever way it came."""
    flat = []
    for out in outputs:
        if isinstance(out, DecodeOutputs):
            columns = zip(out.request_ids, out.indices, out.token_ids, strict=True)
            flat += [
                (request_id, index, [token] if out.steps == 1 else token, None, row * out.steps)
                for row, (request_id, index, token) in enumerate(columns)
                if row not in out.skip
            ]
        else:
            flat.append(
                (out.request_id, out.index, out.new_token_ids, out.status, out.logprobs_row)
            )
    return sorted(flat, key=lambda o: (o[0], o[1]))


def drive(
    steady: bool,
    async_scheduling: bool,
    num_blocks: int,
    events: dict,
    max_seqs: int = 8,
    num_steps: int = 1,
) -> tuple:
    """Steps until every request is done; `events[step]` runs before that step's schedule.
    Returns each step's view, the steady steps, the requests' statuses, the steady steps
    with requests waiting, the rows removed, the steady steps with sequences beside the
    batch's rows, the rows joined, and the steady steps of several decode steps."""
    scheduler = make(steady, num_blocks, max_seqs, num_scheduler_steps=num_steps)
    tables, batch_rows = BlockTables(4, 4), []
    views, num_steady, queued, removals, in_flight, step = [], 0, 0, 0, None, 0
    beside = joined = several = 0
    last_event = max(events, default=0)
    while step < 400 and (scheduler.has_unfinished_requests() or in_flight or step <= last_event):
        if step in events:
            events[step](scheduler)
        out = scheduler.schedule()
        num_steady += out.decode is not None
        queued += out.decode is not None and bool(scheduler.waiting)
        removals += out.decode is not None and len(out.decode.removed)
        beside += out.decode is not None and bool(out.seqs)
        joined += out.decode is not None and len(out.decode.added)
        several += out.decode is not None and out.num_steps > 1
        views.append(step_view(scheduler, out, tables, batch_rows))
        if async_scheduling:
            if in_flight is not None:
                views[-1]["outputs"] = reported(scheduler.update_from_output(*in_flight))
            in_flight = (out, sample(out)) if out.scheduled else None
        elif out.scheduled:
            views[-1]["outputs"] = reported(scheduler.update_from_output(out, sample(out)))
        step += 1
    statuses = [r.status for r in scheduler.requests.values()]
    return views, num_steady, statuses, queued, removals, beside, joined, several


def requests_arrive(*requests: EngineRequest):
    def add(scheduler: Scheduler) -> None:
        for r in requests:
            scheduler.add_request(r)

    return add


def abort(request_id: str):
    return lambda scheduler: scheduler.finish_group(request_id, RequestStatus.FINISHED_ABORTED)


@pytest.mark.parametrize("num_steps", [1, 4])
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize(
    "num_blocks,max_seqs",
    [(64, 8), (10, 8), (64, 3)],  # 10 blocks: preemptions; 3 slots: requests wait for one
)
def test_steady_steps_are_the_general_steps(async_scheduling, num_blocks, max_seqs, num_steps):
    """The same requests, sampled tokens and events, scheduled with steady steps and
    without: every step hands the runner the same tokens, positions and tables, and the
    requests, the pool and the outputs' positions are the same after each; at the end, every
    request's tokens (an aborted one's too: a sample after its end is not its). With
    num_scheduler_steps=4, steady steps run several decode steps where the general way
    would, their slots reserved ahead as its are."""
    made = []

    def events():
        def tracked(*args, **options) -> EngineRequest:
            made[-1].append(request(*args, **options))
            return made[-1][-1]

        made.append([])
        at = {0: 0, 4: 4, 9: 9, 17: 17, 22: 22, 30: 30}  # steps of one token
        if num_steps > 1:  # fewer steps to the same tokens
            at = {0: 0, 4: 2, 9: 4, 17: 7, 22: 9, 30: 12}
        return {
            at[0]: requests_arrive(*(tracked(i, 5 + 3 * i, 30 - 3 * i) for i in range(4))),
            at[4]: requests_arrive(tracked(7, 7, 9)),  # into a steady batch
            at[9]: requests_arrive(  # the last never a row: a penalty
                tracked(4, 6, 20),
                tracked(5, 9, 12, logprobs=2),
                tracked(9, 6, 14, presence_penalty=0.5),
            ),
            at[17]: abort("r1"),
            at[22]: requests_arrive(tracked(8, 5, 6, priority=-1)),  # admitted before the rows
            at[30]: requests_arrive(tracked(6, 4, 25, n=2, temperature=0.8)),
        }

    general = drive(False, async_scheduling, num_blocks, events(), max_seqs, num_steps)
    steady = drive(True, async_scheduling, num_blocks, events(), max_seqs, num_steps)
    assert [r.all_token_ids for r in made[1]] == [r.all_token_ids for r in made[0]]
    assert steady[0] == general[0]
    assert steady[2] == general[2]
    assert general[1] == 0 and steady[1] >= len(steady[0]) // 4  # many steps are steady
    if num_blocks == 10 and num_steps == 1:  # at K = 4, some reserves fall short instead
        assert any(view["preempted"] for view in general[0])
    if max_seqs == 3:  # steady steps with requests waiting for a slot
        assert steady[3] > 0
    assert steady[4] > 0  # rows of finished requests left steady batches
    assert steady[5] > 0  # admitted beside a batch, then rows of it (but where a tight
    assert steady[6] > 0 or (num_blocks, num_steps) == (10, 4)  # pool drops batches first)
    assert (steady[7] > 0) == (num_steps > 1)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_requests_admitted_beside_a_batch_hold_their_slots_and_fork(async_scheduling):
    """A request with n = 2 admitted beside a batch's two rows (r0 stops at once) holds
    two of the four sequence slots while its prefill lasts (those waiting stay waiting);
    its first sample, after a chunk that leaves one prompt token, is its own (its sibling
    forks from it), not a row's. A request whose one sample is in flight does not join."""

    def events():
        return {
            0: requests_arrive(*(request(i, 5, 20) for i in range(3))),
            4: requests_arrive(request(9, 35, 10, n=2)),  # 4 cached, chunks of 30 and 1
            5: requests_arrive(request(8, 5, 1), request(7, 6, 8)),
            13: requests_arrive(request(6, 5, 1)),  # admitted beside, in order
        }

    general = drive(False, async_scheduling, 64, events(), 4)
    steady = drive(True, async_scheduling, 64, events(), 4)
    assert steady[0] == general[0] and steady[2] == general[2]
    assert steady[3] > 0 and steady[5] > 0  # r8 waited beside a batch


def test_a_row_at_its_length_limit_leaves_the_steady_batch():
    """With async scheduling a request at its limit must not be scheduled before its last
    sample is back: it leaves the batch, whose steps go on without it."""
    scheduler = make(True, 64)
    for i in range(2):
        scheduler.add_request(request(i, 4, 3 + 4 * i))
    out, in_flight, kinds = None, None, []
    for _ in range(12):
        out = scheduler.schedule()
        kinds.append((out.decode is not None, len(out.scheduled)))
        if in_flight is not None:
            scheduler.update_from_output(*in_flight)
        in_flight = (out, sample(out)) if out.scheduled else None
    # prefill, forms the batch, steady, then r0 waits for its third token: without it.
    assert kinds[:5] == [(False, 2), (False, 2), (True, 2), (True, 1), (True, 1)]


def engine_outputs(
    tiny, steady: bool, prompts, params, arrivals=None, **options
) -> tuple[list, list, int]:
    """Every request's completions (tokens, text, logprobs, finish), the steady steps
    dispatched (1: only the batch's rows, 2: with sequences beside them, 4: several decode
    steps) and batches rebuilt (0: rows left, 3: rows joined), and the preemptions."""
    engine = make_engine(tiny, **options)
    engine.engine_core.scheduler.steady_decode = steady
    runner = engine.engine_core.worker.runner
    dispatch, rebuild, steps = runner._dispatch_decode, runner._rebuild, []
    dispatch_one, dispatch_steps = runner._dispatch_one, runner._dispatch_decode_steps

    def beside(*args):
        steps.extend([2] if len(args) > 5 and args[5] is not None else [])
        return dispatch_one(*args)

    def counted(*args):
        steps.append(1)
        return dispatch(*args)

    def rebuilt(batch, removed, added):
        steps.append(3 if added else 0)  # rows joined, or only left by finished requests
        return rebuild(batch, removed, added)

    def several(*args):
        steps.append(4)
        return dispatch_steps(*args)

    runner._dispatch_decode, runner._rebuild = counted, rebuilt
    runner._dispatch_one, runner._dispatch_decode_steps = beside, several
    outputs = run(engine, prompts, params, arrivals)
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0
    completions = [
        [repr(out.prompt_logprobs)]
        + [
            (list(c.token_ids), c.text, repr(c.logprobs), c.finish_reason, c.stop_reason)
            for c in out.outputs
        ]
        for out in outputs
    ]
    return completions, steps, engine.engine_core.scheduler.num_preemptions


@pytest.mark.parametrize(
    "options",
    [
        dict(arrivals=[0, 0, 5, 3, 8, 9, 14]),  # admitted beside steady batches
        dict(arrivals=[0, 0, 5, 3, 8, 9, 14], async_scheduling=False),
        dict(num_kv_blocks=14, block_size=8, max_model_len=64),  # preemptions
        dict(max_num_seqs=3),  # requests wait for a slot
        dict(arrivals=[0, 0, 2, 1, 3, 4, 6], num_scheduler_steps=4),
        dict(num_kv_blocks=14, block_size=8, max_model_len=64, num_scheduler_steps=4),
    ],
)
def test_the_engine_samples_the_same_tokens_with_steady_steps(tiny, options):
    """Greedy and seeded rows, logprobs, prompt logprobs, n = 2, stop tokens, a stop string
    and min_tokens: the same completions with steady steps as without, and most steps
    steady; requests arriving later are admitted beside the batch's rows and join it.
    num_scheduler_steps=4: steady steps of several decode steps, as the general way's."""
    options = dict(options)
    arrivals = options.pop("arrivals", None)
    prompts = make_prompts(7, seed=5)
    final = RequestOutputKind.FINAL_ONLY  # the rows the output processor takes in columns
    params = [
        SamplingParams(max_tokens=24, output_kind=final, **GREEDY),
        SamplingParams(
            max_tokens=24, top_p=0.8, seed=3, logprobs=2, output_kind=final, ignore_eos=True
        ),
        SamplingParams(max_tokens=16, temperature=0.7, seed=4, n=2, output_kind=final),
        SamplingParams(max_tokens=24, min_tokens=3, temperature=1.0, seed=5),
        SamplingParams(max_tokens=12, top_k=5, temperature=1.0, seed=6, stop_token_ids=[9]),
        SamplingParams(max_tokens=22, prompt_logprobs=2, **GREEDY),
        SamplingParams(max_tokens=24, seed=8, stop=["w23 w42"], output_kind=final, ignore_eos=True),
    ]
    general, none, preemptions = engine_outputs(tiny, False, prompts, params, arrivals, **options)
    steady, steps, _ = engine_outputs(tiny, True, prompts, params, arrivals, **options)
    assert steady == general
    assert general[6][1][4] == "w23 w42"  # the stop string ended it
    assert not none
    if options.get("num_scheduler_steps"):
        assert steps.count(4) >= 2
    else:
        assert steps.count(1) >= 6
    if "num_kv_blocks" in options:
        assert preemptions > 0
    else:
        assert 0 in steps  # a batch that finished requests left
    if arrivals:  # requests admitted beside a steady batch's rows, then rows of it
        assert 2 in steps and 3 in steps


def test_the_runner_refuses_a_steady_step_of_a_batch_it_does_not_keep(tiny):
    runner = make_engine(tiny).engine_core.worker.runner
    step = DecodeStep(7, [0], [0])
    with pytest.raises(RuntimeError, match="steady step of batch 7"):
        runner.dispatch([], [], [], decode=step)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_row_leaving_at_a_block_boundary_takes_no_block(async_scheduling):
    """r0's limit falls where its next token would open a block: it leaves the batch
    without that block, as the general way never schedules that token."""

    def events():
        return {0: requests_arrive(request(0, 4, 5), request(1, 4, 13), request(2, 5, 13))}

    general = drive(False, async_scheduling, 64, events())
    steady = drive(True, async_scheduling, 64, events())
    assert steady[0] == general[0] and steady[1] > 0


@pytest.mark.parametrize("num_steps", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_steady_steps_match_over_random_workloads(seed, num_steps):
    """Random prompts, lengths, n, arrivals and pool sizes (some preempt, some queue): the
    same steps as the general way, async scheduling on and off, one decode step a dispatch
    or up to four. A fork leaves its parent's partial block shared, so rows are filed for
    slots out of row order: they still take their blocks in row order."""
    import random

    rnd = random.Random(seed)
    num_blocks, max_seqs = rnd.choice([(200, 8), (24, 8), (200, 4)])
    arrivals = {}  # step -> (index, prompt length, max_tokens) of the requests then
    for i in range(10):
        step = rnd.choice([0, 0, 0, 3, 8, 15])
        spec = (i, rnd.randint(4, 14), rnd.randint(3, 30), rnd.choice([1, 1, 2]))
        arrivals.setdefault(step, []).append(spec)

    def events():  # new requests for each run
        return {
            step: requests_arrive(*(request(i, p, m, n=n) for i, p, m, n in specs))
            for step, specs in arrivals.items()
        }

    for async_scheduling in (True, False):
        general = drive(False, async_scheduling, num_blocks, events(), max_seqs, num_steps)
        steady = drive(True, async_scheduling, num_blocks, events(), max_seqs, num_steps)
        assert steady[0] == general[0] and steady[2] == general[2]


def test_rows_filed_out_of_order_take_their_blocks_in_row_order():
    """Rows due at the same step take their blocks in row order, as the general way
    allocates them, whatever order they were filed in."""
    scheduler = make(True, 64)
    for i in range(4):
        scheduler.add_request(request(i, 4, 20))

    def token_7(out) -> ModelRunnerOutput:  # no row stops
        return ModelRunnerOutput(np.full(len(out.row_requests), 7), np.ones(len(out.row_requests)))

    for _ in range(2):  # the prefill, then the step that forms the batch
        scheduler.update_from_output((out := scheduler.schedule()), token_7(out))
    batch, grown = scheduler._steady, []
    for due in batch.due.values():
        due.reverse()  # as if filed at different steps
    for _ in range(10):
        scheduler.update_from_output((out := scheduler.schedule()), token_7(out))
        assert out.decode is not None
        if out.decode.table_updates:
            grown.append(out.decode.table_updates)
    assert len(grown) == 2
    for updates in grown:
        assert [u[0] for u in updates] == [r.request_id for r in batch.requests]
        firsts = [u[2][0] for u in updates]
        assert firsts == sorted(firsts)


def test_the_output_processor_looks_up_again_only_the_rows_whose_requests_changed():
    """A steady step's rows are found once and reused while the requests stay the same; a
    request aborted and added again under its id gets only its own tokens, and the other
    rows keep what was found for them."""
    from pagedjax.core.sched_output import EngineCoreOutput
    from pagedjax.output_processor import OutputProcessor
    from tests.conftest import build_tiny_tokenizer

    processor = OutputProcessor(build_tiny_tokenizer())
    final = SamplingParams(max_tokens=50, output_kind=RequestOutputKind.FINAL_ONLY)
    ids = ["a", "b"]

    def start(request_id: str, first: int) -> None:
        processor.add_request(request_id, None, [5, 6], final, 0.0)
        processor.process_outputs([EngineCoreOutput(request_id, 0, [first])])

    def steady_step(tokens: list[int], skip=frozenset()) -> None:
        processor.process_outputs([DecodeOutputs(ids, [0, 0], tokens, None, skip)])

    start("a", 10), start("b", 20)
    steady_step([11, 21])
    rows = processor._decode_rows
    steady_step([12, 22], skip={1})
    assert processor._decode_rows is rows and rows.all_sinks  # found once
    processor.abort_request("b")
    start("b", 30)  # the same id, a new request
    steady_step([13, 31])
    assert processor._decode_rows.sinks[0] is rows.sinks[0]  # a's, not looked up again
    assert processor._decode_rows.sinks[1] is not rows.sinks[1]
    out, _ = processor.process_outputs(
        [EngineCoreOutput(i, 0, [99], status=RequestStatus.FINISHED_LENGTH) for i in ids]
    )
    assert [o.outputs[0].token_ids for o in out] == [[10, 11, 12, 13, 99], [30, 31, 99]]
