"""AsyncLLM: the engine loop on its own thread, many coroutines at once, aborts and failures."""

from __future__ import annotations

import asyncio

import pytest

from pagedjax.async_llm import AsyncLLM
from pagedjax.errors import (
    DuplicateRequestIdError,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
)
from pagedjax.sampling_params import RequestOutputKind, SamplingParams
from tests.test_engine import GREEDY, make_engine, make_prompts, run, tokens_of

DELTA = RequestOutputKind.DELTA


@pytest.fixture
def async_llm(tiny):
    engines = []

    def make(max_waiting_requests=None, **options) -> AsyncLLM:
        engine = AsyncLLM(
            engine=make_engine(tiny, **options), max_waiting_requests=max_waiting_requests
        )
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


async def collect(llm: AsyncLLM, request_id: str, prompt, params: SamplingParams):
    """(the final output, the token ids of every DELTA output concatenated)."""
    tokens, final = [], None
    async for output in llm.generate(prompt, params, request_id):
        tokens += output.outputs[0].token_ids if output.outputs else []
        final = output
    return final, tokens


def test_concurrent_requests_match_the_synchronous_engine(tiny, async_llm):
    prompts = make_prompts(12, seed=3)
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = tokens_of(run(make_engine(tiny), prompts, params))
    llm = async_llm()
    delta = SamplingParams(max_tokens=12, output_kind=DELTA, **GREEDY)

    async def main():
        return await asyncio.gather(
            *(collect(llm, f"r{i}", p, delta) for i, p in enumerate(prompts))
        )

    results = asyncio.run(main())
    assert [tokens for _, tokens in results] == expected
    assert all(final.finished for final, _ in results)
    stats = llm.engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0


def test_a_cancelled_consumer_aborts_its_request_and_frees_its_blocks(async_llm):
    llm = async_llm()
    params = SamplingParams(max_tokens=80, output_kind=DELTA, **GREEDY)

    async def main():
        async def consume():
            async for _ in llm.generate(make_prompts(1)[0], params, "a"):
                pass

        task = asyncio.create_task(consume())
        while llm.stats()["kv_blocks_used"] == 0:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):
            if llm.stats()["kv_blocks_used"] == 0 and llm.stats()["running"] == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_abort_ends_the_stream_with_an_abort_output(async_llm):
    llm = async_llm()
    params = SamplingParams(max_tokens=80, output_kind=DELTA, **GREEDY)

    async def main():
        outputs = []
        async for output in llm.generate(make_prompts(1)[0], params, "a"):
            outputs.append(output)
            if len(outputs) == 2:
                await llm.abort("a")
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs) < 80


def test_bad_requests_raise_before_anything_changes(async_llm):
    llm = async_llm()
    params = SamplingParams(max_tokens=4, **GREEDY)

    async def main():
        with pytest.raises(InvalidRequestError):
            await collect(llm, "bad", [], params)
        with pytest.raises(InvalidRequestError):
            await collect(llm, "bad", [10_000], params)
        gen = llm.generate(make_prompts(1)[0], SamplingParams(max_tokens=50, **GREEDY), "same")
        first = await gen.__anext__()
        with pytest.raises(DuplicateRequestIdError):
            await collect(llm, "same", make_prompts(1)[0], params)
        await gen.aclose()
        final, _ = await collect(llm, "ok", make_prompts(1)[0], params)
        return first, final

    first, final = asyncio.run(main())
    assert final.finished and len(final.outputs[0].token_ids) == 4


def test_a_full_waiting_queue_refuses_new_requests(async_llm):
    llm = async_llm(max_waiting_requests=2, max_num_seqs=1)
    params = SamplingParams(max_tokens=30, **GREEDY)

    async def main():
        prompts = make_prompts(4, seed=5)
        tasks = [asyncio.create_task(collect(llm, "r0", prompts[0], params))]
        while llm.stats()["running"] == 0:  # the first one runs: max_num_seqs=1
            await asyncio.sleep(0.01)
        for i in (1, 2):  # two wait
            tasks.append(asyncio.create_task(collect(llm, f"r{i}", prompts[i], params)))
            await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            await collect(llm, "extra", prompts[3], params)
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert all(final.finished for final, _ in results)


def test_a_loop_that_cannot_go_on_fails_every_caller(async_llm, monkeypatch):
    llm = async_llm()

    def broken_step():
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(llm.engine, "step", broken_step)
    params = SamplingParams(max_tokens=4, **GREEDY)

    async def main():
        with pytest.raises(EngineDeadError, match="scheduler bug"):
            await collect(llm, "a", make_prompts(1)[0], params)
        with pytest.raises(EngineDeadError):
            await collect(llm, "b", make_prompts(1)[0], params)

    asyncio.run(main())
    assert llm.errored


def test_a_failed_step_fails_its_requests_and_the_loop_goes_on(async_llm, monkeypatch):
    llm = async_llm()
    worker = llm.engine.engine_core.worker
    real = worker.execute_model
    calls = {"n": 0}

    def flaky(out, previous=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fault")
        return real(out, previous)

    monkeypatch.setattr(worker, "execute_model", flaky)
    params = SamplingParams(max_tokens=5, **GREEDY)

    async def main():
        failed, _ = await collect(llm, "a", make_prompts(1)[0], params)
        ok, _ = await collect(llm, "b", make_prompts(1)[0], params)
        return failed, ok

    failed, ok = asyncio.run(main())
    assert failed.outputs[0].finish_reason == "error"
    assert ok.outputs[0].finish_reason == "length" and not llm.errored


def test_shutdown_fails_open_streams(async_llm):
    llm = async_llm()
    params = SamplingParams(max_tokens=80, output_kind=DELTA, **GREEDY)

    async def main():
        gen = llm.generate(make_prompts(1)[0], params, "a")
        await gen.__anext__()
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await collect(llm, "b", make_prompts(1)[0], params)

    asyncio.run(main())
