"""`pagedjax serve`: the real server in a subprocess, driven by the official `openai` client.

Greedy answers equal `LLM.generate` / `LLM.chat` on the same tiny model and engine options,
streamed or not and under concurrency; every bad request gets its status and OpenAI's error
JSON, and the server goes on serving; a client that drops its stream frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagedjax.llm import LLM
from pagedjax.sampling_params import SamplingParams
from tests.test_engine import hf_greedy
from tests.test_lora import PROJECTIONS, merged_model, write_peft_adapter

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-chat"
# Several blocks per request (block_size 16), room for 32 at once.
ENGINE_OPTIONS = dict(max_model_len=96, block_size=16, num_kv_blocks=200, max_num_batched_tokens=64)
# The template turns each message into the token "w<length of its content>".
CHAT_TEMPLATE = "{% for m in messages %}w{{ m['content'] | length }} {% endfor %}"
API_KEY = "sk-test"
# Greedy, and as long as asked: the tiny model's eos would end some answers at random points.
# A request the guarded server takes seconds to finish.
LONG = 4000
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`pagedjax serve` in a subprocess, on a free port, until stopped."""

    def __init__(self, model_dir: Path, log: Path, *flags: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        options = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_OPTIONS.items()]
        command = [sys.executable, "-m", "pagedjax.cli", "serve", str(model_dir)]
        command += ["--port", str(self.port), "--log-level", "warning", *options, *flags]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT
            )

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"no /health after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.process.terminate()  # uvicorn shuts down, then the engine
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def metrics(self) -> dict[str, float]:
        """The /metrics samples without labels: name -> value (histograms left out)."""
        text = httpx.get(f"{self.url}/metrics").text
        samples = {}
        for line in text.splitlines():
            match = re.match(r"^([\w:]+)(?:\{[^}]*\})? (\S+)$", line)
            if match and not line.startswith("#"):
                samples[match.group(1)] = float(match.group(2))
        return samples


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny Llama, with a chat template."""
    from transformers import AutoTokenizer

    source, _ = tiny_model_dir("llama")
    target = tmp_path_factory.mktemp("served") / MODEL
    target.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (source / name).exists():
            (target / name).symlink_to(source / name)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Two PEFT adapters of the tiny Llama: "small" (attention, rank 4) is served from the
    start, "full" (every projection, rank 8) loaded while serving."""
    hf_model = tiny_model_dir("llama")[1]
    root = tmp_path_factory.mktemp("adapters")
    return {
        "small": write_peft_adapter(root / "small", hf_model, ["q_proj", "v_proj"], 4, 8, 1),
        "full": write_peft_adapter(root / "full", hf_model, list(PROJECTIONS), 8, 16, 2),
    }


@pytest.fixture(scope="module")
def servers(model_dir, adapters, tmp_path_factory):
    """(the open server, the one with an API key and a one-request queue), started together.
    The open one serves LoRA adapters too ("small" from the start)."""
    logs = tmp_path_factory.mktemp("logs")
    lora = ["--enable-lora", "--max-loras=2", "--max-lora-rank=8"]
    lora += ["--lora-modules", f"small={adapters['small']}"]
    open_server = Server(model_dir, logs / "open.log", *lora)
    # Long requests (max_model_len 4096): they run long enough to fill the queue and to be
    # dropped midway.
    guarded = Server(
        model_dir,
        logs / "guarded.log",
        "--api-key",
        API_KEY,
        "--max-waiting-requests=1",
        "--max-num-seqs=1",
        "--max-model-len=4096",
        "--num-kv-blocks=300",
        "--no-warmup",  # compiles on first use, below
    )
    try:
        for server in (open_server, guarded):
            server.wait_ready()
            # The guarded server's first steps compile here, so the tests below time serving.
            headers = {"Authorization": f"Bearer {API_KEY}"}
            body = {"prompt": "w5 w6", "max_tokens": 4}
            httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=120)
        yield open_server, guarded
    finally:
        open_server.stop()
        guarded.stop()
    for server in (open_server, guarded):  # nothing went wrong inside, dropped clients included
        assert "Traceback" not in server.log.read_text(), server.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def guarded(servers) -> Server:
    return servers[1]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), **ENGINE_OPTIONS)


