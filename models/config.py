"""Static model configuration: a hashable dataclass, parsed from a Hugging Face config dict."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from models.errors import ModelLoadError, UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
)

MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}

# The MLP's activations by their Hugging Face names (`hidden_act` / Gemma's
# `hidden_activation`): SwiGLU's SiLU, and GeGLU's tanh-approximated GELU.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Gemma's family: embeddings scaled by sqrt(hidden), RMSNorms of (1 + w), a norm after the
# attention and after the MLP as well as before each.
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Per-head RMSNorms of q and k before RoPE.
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
# Mixture-of-experts families, which keep the attention of the dense family they extend.
MOE_ARCHITECTURES = (
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
)


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: each token's router picks `top_k` of `num_experts` SwiGLU
    experts and sums their outputs weighted by its softmax probabilities."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    # The top-k probabilities renormalized to sum to 1 (Mixtral always, Qwen's
    # `norm_topk_prob`), or left as they are in the softmax over all experts.
    normalize_top_k: bool
    # Per layer: experts (True) or the dense MLP of `ModelConfig.intermediate_size` (Qwen's
    # `mlp_only_layers` and `decoder_sparse_step`).
    sparse_layers: tuple[bool, ...]
    # Qwen2-MoE: a dense expert every token also runs, scaled by sigmoid(x @ gate); 0: none.
    shared_intermediate_size: int = 0
    # Every expert computed for every token instead of the grouped matmul: E / k times the
    # work, for the benchmark's peer (benchmarks/moe.py).
    dense_experts: bool = False
    # gpt-oss: the router's logits have a bias and the softmax runs over the top-k logits
    # only; the experts' projections have biases; its SwiGLU clamps the gate (at most
    # `swiglu_limit`) and the up projection (within +-limit) and computes
    # (up + 1) * gate * sigmoid(alpha * gate). None: plain SwiGLU.
    router_bias: bool = False
    softmax_after_top_k: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    def mlp_index(self) -> tuple[int, ...]:
        """Per layer: its index in the stack of the expert layers' weights where it is
        sparse, else in the dense layers' stack."""
        counts, index = [0, 0], []
        for sparse in self.sparse_layers:
            index.append(counts[sparse])
            counts[sparse] += 1
        return tuple(index)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projection biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    # Per layer: 0 for full attention, else the sliding window (keys at distance < window).
    sliding_windows: tuple[int, ...] = ()
    # Sorted (key, value) pairs of the rope scaling dict, hashable; () for plain RoPE.
    rope_scaling: tuple[tuple[str, object], ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    hidden_act: str = "silu"  # one of ACTIVATIONS
    # Gemma: the embeddings times sqrt(hidden_size); norms after attention and MLP too.
    scale_embeddings: bool = False
    post_norms: bool = False
    # The attention's scale is query_pre_attn_scalar ** -0.5 where set (Gemma), else
    # head_dim ** -0.5; scores and final logits soft-capped (cap * tanh(x / cap)) where set.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Sliding-window layers' own RoPE base (Gemma 3's local layers); None: rope_theta.
    local_rope_theta: float | None = None
    moe: MoeConfig | None = None  # the MLP's experts, for a mixture-of-experts family
    # gpt-oss: a learned logit per query head in each layer's softmax (an "attention sink"
    # that takes probability without a value), and a bias on the attention's output.
    attention_sinks: bool = False
    attention_out_bias: bool = False

    @property
    def num_dense_layers(self) -> int:
        """Layers with the dense MLP of `intermediate_size` (all but the expert layers)."""
        return len(self.mlp_layers(experts=False))

    def mlp_layers(self, experts: bool) -> tuple[int, ...]:
        """The layers whose MLP is experts (True) or the dense one (False), in order: the
        layers each stack of MLP weights is stacked over."""
        sparse = self.moe.sparse_layers if self.moe else (False,) * self.num_layers
        return tuple(i for i, s in enumerate(sparse) if s == experts)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def norm_offset(self) -> float:
        """What the checkpoint's RMSNorm weights lack: Gemma stores w and multiplies by
        1 + w; the loader adds it once, so every family's norm multiplies by its weight."""
        return 1.0 if self.architecture in GEMMA_ARCHITECTURES else 0.0

    def num_layer_params(self) -> int:
        """Matmul weights of all decoder layers that every computed token uses (of a
        mixture of experts: the router and the experts it picks, not all of them)."""
        H = self.hidden_size  # noqa: N806
        attn = H * (self.q_size + 2 * self.kv_size) + self.q_size * H
        dense = self.num_dense_layers * 3 * H * self.intermediate_size
        sparse = 0
        if self.moe is not None:
            m = self.moe
            per_layer = (
                H * m.num_experts
                + 3 * H * (m.top_k * m.intermediate_size + m.shared_intermediate_size)
                + (H if m.shared_intermediate_size else 0)
            )
            sparse = m.num_sparse_layers * per_layer
        return self.num_layers * attn + dense + sparse

    def inv_freq(self, local: bool = False) -> np.ndarray:
        """[head_dim // 2] float32 RoPE inverse frequencies, computed as transformers does;
        local: a sliding-window layer's where it has a base of its own (unscaled)."""
        theta = self.local_rope_theta if local else self.rope_theta
        exponents = np.arange(0, self.head_dim, 2, dtype=np.int64).astype(np.float32)
        inv_freq = (1.0 / (np.float32(theta) ** (exponents / self.head_dim))).astype(np.float32)
        if local:
            return inv_freq
        scaling = dict(self.rope_scaling)
        rope_type = scaling.get("rope_type", "default")
        if rope_type == "default":
            return inv_freq
        if rope_type == "linear":
            return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
        if rope_type == "llama3":
            return _llama3_inv_freq(inv_freq, scaling)
        if rope_type == "yarn":
            return _yarn_inv_freq(self.head_dim, self.rope_theta, scaling)
        raise AssertionError(f"unreachable: rope type {rope_type} passed validation")

    @property
    def rope_attention_factor(self) -> float:
        """What YaRN multiplies cos and sin by (1 for every other RoPE)."""
        scaling = dict(self.rope_scaling)
        if scaling.get("rope_type") != "yarn":
            return 1.0
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor, mscale = scaling["factor"], scaling.get("mscale")
        if mscale and scaling.get("mscale_all_dim"):
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, scaling["mscale_all_dim"])
        return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """YaRN's blend of interpolated and extrapolated frequencies, as transformers computes
    them (float32 where it does): dimensions rotating fast keep their frequency, slow ones
    are divided by the factor, with a linear ramp between beta_fast and beta_slow rotations."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    pos_freqs = (np.float32(theta) ** exponents).astype(np.float32)
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    interpolation = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    ramp = (np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    keep = (1 - np.clip(ramp, 0, 1)).astype(np.float32)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _local_rope_theta(hf: dict) -> float | None:
    """A sliding-window layer's own RoPE base (Gemma 3): v5's per-layer-type parameters, or
    v4's `rope_local_base_freq`; its scaling must be none."""
    params = (hf.get("rope_parameters") or {}).get("sliding_attention")
    if params is None:
        local = hf.get("rope_local_base_freq")
        return None if local is None else float(local)
    if params.get("rope_type", "default") != "default":
        raise ModelLoadError(f"RoPE scaling of sliding-window layers is not supported: {params}")
    return float(params["rope_theta"])


