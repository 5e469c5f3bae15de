"""fp8 KV scales: writes saturate at the format's range, given scales reach the pool (or fail
before it is allocated), and calibrated scales rescue a model whose K/V exceed fp8's range."""

from __future__ import annotations

import json
import logging

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.kv_cache import allocate_kv_cache, with_scales, write_kv
from pagedjax import cli, kv_scales
from pagedjax.config import EngineConfig
from pagedjax.core.memory import KVCacheSpec
from pagedjax.engine import LLMEngine
from pagedjax.entrypoints.openai.api_server import engine_options
from pagedjax.sampling_params import SamplingParams
from tests.conftest import build_tiny_tokenizer

# The tiny word-level tokenizer reads every word of the built-in English texts as its unknown
# token; these texts of its own words give the calibration varied tokens.
TINY_TEXTS = tuple(
    " ".join(f"w{i}" for i in np.random.default_rng(seed).integers(3, 128, 40)) for seed in range(3)
)


def make_engine(tiny, params=None, name="llama", **options) -> LLMEngine:
    path, _, config, tiny_params = tiny(name)
    # One token budget for every engine: equal step shapes share their compilations.
    settings = dict(max_model_len=64, num_kv_blocks=8, max_num_batched_tokens=64, dtype="float32")
    return LLMEngine(
        EngineConfig(model=str(path), **{**settings, **options}),
        config,
        tiny_params if params is None else params,
        build_tiny_tokenizer(),
    )


def pool_scales(engine: LLMEngine) -> tuple[np.ndarray, np.ndarray]:
    cache = engine.engine_core.worker.runner.kv_cache
    return np.asarray(cache.k_scale), np.asarray(cache.v_scale)


# ------------------------------------------------------------------------------- the clamp


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_writes_saturate_at_the_formats_max_times_the_scale(dtype):
    fp8_max = float(jnp.finfo(dtype).max)  # 448 for e4m3fn (which has no inf), 57344 for e5m2
    cache = allocate_kv_cache(KVCacheSpec(1, 2, 4, dtype), 2, 2)
    cache = with_scales(cache, [[1.0, 2.0]], [[1.0, 2.0]])
    k = jnp.array([[1e6, -1e6, 3.0, -0.5], [1e9, -1e9, 6.0, -1.0]], jnp.float32)[None]
    cache = write_kv(cache, 0, k, -k, jnp.array([2], jnp.int32))
    for pool, sign in ((cache.k, 1), (cache.v, -1)):
        stored = np.asarray(pool[0, :, 1, 0].astype(jnp.float32))  # [heads, D]: value / scale
        assert np.all(np.isfinite(stored))
        np.testing.assert_array_equal(stored[:, :2], sign * np.array([[1, -1], [1, -1]]) * fp8_max)
        np.testing.assert_array_equal(stored[:, 2:], sign * np.array([[3, -0.5], [3, -0.5]]))


def test_with_scales_checks_the_pool_and_the_shape():
    cache = allocate_kv_cache(KVCacheSpec(3, 2, 4, jnp.float8_e4m3fn), 2, 2)
    with pytest.raises(ValueError, match=r"k_scale has shape \(2,\).*\(3, 2\)"):
        with_scales(cache, np.ones(2), np.ones((3, 2)))
    with pytest.raises(ValueError, match="no scales"):
        with_scales(allocate_kv_cache(KVCacheSpec(3, 2, 4, jnp.float32), 2, 2), 1, 1)


# ----------------------------------------------------------------- given scales, validation


def test_scales_from_absmax_maps_the_maximum_onto_the_formats_and_floors_zero():
    scales = kv_scales.scales_from_absmax(np.array([[448.0, 44.8], [0.0, 896.0]]), "float8_e4m3fn")
    np.testing.assert_allclose(scales, [[1.0, 0.1], [kv_scales.MIN_SCALE, 2.0]], rtol=1e-6)
    assert kv_scales.scales_from_absmax(np.array(57344.0), jnp.float8_e5m2) == 1.0


@pytest.mark.parametrize(
    "k_scale, expected",
    [
        (0.5, np.full((3, 2), 0.5)),
        ([0.5, 2.0], np.array([[0.5, 2.0]] * 3)),
        ([[1, 2], [3, 4], [5, 6]], np.arange(1, 7).reshape(3, 2)),
    ],
)
def test_a_json_file_broadcasts_a_number_or_a_heads_list_over_layers(tmp_path, k_scale, expected):
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": k_scale, "v_scale": 3.0}))
    k, v = kv_scales.load_kv_scales(str(path), num_layers=3, num_kv_heads=2)
    np.testing.assert_array_equal(k, expected)
    np.testing.assert_array_equal(v, np.full((3, 2), 3.0))
    assert k.dtype == v.dtype == np.float32
    k, v = kv_scales.load_kv_scales(0.25, 3, 2)
    np.testing.assert_array_equal(k, np.full((3, 2), 0.25))


