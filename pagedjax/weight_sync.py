"""Weights in and out of a running engine, for training beside it (RLHF, GRPO, distillation).

The engine's model is a pure function of a params pytree, so new weights are one call:
`LLM.update_weights(params)` (or vLLM's `load_weights([(name, array), ...])`) between steps.

- Either naming: a Hugging Face state dict (what a JAX trainer that loaded an HF checkpoint
  holds) or pagedjax's layout (`models/llama.py`); converted with jax.numpy, so weights on a
  device stay there (`models/hf_params.py`), and checked against the model's shapes before
  anything changes.
- The engine keeps its own copy, in its dtype, prepared and placed as at start-up (split over
  the tensor-parallel group, on each data-parallel replica): the caller may donate or change
  its arrays afterwards. Same shapes and types: the step compiles nothing new.
- Requests in flight are recomputed on the new weights: the step on the device completes
  (its tokens come from the old weights), every running request is preempted, keeping its
  tokens, and recomputes its KV with the new weights when it runs again. The prefix cache,
  computed with the old weights, is forgotten.
- `sleep(level)` gives the device memory back to a trainer: the KV pool, and the weights
  (copied to the host at level 1, discarded at level 2: the next `update_weights` brings
  them); `wake_up()` restores them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from models.config import ModelConfig, model_config_from_hf
from models.errors import ModelLoadError
from models.hf_params import check_params, is_hf_state, params_from_hf_state
from models.llama import Params


def as_params(config: ModelConfig, params: Params | Mapping[str, object]) -> Params:
    """A params tree in either naming -> pagedjax's layout, checked against `config`."""
    if not isinstance(params, Mapping):
        raise ModelLoadError(
            f"params must be a dict (pagedjax's layout or an HF state dict), got "
            f"{type(params).__name__}"
        )
    if is_hf_state(params):
        return params_from_hf_state(config, params)
    check_params(config, params)
    return dict(params)


def named_weights(config: ModelConfig, weights: Iterable[tuple[str, object]]) -> dict:
    """vLLM's `load_weights` input, (HF name, array) pairs, as a state dict; they must cover
    the whole model."""
    state = dict(weights)
    if not is_hf_state(state):
        raise ModelLoadError("load_weights takes (Hugging Face name, array) pairs")
    if "lm_head.weight" in state and config.tie_word_embeddings:
        del state["lm_head.weight"]  # tied: the embeddings are the head
    return state


def model_config_of(model: object) -> ModelConfig:
    """The config of an in-memory model: a ModelConfig, a transformers config, or its dict."""
    if isinstance(model, ModelConfig):
        return model
    hf = model.to_dict() if hasattr(model, "to_dict") else model
    if not isinstance(hf, Mapping):
        raise ModelLoadError(
            f"model must be a path, a ModelConfig or a transformers config, got "
            f"{type(model).__name__}"
        )
    return model_config_from_hf(dict(hf))