def _rope_settings(hf: dict) -> tuple[float, tuple[tuple[str, object], ...]]:
    """(rope_theta, scaling) from either transformers v5 `rope_parameters` or v4 fields (the
    full-attention layers' where each layer type has its own)."""
    params = dict(hf.get("rope_parameters") or {})
    params = dict(params.get("full_attention", params))
    legacy = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    scaling = {**legacy, **params}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"RoPE scaling type {rope_type!r} is not supported; supported: {_SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return float(theta), ()
    if rope_type == "yarn" and not scaling.get("original_max_position_embeddings"):
        raise ModelLoadError("YaRN RoPE scaling needs original_max_position_embeddings")
    if rope_type == "yarn" and not scaling.get("factor"):
        raise ModelLoadError("YaRN RoPE scaling needs its factor")
    return float(theta), tuple(sorted(scaling.items()))


def _sliding_windows(hf: dict, architecture: str, num_layers: int) -> tuple[int, ...]:
    window = hf.get("sliding_window") or 0
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (window,) * num_layers
    layer_types = hf.get("layer_types")
    typed = (*GEMMA_ARCHITECTURES, "GptOssForCausalLM")  # layer_types alone say which slide
    if architecture in typed and window and layer_types:
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    if window and hf.get("use_sliding_window") and layer_types:
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    return (0,) * num_layers