@pytest.mark.parametrize(
    "k_scale, message",
    [([1.0, 2.0, 3.0], r"shape \[3\].*\[2\]"), ([[1.0, 2.0]] * 2, r"shape \[2, 2\].*\[3, 2\]")],
)
def test_a_scale_of_the_wrong_shape_names_the_shapes_that_fit(tmp_path, k_scale, message):
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": k_scale, "v_scale": 1.0}))
    with pytest.raises(ValueError, match=message):
        kv_scales.load_kv_scales(path, num_layers=3, num_kv_heads=2)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(kv_cache_scales=2.0), "need an fp8 kv_cache_dtype"),
        (dict(calculate_kv_scales=True, kv_cache_dtype="bfloat16"), "need an fp8"),
        (dict(kv_cache_dtype="fp8", calculate_kv_scales=True, kv_cache_scales=2.0), "not both"),
        (dict(kv_cache_dtype="fp8", kv_cache_scales=0.0), "positive and finite"),
        (dict(kv_cache_dtype="fp8", kv_cache_scales=float("inf")), "positive and finite"),
        (dict(kv_cache_dtype="fp8", kv_cache_scales="/no/such/file.json"), "cannot read"),
    ],
)
def test_bad_scale_options_fail_at_config_construction(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"k_scale": [1, -2], "v_scale": 1}', "k_scale must be positive and finite"),
        ('{"k_scale": 1, "v_scale": [[1, NaN]]}', "v_scale must be positive and finite"),
        ('{"k_scale": 1}', '"k_scale": ..., "v_scale": ...'),
        ('{"k_scale": [[[1]]], "v_scale": 1}', r"\[num_layers, num_kv_heads\]"),
        ("not json", "cannot read"),
    ],
)
def test_a_bad_scales_file_fails_at_config_construction(tmp_path, content, message):
    path = tmp_path / "scales.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        EngineConfig(kv_cache_dtype="fp8", kv_cache_scales=str(path))


def test_given_scales_reach_the_pool_and_survive_a_reset(tiny, tmp_path):
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": [0.5, 2.0], "v_scale": [[1, 2], [3, 4], [5, 6]]}))
    engine = make_engine(tiny, kv_cache_dtype="fp8", kv_cache_scales=str(path))
    expected = np.array([[0.5, 2.0]] * 3), np.arange(1, 7).reshape(3, 2)
    np.testing.assert_array_equal(pool_scales(engine)[0], expected[0])
    np.testing.assert_array_equal(pool_scales(engine)[1], expected[1])
    engine.engine_core.worker.reset_kv_cache()  # what a failed step that lost the pool does
    np.testing.assert_array_equal(pool_scales(engine)[0], expected[0])
    np.testing.assert_array_equal(pool_scales(engine)[1], expected[1])


def test_scales_that_do_not_fit_the_model_fail_before_the_pool_is_allocated(
    tiny, tmp_path, monkeypatch
):
    allocated = []
    monkeypatch.setattr(
        "pagedjax.worker.model_runner.allocate_kv_cache",
        lambda *args: allocated.append(args),
    )
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": [1.0, 2.0, 3.0], "v_scale": 1.0}))  # 2 KV heads
    with pytest.raises(ValueError, match=r"k_scale has shape \[3\]"):
        make_engine(tiny, kv_cache_dtype="fp8", kv_cache_scales=str(path))
    assert not allocated


