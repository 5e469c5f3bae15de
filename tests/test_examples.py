"""The examples in examples/, run in-process in their small mode on one tiny model, with their
results checked: the custom attention against the oracle and the engine, the block-size sweep's
waste ordering and its plot, the perplexity against transformers, the RL loop's reward and
compilations, the LoRA fine-tune's answers and its adapter replaced in place."""

from __future__ import annotations

import importlib
import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def examples() -> dict:
    """name -> the example's module (examples/ is no package: loaded by path)."""
    modules = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLES))  # they import _tiny, as when run as scripts
        modules["_tiny"] = importlib.import_module("_tiny")
        for name in ("custom_attention", "block_size_sweep", "score", "rl_loop", "lora_finetune"):
            spec = importlib.util.spec_from_file_location(
                f"example_{name}", EXAMPLES / f"{name}.py"
            )
            modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(modules[name])
    return modules


@pytest.fixture(scope="module")
def tiny_model(examples, tmp_path_factory) -> str:
    """One tiny random Llama for every example (each would otherwise build its own)."""
    return examples["_tiny"].build_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


def test_custom_attention_matches_the_reference_and_the_engine(examples, tiny_model, capsys):
    result = examples["custom_attention"].main(["--model", tiny_model, "--max-tokens", "8"])
    assert result["max_abs_diff"] < 1e-5
    assert len(result["engine_tokens"]) == 8
    assert result["custom_tokens"] == result["engine_tokens"]
    assert result["custom_backend"] == "gather"  # the engine ran the user's attention
    assert "greedy tokens equal: True" in capsys.readouterr().out


def test_block_size_sweep_wastes_more_with_larger_blocks(examples, tiny_model, tmp_path, capsys):
    plot = tmp_path / "sweep.png"
    sizes = [8, 32, 128]  # three of the five: each size compiles its own step shapes
    args = ["--small", "--model", tiny_model, "--plot", str(plot), "--block-sizes"]
    rows = examples["block_size_sweep"].main(args + [str(s) for s in sizes])
    assert [row["block_size"] for row in rows] == sizes
    # The same schedule at every size (no preemption), and a sequence's tokens fill
    # ceil(n / b) blocks of b slots: the slots holding no token can only grow with b.
    for small, large in zip(rows, rows[1:], strict=False):
        assert small["wasted_share"] < large["wasted_share"]
        assert small["wasted_mib"] < large["wasted_mib"]
        assert small["peak_blocks"] > large["peak_blocks"]
    assert rows[0]["wasted_share"] > 0 and rows[-1]["wasted_share"] < 1
    assert all(row["tokens_per_s"] > 0 for row in rows)
    table = [line.split("|")[0].strip() for line in capsys.readouterr().out.splitlines()]
    assert [line for line in table if line.isdigit()] == [str(s) for s in sizes]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_score_perplexity_equals_transformers(examples, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = examples["score"].main(["--small", "--model", tiny_model])
    # The same windows of 127 tokens (--small's max_model_len 128, less the sampled token),
    # each starting on the last token of the one before, scored by transformers in float32.
    ids = AutoTokenizer.from_pretrained(tiny_model).encode(examples["score"].TEXT)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    nlls = []
    for start in range(0, len(ids) - 1, 126):
        window = torch.tensor(ids[start : start + 127])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(window[None]).logits[0, :-1], dim=-1)
        nlls += (-logprobs.gather(1, window[1:, None])[:, 0]).tolist()
    assert len(ids) > 2 * 127  # several windows
    assert result["tokens"] == len(ids) and result["scored"] == len(nlls) == len(ids) - 1
    mean = sum(nlls) / len(nlls)
    assert result["mean_nll"] == pytest.approx(mean, abs=1e-4)
    assert result["perplexity"] == pytest.approx(math.exp(mean), rel=1e-4)


def test_rl_loop_raises_the_reward_and_compiles_nothing_after_the_first_round(examples, tiny_model):
    result = examples["rl_loop"].main(["--small", "--model", tiny_model, "--rounds", "6"])
    rewards = result["rewards"]
    assert max(rewards[-2:]) > 2 * rewards[0] + 0.02, rewards
    assert result["new_compilations"] == 0


def test_lora_finetune_serves_the_trained_adapter_from_memory(examples, tiny_model):
    """The adapter learns the answer, the engine's slot gives the merged weights' tokens
    beside base rows, and new weights replace it in place with nothing compiled."""
    result = examples["lora_finetune"].main(["--small", "--model", tiny_model])
    assert result["losses"][-1] < 0.2 * result["losses"][0]
    assert result["answered"] == 3 and result["base_answered"] == 0
    assert result["merged_equal"]
    assert result["new_compilations"] == 0
