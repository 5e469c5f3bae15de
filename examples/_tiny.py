"""What the examples share: `--small` and `--model`, and a tiny random Llama for `--small`.

The tiny model is a real Hugging Face checkpoint (LlamaConfig, save_pretrained) with random
weights and a character-level tokenizer, so every example runs end to end in seconds with no
download. Its outputs are gibberish; what the examples measure about it is not.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Ids 0, 1 and 2 are unk, bos and eos; every other id below 128 is the ASCII character.
VOCAB_SIZE = 128


def build_tiny_tokenizer():
    """A character-level tokenizer: "Hi" <-> [72, 105], so any English text has real ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(3, VOCAB_SIZE)}
    vocab.update({"<unk>": 0, "<s>": 1, "</s>": 2})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters are joined back without separators
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def build_tiny_model(directory: str | Path, seed: int = 0) -> str:
    """Saves a 2-layer Llama (hidden 64, 4 query and 2 KV heads) and its tokenizer into
    `directory`; returns the path, ready for `LLM(path)`. Numpy and safetensors only (no
    torch): random weights in pagedjax's layout, saved under Hugging Face's names."""
    import numpy as np
    import transformers
    from safetensors.numpy import save_file

    from models.config import model_config_from_hf
    from models.hf_params import hf_state_from_params, param_shapes

    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as the real models have
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    rng = np.random.default_rng(seed)
    shapes = param_shapes(model_config_from_hf(config.to_dict()))

    # The usual init (std 0.02) gives nearly flat logits, whose near-ties would make greedy
    # tokens depend on rounding; larger weights give every step a clear winner.
    def init(name: str, shape: tuple[int, ...]) -> np.ndarray:
        noise = rng.standard_normal(shape).astype(np.float32)
        return 1.0 + 0.2 * noise if "norm" in name else 0.15 * noise

    params = {k: init(k, v) for k, v in shapes.items() if k != "layers"}
    params["layers"] = {k: init(k, v) for k, v in shapes["layers"].items()}
    state = hf_state_from_params(model_config_from_hf(config.to_dict()), params)
    tensors = {name: np.ascontiguousarray(np.asarray(w)) for name, w in state.items()}
    Path(directory).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return str(directory)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--small", action="store_true", help="a tiny random model and a small workload (CI)"
    )
    parser.add_argument(
        "--model", help="an HF directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )


@contextlib.contextmanager
def model_path(args: argparse.Namespace) -> Iterator[str | None]:
    """--model if given; else with --small a tiny model in a temporary directory; else None,
    which `LLM` reads as the default model."""
    if args.model or not args.small:
        yield args.model
        return
    with tempfile.TemporaryDirectory() as directory:
        yield build_tiny_model(directory)