def _expected(llm: LLM, prompts, max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def _stream_text(chunks, n: int = 1) -> tuple[list[str], list[str | None]]:
    """The concatenated text and last finish reason of each choice of a completions stream."""
    texts, reasons = [""] * n, [None] * n
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    return texts, reasons


# ------------------------------------------------------------------------ completions


def test_greedy_completions_equal_llm_generate_streamed_or_not(client, llm):
    prompts = ["w5 w9 w11 w40", [7, 8, 9, 10, 11, 12]]
    expected = _expected(llm, prompts, 8)
    for prompt, want in zip(prompts, expected, strict=True):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY)
        assert whole.choices[0].text == want
        assert whole.choices[0].finish_reason == "length"
        assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, stream=True, **GREEDY
        )
        texts, reasons = _stream_text(stream)
        assert texts == [want] and reasons == ["length"]


def test_several_prompts_with_n_choices_index_across_prompts(client, llm):
    prompts = ["w3 w4", "w20 w21 w22"]
    expected = _expected(llm, prompts, 5)
    response = client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=5, **GREEDY)
    assert [c.index for c in response.choices] == list(range(6))
    assert [c.text for c in response.choices] == [expected[0]] * 3 + [expected[1]] * 3
    assert response.usage.prompt_tokens == 5  # each prompt once, not once per choice
    assert response.usage.completion_tokens == 30
    stream = client.completions.create(
        model=MODEL, prompt=prompts, n=3, max_tokens=5, stream=True, **GREEDY
    )
    texts, reasons = _stream_text(stream, 6)
    assert texts == [expected[0]] * 3 + [expected[1]] * 3 and reasons == ["length"] * 6


def test_stream_usage_comes_last_when_asked(client):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="w5 w6 w7",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 4, 7)
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client):
    prompt = list(range(3, 43))  # 40 tokens: two full blocks of 16 to reuse
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == 40
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert again.choices[0].text == first.choices[0].text


def test_completion_logprobs_and_echo(client, llm):
    prompt = "w5 w9 w11"
    want = _expected(llm, [prompt], 4)[0]
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, logprobs=2, **GREEDY
    )
    logprobs = response.choices[0].logprobs
    assert "".join(logprobs.tokens) == response.choices[0].text == want
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    text = response.choices[0].text
    offsets = zip(logprobs.text_offset, logprobs.tokens, strict=True)
    assert all(text[offset:].startswith(token) for offset, token in offsets)
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert logprob <= 0 and top[token] == logprob and 2 <= len(top) <= 3
        assert logprob == max(top.values())  # greedy: the chosen token is the likeliest

    echoed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, logprobs=1, echo=True, **GREEDY
    )
    choice = echoed.choices[0]
    assert choice.text == prompt + want
    assert len(choice.logprobs.tokens) == 3 + 4
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert "".join(choice.logprobs.tokens) == choice.text

    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, logprobs=1, echo=True, stream=True, **GREEDY
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == prompt + want
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert "".join(tokens) == prompt + want


# ------------------------------------------------------------------------------- chat


def test_greedy_chat_equals_llm_chat_streamed_or_not(client, llm):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello there"}]},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    template_messages = [messages[0], {"role": "user", "content": "hello there"}]
    want = llm.chat(template_messages, params, use_tqdm=False)[0].outputs[0].text
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, **GREEDY)
    assert whole.choices[0].message.content == want
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=6, stream=True, n=2, **GREEDY
        )
    )
    assert {c.choices[0].index for c in chunks[:2]} == {0, 1}
    assert all(c.choices[0].delta.role == "assistant" for c in chunks[:2])
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == want
        assert [c.finish_reason for c in mine][-1] == "length"
        assert all(c.finish_reason is None for c in mine[:-1])


