"""The engine core in a process of its own (`core_process=True`, what `pagedjax serve` runs):
the same outputs as in this process, errors before the core sees a request, aborts that free
every block, calls between steps, and a core that dies taking its callers with it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

import pytest

from pagedjax.async_llm import AsyncLLM
from pagedjax.errors import EngineDeadError, EngineSleepingError, InvalidRequestError
from pagedjax.sampling_params import RequestOutputKind, SamplingParams
from tests.test_engine import GREEDY, make_engine, make_prompts, run

SETTINGS = dict(max_model_len=128, num_kv_blocks=64, max_num_batched_tokens=64)
DELTA = RequestOutputKind.DELTA


@pytest.fixture(scope="module")
def remote(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    llm = AsyncLLM(str(path), core_process=True, **SETTINGS)
    yield llm
    llm.shutdown()


async def final_output(llm: AsyncLLM, request_id: str, prompt, params: SamplingParams):
    """The request's last output, and its DELTA outputs' token ids concatenated."""
    final, tokens = None, []
    async for output in llm.generate(prompt, params, request_id):
        final = output
        tokens += output.outputs[0].token_ids
    return final, tokens


def generate_all(llm: AsyncLLM, prompts, params: list[SamplingParams]) -> list:
    async def main():
        calls = (
            final_output(llm, f"r{i}", prompt, p)
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
        )
        return await asyncio.gather(*calls)

    return asyncio.run(main())


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_outputs_equal_the_in_process_engine(tiny, remote):
    prompts = make_prompts(10, seed=3)
    greedy = SamplingParams(max_tokens=12, **GREEDY)
    # A stop string that greedy decoding of the first prompt meets half-way.
    words = run(make_engine(tiny), prompts[:1], greedy)[0].outputs[0].text.split()
    stop = words[len(words) // 2]
    params = [
        greedy,
        SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]),
        SamplingParams(max_tokens=9, temperature=1.0, seed=7, n=3, ignore_eos=True),
        SamplingParams(max_tokens=6, logprobs=2, prompt_logprobs=1, **GREEDY),
        SamplingParams(max_tokens=12, temperature=0.8, top_k=5, seed=3, ignore_eos=True),
    ] * 2
    prompts[1] = prompts[0]  # the stop string's own prompt
    expected = run(make_engine(tiny), prompts, params)
    got = generate_all(remote, prompts, params)
    for want, (out, _) in zip(expected, got, strict=True):
        assert out.finished
        for w, g in zip(want.outputs, out.outputs, strict=True):
            assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
                w.token_ids,
                w.text,
                w.finish_reason,
                w.stop_reason,
            )
            if w.logprobs is not None:
                assert [list(e) for e in g.logprobs] == [list(e) for e in w.logprobs]
                assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
        if want.prompt_logprobs is not None:
            assert [e and list(e) for e in out.prompt_logprobs] == [
                e and list(e) for e in want.prompt_logprobs
            ]
    # The statistics come with the core's next message: stop strings end sequences there after.
    wait_until(lambda: remote.stats()["running"] == remote.stats()["kv_blocks_used"] == 0)


def test_streams_and_aborts_free_every_block(remote):
    long = SamplingParams(max_tokens=100, output_kind=DELTA, **GREEDY)

    async def main():
        streams = [remote.generate([5 + i, 6, 7], long, f"long{i}") for i in range(4)]
        for stream in streams:  # each has its first token: every request runs
            await anext(stream)
        assert remote.stats()["kv_blocks_used"] > 0
        await streams[0].aclose()  # a caller that stops listening aborts its request
        await remote.abort("long1")
        outputs = [output async for output in streams[1]]
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        for stream in streams[2:]:
            await stream.aclose()

    asyncio.run(main())
    wait_until(lambda: remote.stats()["kv_blocks_used"] == 0)
    assert remote.stats()["running"] == remote.stats()["waiting"] == 0
    out, tokens = generate_all(remote, [[9, 8, 7]], [SamplingParams(max_tokens=5, **GREEDY)])[0]
    assert len(out.outputs[0].token_ids) == 5  # still serving


def test_bad_requests_are_refused_before_they_are_sent(remote):
    async def ask(prompt, params):
        return [output async for output in remote.generate(prompt, params, "bad")]

    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(ask(list(range(3, 120)), SamplingParams(max_tokens=50)))
    with pytest.raises(InvalidRequestError, match="core_process=False"):
        asyncio.run(ask([5, 6], SamplingParams(logits_processors=[lambda ids, logits: logits])))
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        asyncio.run(ask([5, 6], SamplingParams(allowed_token_ids=[500])))
    outputs = asyncio.run(ask([5, 6], SamplingParams(max_tokens=3, allowed_token_ids=[9, 10])))
    assert set(outputs[-1].outputs[0].token_ids) <= {9, 10}  # built again in the core
    assert remote.stats()["kv_blocks_used"] == 0


def test_sleep_wake_up_and_new_weights_between_steps(tiny, remote):
    params = SamplingParams(max_tokens=8, **GREEDY)
    prompts = make_prompts(3, seed=5)
    before = [out.outputs[0].token_ids for out, _ in generate_all(remote, prompts, [params] * 3)]
    asyncio.run(remote.sleep(1))
    assert asyncio.run(remote.is_sleeping())
    with pytest.raises(EngineSleepingError):
        generate_all(remote, prompts[:1], [params])
    asyncio.run(remote.wake_up())
    assert not asyncio.run(remote.is_sleeping())
    model_params = tiny("llama")[3]
    asyncio.run(remote.update_weights(model_params))  # the same weights: the same tokens
    after = [out.outputs[0].token_ids for out, _ in generate_all(remote, prompts, [params] * 3)]
    assert after == before


def test_a_core_that_dies_fails_every_caller(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    llm = AsyncLLM(str(path), core_process=True, **SETTINGS)
    try:
        long = SamplingParams(max_tokens=100, output_kind=DELTA, **GREEDY)

        async def main():
            stream = llm.generate([5, 6, 7], long, "doomed")
            await anext(stream)
            llm.engine.core_process._process.kill()
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass

        asyncio.run(main())
        wait_until(lambda: llm.errored)
        with pytest.raises(EngineDeadError):
            generate_all(llm, [[5, 6]], [long])
    finally:
        llm.shutdown()


def test_a_bad_option_fails_at_start_with_the_cores_error(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="max_model_len"):
        AsyncLLM(str(path), core_process=True, max_model_len=100_000, num_kv_blocks=8)


def test_the_front_end_never_starts_a_jax_backend(tiny_model_dir):
    """On a GPU the front end must hold no device memory: only the core's process starts JAX."""
    path, _ = tiny_model_dir("llama")
    script = textwrap.dedent(
        f"""
        import asyncio
        from jax._src import xla_bridge
        from pagedjax.async_llm import AsyncLLM
        from pagedjax.sampling_params import SamplingParams

        async def main(llm):
            params = SamplingParams(max_tokens=4, temperature=0.0)
            return [out async for out in llm.generate([5, 6, 7], params, "r")][-1]

        if __name__ == "__main__":
            llm = AsyncLLM({str(path)!r}, core_process=True, **{SETTINGS!r})
            out = asyncio.run(main(llm))
            llm.shutdown()
            print(len(out.outputs[0].token_ids), xla_bridge.backends_are_initialized())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["4", "False"]