def test_cli_flags_set_the_scale_options(tmp_path):
    parser = cli.build_parser()
    serve = parser.parse_args(["serve", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    assert engine_options(serve) == {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}
    serve = parser.parse_args(["serve", "--kv-cache-scales", "0.5"])
    assert engine_options(serve) == {"kv_cache_scales": 0.5}
    path = str(tmp_path / "scales.json")
    generate = parser.parse_args(
        ["generate", "hi", "--kv-cache-dtype=fp8", "--kv-cache-scales", path]
    )
    assert (generate.kv_cache_dtype, generate.kv_cache_scales) == ("fp8", path)
    assert generate.calculate_kv_scales is None


# -------------------------------------------------------------------------- calibration


def scaled_kv_params(params: dict, config, factor: float) -> dict:
    """The same function with K and V `factor` times larger: q and the output projection are
    divided by it, so only the pool's contents change (and leave fp8's range)."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    column = jnp.concatenate([jnp.full(q, 1 / factor), jnp.full(2 * kv, factor)])
    layers = dict(params["layers"], wqkv=params["layers"]["wqkv"] * column)
    layers["wo"] = params["layers"]["wo"] / factor
    return dict(params, layers=layers)


# All prefilled in one step of the 64-token budget.
PROMPT = np.random.default_rng(7).integers(3, 128, 32).tolist()
GREEDY_PROMPTS = [np.random.default_rng(s).integers(3, 128, 12).tolist() for s in range(2)]


def prompt_logprobs_and_greedy(engine: LLMEngine) -> tuple[np.ndarray, list[list[int]]]:
    """Each prompt token's logprob, given the ones before (teacher forcing, so one early
    difference does not change every later token), and a few greedy continuations."""
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(GREEDY_PROMPTS):
        engine.add_request(str(i), prompt, greedy)
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    logprobs = [next(iter(entry.values())).logprob for entry in done["p"].prompt_logprobs[1:]]
    tokens = [done[str(i)].outputs[0].token_ids for i in range(len(GREEDY_PROMPTS))]
    return np.array(logprobs), tokens


@pytest.fixture(scope="module")
def scaled_model_runs(tiny):
    """float32 and fp8 runs of the tiny Llama, and fp8 runs of its K/V-scaled twin with scales
    of 1 and with calibrated ones; the calibrated engine too."""
    _, _, config, params = tiny("llama")
    big = scaled_kv_params(params, config, 1000.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_scales, "CALIBRATION_TEXTS", TINY_TEXTS)
        calibrated = make_engine(tiny, big, kv_cache_dtype="fp8", calculate_kv_scales=True)
    return dict(
        float32=prompt_logprobs_and_greedy(make_engine(tiny)),
        fp8=prompt_logprobs_and_greedy(make_engine(tiny, kv_cache_dtype="fp8")),
        ones=prompt_logprobs_and_greedy(make_engine(tiny, big, kv_cache_dtype="fp8")),
        calibrated=prompt_logprobs_and_greedy(calibrated),
        engine=calibrated,
    )


def test_calibration_gives_finite_positive_scales_that_fit_the_kv(tiny, scaled_model_runs):
    _, _, config, _ = tiny("llama")
    engine = scaled_model_runs["engine"]
    k_scale, v_scale = pool_scales(engine)
    for scale in (k_scale, v_scale):
        assert scale.shape == (config.num_layers, config.num_kv_heads)
        assert np.all(np.isfinite(scale)) and np.all(scale > 0)
    # The calibration's K/V leave fp8's range, and the scales map their maxima onto 448.
    prompts = kv_scales.calibration_prompts(build_tiny_tokenizer(), 64, 64, TINY_TEXTS)
    assert [len(p) for p in prompts] == [40, 24]
    worker = engine.engine_core.worker  # its params are the scaled ones, as the platform packs them
    k_max, v_max = kv_scales.kv_absmax(
        worker.params, config, prompts, worker.attention, jnp.float32, 64
    )
    assert k_max.min() > 448 and v_max.min() > 448
    np.testing.assert_allclose(k_scale * 448, k_max, rtol=1e-6)
    np.testing.assert_allclose(v_scale * 448, v_max, rtol=1e-6)


def test_calibrated_scales_rescue_a_model_whose_kv_exceed_fp8s_range(scaled_model_runs):
    reference, reference_tokens = scaled_model_runs["float32"]

    def error(name: str) -> float:
        return float(np.abs(scaled_model_runs[name][0] - reference).mean())

    def agreement(name: str) -> int:
        pairs = zip(scaled_model_runs[name][1], reference_tokens, strict=True)
        return sum(a == b for got, want in pairs for a, b in zip(got, want, strict=True))

    # Scales of 1 saturate every K and V: the logprobs are off by ~1 nat per token.
    assert error("ones") > 0.5
    # Calibrated, the scaled model is as close to float32 as fp8 is on the original one.
    assert error("calibrated") < 1.5 * error("fp8") + 0.01
    assert agreement("calibrated") >= agreement("ones")


def test_calibration_is_logged_once_with_the_scales_range(tiny, caplog, monkeypatch):
    monkeypatch.setattr(kv_scales, "CALIBRATION_TEXTS", TINY_TEXTS)
    with caplog.at_level(logging.INFO, logger="pagedjax.worker.worker"):
        make_engine(tiny, kv_cache_dtype="fp8", calculate_kv_scales=True)
    lines = [r.getMessage() for r in caplog.records if "KV scales" in r.getMessage()]
    assert len(lines) == 1 and "calibrated" in lines[0] and "k_scale" in lines[0]


def test_calibration_prompts_fit_the_token_budget():
    tokenizer = build_tiny_tokenizer()
    prompts = kv_scales.calibration_prompts(tokenizer, 50, 30, texts=TINY_TEXTS)
    assert [len(p) for p in prompts] == [30, 20]
    assert prompts[0] == tokenizer.encode(TINY_TEXTS[0])[:30]
    assert len(kv_scales.calibration_prompts(tokenizer, 1000, 1000)) == 3  # the built-in texts