def test_chat_logprobs_shape(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 3
    assert "".join(t.token for t in content) == response.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and bytes(token.bytes).decode() == token.token
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.top_logprobs[0].token == token.token  # greedy


def test_concurrent_streams_each_get_what_they_would_alone(server, llm):
    prompts = [" ".join(f"w{(7 * i + j) % 120 + 3}" for j in range(2 + i % 5)) for i in range(32)]
    expected = _expected(llm, prompts, 6)

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0
        ) as client:

            async def one(prompt: str) -> str:
                stream = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=6, stream=True, **GREEDY
                )
                return "".join([c.choices[0].text async for c in stream if c.choices])

            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(run()) == expected


# ----------------------------------------------------------------------------- errors


BAD_REQUESTS = [
    # (path, body, status, the field the error names)
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": ', 400, None),
    ("/v1/completions", {"prompt": "w5", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "w5", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "w5", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "w5", "max_tokens": 1000}, 400, "prompt"),
    ("/v1/completions", {"prompt": list(range(3, 103)), "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": "w5", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "w5", "logit_bias": {"abc": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "w5", "logit_bias": {"100000": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": {"text": "w5"}}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 100000]}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "w5", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "w5", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [100000]}, 400, "tokens"),
    # vLLM's constraints go through SamplingParams' and the engine's checks, as offline.
    ("/v1/completions", {"prompt": "w5", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "w5", "bad_words": [""]}, 400, "bad_words"),
    (
        "/v1/completions",
        {"prompt": "w5", "structured_outputs": {"json": {}, "regex": "a"}},
        400,
        "structured_outputs",
    ),
    ("/v1/completions", {"prompt": "w5", "guided_choice": []}, 400, "guided_choice"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
        400,
        "response_format",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_a_bad_request_gets_its_status_and_an_openai_error(server, path, body, status, param):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        if isinstance(body, bytes):
            headers = {"Content-Type": "application/json"}
            response = http.post(path, content=body, headers=headers)
        else:
            response = http.post(path, json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["message"] and error["type"] and error["param"] == param
        # The server goes on serving.
        ok = http.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_vllm_sampling_extras_reach_the_engine(client):
    allowed = [7, 9, 11]
    completion = client.completions.create(
        model=MODEL,
        prompt="w5 w6",
        max_tokens=8,
        temperature=1.0,
        seed=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    words = completion.choices[0].text.split()
    assert len(words) == 8 and set(words) <= {f"w{t}" for t in allowed}
    # The tiny model's word-level tokenizer is one llguidance cannot read: the engine says so
    # (structured outputs themselves are tested offline on the default model).
    with pytest.raises(openai.BadRequestError, match="tokenizer llguidance can read"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_object"},
        )


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="w5", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_api_key_guards_the_v1_endpoints_only(guarded):
    body = {"prompt": "w5", "max_tokens": 2}
    with httpx.Client(base_url=guarded.url, timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = http.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models").status_code == 401
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="w5", max_tokens=2).choices[0].text


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_full_queue_answers_503_then_serves_again(guarded):
    """One running (max_num_seqs 1) and one waiting (max_waiting_requests 1): a third gets 503."""
    long = {"prompt": "w5 w6", "max_tokens": LONG, "ignore_eos": True}

    async def scenario() -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with (
            httpx.AsyncClient(base_url=guarded.url, headers=headers, timeout=60) as http,
            http.stream("POST", "/v1/completions", json={**long, "stream": True}) as running,
        ):
            assert running.status_code == 200
            waiting = asyncio.ensure_future(http.post("/v1/completions", json=long))
            while guarded.metrics()["pagedjax:num_requests_waiting"] < 1:
                assert not waiting.done(), waiting.result().text
                await asyncio.sleep(0.02)
            refused = await http.post("/v1/completions", json={"prompt": "w8"})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "queue_full"
            waiting.cancel()  # drops its connection: the server aborts it
            await asyncio.gather(waiting, return_exceptions=True)

    asyncio.run(scenario())
    _wait_for(lambda: guarded.metrics()["pagedjax:kv_cache_blocks_used"] == 0)
    ok = httpx.post(
        f"{guarded.url}/v1/completions",
        json={"prompt": "w8", "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert ok.status_code == 200, ok.text


def test_a_dropped_stream_frees_its_blocks_at_once(guarded):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "w5 w6 w7", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    before = guarded.metrics()["pagedjax:generation_tokens_total"]
    with (
        httpx.Client(base_url=guarded.url, headers=headers, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert guarded.metrics()["pagedjax:kv_cache_blocks_used"] > 0
    _wait_for(lambda: guarded.metrics()["pagedjax:kv_cache_blocks_used"] == 0, timeout=5)
    metrics = guarded.metrics()
    assert metrics["pagedjax:num_requests_running"] == 0
    assert metrics["pagedjax:generation_tokens_total"] - before < LONG  # aborted, not finished


def test_a_dropped_unstreamed_request_is_aborted(guarded):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "w9 w10", "max_tokens": LONG, "ignore_eos": True}
    before = guarded.metrics()["pagedjax:generation_tokens_total"]
    with (
        httpx.Client(base_url=guarded.url, headers=headers, timeout=0.3) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        http.post("/v1/completions", json=body)
    _wait_for(lambda: guarded.metrics()["pagedjax:kv_cache_blocks_used"] == 0, timeout=5)
    assert guarded.metrics()["pagedjax:generation_tokens_total"] - before < LONG


# -------------------------------------------------------------------- other endpoints


def test_models_health_version_metrics_tokenize_detokenize(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "small"]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").json()["version"]
        tokens = http.post("/tokenize", json={"prompt": "w5 w9"}).json()
        assert tokens == {"tokens": [5, 9], "count": 2, "max_model_len": 96}
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "abc"}]})
        assert chat.json()["tokens"] == [3]  # the template's "w3"
        assert http.post("/detokenize", json={"tokens": [5, 9]}).json() == {"prompt": "w5 w9"}
        missing = http.get("/nope")
        assert missing.status_code == 404 and missing.json()["error"]["message"]
    client.completions.create(model=MODEL, prompt="w5", max_tokens=2, **GREEDY)
    metrics = server.metrics()
    for name in (
        "pagedjax:num_requests_running",
        "pagedjax:num_requests_waiting",
        "pagedjax:kv_cache_usage_perc",
        "pagedjax:kv_cache_blocks_used",
        "pagedjax:prefix_cache_hit_rate",
        "pagedjax:num_preemptions_total",
        "pagedjax:prompt_tokens_total",
        "pagedjax:generation_tokens_total",
        "pagedjax:spec_decode_num_accepted_tokens_total",
        "pagedjax:time_to_first_token_seconds_count",
        "pagedjax:time_per_output_token_seconds_count",
        "pagedjax:e2e_request_latency_seconds_count",
        "pagedjax:request_success_total",
        "pagedjax:num_devices",
        "pagedjax:kv_cache_bytes_per_device",
        "pagedjax:weights_bytes_total",
    ):
        assert name in metrics, name
    assert metrics["pagedjax:num_devices"] == 1
    assert metrics["pagedjax:kv_cache_bytes_per_device"] > 0
    assert metrics["pagedjax:e2e_request_latency_seconds_count"] >= 1
    assert metrics["pagedjax:kv_cache_blocks_total"] == ENGINE_OPTIONS["num_kv_blocks"] - 1
    assert json.loads(httpx.get(f"{server.url}/v1/models").text)["object"] == "list"


# ------------------------------------------------------------------------ LoRA adapters


def test_lora_adapters_are_models_loaded_and_unloaded_while_serving(
    server, client, adapters, tiny_model_dir
):
    """Each adapter answers with transformers' greedy tokens of its merged weights, the base
    model with its own; an unknown adapter is a 404; load and unload change the list."""
    hf_model = tiny_model_dir("llama")[1]
    prompt = [5, 9, 14, 3]

    def answer(model: str) -> list[int]:
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=5, logprobs=0, **GREEDY
        )
        return [int(t.strip().removeprefix("w")) for t in out.choices[0].logprobs.tokens]

    assert answer("small") == hf_greedy(merged_model(hf_model, adapters["small"]), prompt, 5)
    assert answer(MODEL) == hf_greedy(hf_model, prompt, 5)
    with pytest.raises(openai.NotFoundError, match="full"):
        answer("full")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        load = {"lora_name": "full", "lora_path": str(adapters["full"])}
        loaded = http.post("/v1/load_lora_adapter", json=load)
        assert loaded.status_code == 200, loaded.text
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 400  # twice
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no"})
        assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
        assert [m.id for m in client.models.list().data] == [MODEL, "small", "full"]
        assert answer("full") == hf_greedy(merged_model(hf_model, adapters["full"]), prompt, 5)
        unload = {"lora_name": "full"}
        assert http.post("/v1/unload_lora_adapter", json=unload).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json=unload).status_code == 404
    with pytest.raises(openai.NotFoundError):
        answer("full")
    assert [m.id for m in client.models.list().data] == [MODEL, "small"]


# ------------------------------------------------- a dying engine (in process, no model)


class _DyingEngine:
    """AsyncLLM's interface over no model: dead from the start, or dying after one output."""

    def __init__(self, tokenizer, dead: bool) -> None:
        from types import SimpleNamespace

        self.tokenizer = tokenizer
        self.config = SimpleNamespace(max_model_len=96, model=None, enable_lora=False)
        self.model_config = SimpleNamespace(vocab_size=128)
        self.dead_error = RuntimeError("the step raised") if dead else None

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def stats(self) -> dict:
        return {"running": 0, "waiting": 0, "kv_blocks_used": 0}

    async def generate(self, prompt, sampling_params, request_id, priority=0, lora_request=None):
        from pagedjax.errors import EngineDeadError
        from pagedjax.outputs import CompletionOutput, RequestMetrics, RequestOutput

        if self.errored:
            raise EngineDeadError(f"the engine loop stopped: {self.dead_error!r}")
        completion = CompletionOutput(0, " w5", [5], None, None)
        yield RequestOutput(request_id, prompt, [5, 6], [completion], False, RequestMetrics(0.0))
        self.dead_error = RuntimeError("the step raised")
        raise EngineDeadError("the engine loop stopped mid-request")


def _ask(engine, method: str, path: str, body: dict | None = None) -> httpx.Response:
    from pagedjax.entrypoints.openai.api_server import build_app

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(engine, MODEL))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.request(method, path, json=body)

    return asyncio.run(go())


def test_a_dead_engine_answers_503_on_health_and_requests(model_dir):
    from transformers import AutoTokenizer

    engine = _DyingEngine(AutoTokenizer.from_pretrained(model_dir), dead=True)
    health = _ask(engine, "GET", "/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    response = _ask(engine, "POST", "/v1/completions", {"prompt": "w5", "stream": True})
    assert response.status_code == 503 and "stopped" in response.json()["error"]["message"]
    assert _ask(engine, "GET", "/metrics").status_code == 200


def test_an_engine_dying_mid_stream_ends_the_stream_with_an_error(model_dir):
    from transformers import AutoTokenizer

    engine = _DyingEngine(AutoTokenizer.from_pretrained(model_dir), dead=False)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    response = _ask(engine, "POST", "/v1/chat/completions", body)
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_dead"
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == " w5"
    assert _ask(engine, "GET", "/health").status_code == 503