def _moe_config(hf: dict, architecture: str, num_layers: int) -> MoeConfig | None:
    """The experts of a mixture-of-experts family's config; None for a dense family."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    mixtral = architecture == "MixtralForCausalLM"
    gpt_oss = architecture == "GptOssForCausalLM"
    if mixtral or gpt_oss:  # every layer's MLP is experts of intermediate_size
        size, sparse = int(hf["intermediate_size"]), (True,) * num_layers
    else:
        size = int(hf["moe_intermediate_size"])
        step = int(hf.get("decoder_sparse_step") or 1)
        dense_only = set(hf.get("mlp_only_layers") or ())
        sparse = tuple(
            num_experts > 0 and i not in dense_only and (i + 1) % step == 0
            for i in range(num_layers)
        )
    if not any(sparse):
        return None
    top_k = int(hf["num_experts_per_tok"])
    if not 0 < top_k <= num_experts:
        raise ModelLoadError(f"num_experts_per_tok {top_k} must be in 1..{num_experts}")
    shared = hf.get("shared_expert_intermediate_size") or 0
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=size,
        normalize_top_k=mixtral or bool(hf.get("norm_topk_prob")),
        sparse_layers=sparse,
        shared_intermediate_size=int(shared) if architecture == "Qwen2MoeForCausalLM" else 0,
        router_bias=gpt_oss,
        softmax_after_top_k=gpt_oss,
        expert_bias=gpt_oss,
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)) if gpt_oss else None,
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
    )


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)


def model_config_from_hf(hf: dict) -> ModelConfig:
    """Builds our config from a Hugging Face `config.json` dict; rejects what we cannot run."""
    # A config built in memory (LlamaConfig(...)) names no architectures: its model type does.
    by_type = MODEL_TYPES.get(hf.get("model_type"))
    architectures = hf.get("architectures") or ([by_type] if by_type else [])
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise UnsupportedArchitectureError(
            f"architecture {architectures or hf.get('model_type')!r} is not supported; "
            f"pagedjax runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if activation not in ACTIVATIONS:
        raise ModelLoadError(f"hidden_act {activation!r} is not supported (only {ACTIVATIONS})")
    gemma = architecture in GEMMA_ARCHITECTURES
    try:
        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        num_layers = int(hf["num_hidden_layers"])
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        head_dim = int(hf.get("head_dim") or hidden_size // num_heads)
        theta, scaling = _rope_settings(hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        config = ModelConfig(
            architecture=architecture,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf.get("intermediate_size") or 0),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=architecture == "Qwen2ForCausalLM"
            or bool(hf.get("attention_bias") or hf.get("qkv_bias")),
            qk_norm=architecture in QK_NORM_ARCHITECTURES,
            sliding_windows=_sliding_windows(hf, architecture, num_layers),
            rope_scaling=scaling,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=activation,
            scale_embeddings=gemma,
            post_norms=gemma,
            query_pre_attn_scalar=_optional_float(hf.get("query_pre_attn_scalar")),
            attn_logit_softcap=_optional_float(hf.get("attn_logit_softcapping")),
            final_logit_softcap=_optional_float(hf.get("final_logit_softcapping")),
            local_rope_theta=_local_rope_theta(hf) if gemma else None,
            moe=_moe_config(hf, architecture, num_layers),
            attention_sinks=architecture == "GptOssForCausalLM",
            attention_out_bias=architecture == "GptOssForCausalLM",
        )
    except KeyError as e:
        raise ModelLoadError(f"config is missing the field {e.args[0]!r}") from e
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads "
            f"{num_kv_heads}"
        )
    if hf.get("mlp_bias"):
        raise ModelLoadError("mlp_bias=True is not supported")
    return config
