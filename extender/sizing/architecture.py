"""A transformer's shape, read from a Hugging Face `config.json` (pure, no I/O).

Everything the memory math needs and nothing else: the attention layout (GQA/MQA, explicit
`head_dim`, MLA's compressed KV, which layers attend within a sliding window), the MLP (dense
or mixture of experts, with DeepSeek's shared experts and leading dense layers), tied
embeddings, and the checkpoint's own quantisation. Family quirks are resolved here, once, so
the tensor inventory and the KV math below read one uniform description.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from extender.sizing.errors import SizingError

__all__ = [
    "Architecture",
    "Moe",
    "Mla",
    "FULL",
    "SLIDING",
    "MAX_FIELD",
    "architecture_from_config",
    "is_whole",
]

FULL = "full"
SLIDING = "sliding"

# Families whose config.json leaves tie_word_embeddings out because the class default is True.
_TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text")
# Families with a per-head RMSNorm on queries and keys (q_norm/k_norm of size head_dim).
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text")
# Families with q/k/v projection biases whatever `attention_bias` says (Qwen2 hard-codes them).
_QKV_BIAS = ("qwen2", "qwen2_moe")
# Gemma 2/3 normalise before and after both attention and MLP: four norms per layer.
_FOUR_NORMS = ("gemma2", "gemma3", "gemma3_text")


@dataclass(frozen=True, slots=True)
class Moe:
    """Mixture of experts: every expert is resident in GPU memory, only `top_k` run per token."""

    experts: int
    top_k: int
    expert_intermediate: int
    shared_experts: int = 0  # DeepSeek: n_shared_experts MLPs of expert_intermediate each
    shared_intermediate: int = 0  # Qwen2-MoE: one shared MLP of this size, plus a 1-wide gate
    shared_gate: bool = False
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead (DeepSeek's first k)
    router_bias: bool = False
    expert_bias: bool = False  # gpt-oss: biases on the expert projections
    score_bias: bool = False  # DeepSeek-V3: e_score_correction_bias (fp32, one per expert)


@dataclass(frozen=True, slots=True)
class Mla:
    """DeepSeek's multi-head latent attention: the KV cache holds one compressed latent of
    `kv_lora_rank` plus the shared rotary key of `qk_rope_head_dim` per token and layer."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, slots=True)
class Architecture:
    """The shape of a decoder-only transformer, with the family quirks already resolved."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (0 when every layer is MoE)
    vocab: int
    tied: bool
    max_context: int
    dtype: str  # the checkpoint's torch_dtype: bfloat16, float16, float32
    layer_kinds: tuple[str, ...]  # FULL or SLIDING per layer
    sliding_window: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    attention_sinks: bool = False
    gated_mlp: bool = True  # SwiGLU/GeGLU: gate, up and down projections
    moe: Moe | None = None
    mla: Mla | None = None
    mtp_layers: int = 0  # DeepSeek's multi-token-prediction layers (in the checkpoint only)
    quantization: Mapping[str, Any] = field(default_factory=dict)
    extra_params: int = 0  # parameters outside the text decoder (a vision tower), 16-bit

    @property
    def sliding_layers(self) -> int:
        return sum(1 for k in self.layer_kinds if k == SLIDING)

    @property
    def full_layers(self) -> int:
        return self.layers - self.sliding_layers


#: the estimator builds per-layer tables; the deepest published decoders have under 200 layers,
#: so a count beyond this is a broken config, not a model (and would exhaust memory)
MAX_LAYERS = 10_000
#: the largest whole number a JSON number holds exactly (a float's 53-bit mantissa); a config
#: field, or a checkpoint's byte count, beyond it is not a model's, and the products of such
#: fields overflow a float
MAX_FIELD = 2**53


def is_whole(value: Any) -> bool:
    """Whether a config.json value is a whole number: json.loads gives ints of any size, floats
    such as 4.0, and also NaN and Infinity, which are not. An int is never handed to a float
    test: math.isfinite of one beyond a float raises OverflowError."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and math.isfinite(value) and value.is_integer()


def _whole_field(key: str, value: Any) -> int:
    if not is_whole(value):
        raise SizingError(f"config.json field {key}={value!r} is not an integer")
    if value < 0:
        raise SizingError(f"config.json field {key}={value!r} is negative")
    if value > MAX_FIELD:
        raise SizingError(
            f"config.json field {key}={value!r} is more than 2**53, the largest whole number a "
            "JSON number holds exactly"
        )
    return int(value)


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    value = cfg.get(key, default)
    return None if value is None else _whole_field(key, value)


def _int_list(cfg: Mapping[str, Any], key: str) -> list[int]:
    values = cfg.get(key) or []
    if not isinstance(values, list):
        raise SizingError(f"config.json field {key}={values!r} is not a list of integers")
    return [_whole_field(key, item) for item in values]


def _require(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise SizingError(f"config.json is missing {', '.join(missing)}")


def _text_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(decoder config, outer config): multimodal checkpoints nest the decoder in text_config."""
    if not isinstance(config, Mapping):
        raise SizingError("config.json is not a JSON object")
    outer = dict(config)
    inner = outer.get("text_config")
    if isinstance(inner, Mapping):
        merged = {k: v for k, v in outer.items() if k != "text_config"}
        merged.update(inner)
        return merged, outer
    return outer, outer


def _max_context(cfg: Mapping[str, Any]) -> int:
    """The longest context the engines accept without overrides: max_position_embeddings,
    stretched by a YaRN/dynamic/linear rope factor when the config declares one that is not
    already folded in (as vLLM derives max_model_len)."""
    base = _int(cfg, "max_position_embeddings")
    if base is None:
        base = _int(cfg, "n_positions") or _int(cfg, "seq_length")
    if base is None:
        raise SizingError("config.json is missing max_position_embeddings")
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if isinstance(scaling, Mapping):
        kind = str(scaling.get("rope_type") or scaling.get("type") or "")
        factor = scaling.get("factor")
        if (
            kind in ("yarn", "dynamic", "linear")
            and isinstance(factor, int | float)
            and math.isfinite(factor)
            and factor > 1
            and "original_max_position_embeddings" not in scaling
        ):
            if base * factor > MAX_FIELD:  # a float's infinity among them: no int of it
                raise SizingError(
                    f"config.json rope_scaling factor={factor!r} stretches the context of "
                    f"{base} tokens beyond 2**53"
                )
            return int(base * factor)
    return base


def _layer_kinds(
    cfg: Mapping[str, Any], model_type: str, layers: int
) -> tuple[tuple[str, ...], int | None]:
    """Which layers attend only within a sliding window, and the window."""
    window = _int(cfg, "sliding_window")
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers and window:
        kinds = tuple(SLIDING if "sliding" in str(t) else FULL for t in types)
        return kinds, window
    if not window:
        return (FULL,) * layers, None
    if model_type == "gemma2":
        # transformers Gemma2: even-indexed layers are local (sliding), odd ones global.
        return tuple(SLIDING if i % 2 == 0 else FULL for i in range(layers)), window
    if model_type in ("gemma3", "gemma3_text"):
        pattern = _int(cfg, "sliding_window_pattern", 6) or 6
        return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)), window
    if model_type in ("mistral", "mixtral"):
        return (SLIDING,) * layers, window
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        if not cfg.get("use_sliding_window"):
            return (FULL,) * layers, None
        full = _int(cfg, "max_window_layers", layers) or 0
        return tuple(FULL if i < full else SLIDING for i in range(layers)), window
    # Phi-3 and the rest: engines do not all honour the window; counting full layers is safe.
    return (FULL,) * layers, None


def _moe(cfg: Mapping[str, Any], model_type: str, layers: int) -> Moe | None:
    experts = (
        _int(cfg, "num_local_experts") or _int(cfg, "n_routed_experts") or _int(cfg, "num_experts")
    )
    if not experts:
        return None
    top_k = _int(cfg, "num_experts_per_tok") or _int(cfg, "experts_per_token") or 0
    if model_type == "gpt_oss" or model_type == "mixtral":
        _require(cfg, ("intermediate_size",))
        width = _int(cfg, "intermediate_size") or 0
    else:
        _require(cfg, ("moe_intermediate_size",))
        width = _int(cfg, "moe_intermediate_size") or 0
    dense: tuple[int, ...] = ()
    if model_type in ("deepseek_v2", "deepseek_v3"):
        first = _int(cfg, "first_k_dense_replace", 0) or 0
        freq = _int(cfg, "moe_layer_freq", 1) or 1
        dense = tuple(i for i in range(layers) if i < first or (i - first) % freq != 0)
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        step = _int(cfg, "decoder_sparse_step", 1) or 1
        only = set(_int_list(cfg, "mlp_only_layers"))
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
    shared_int = _int(cfg, "shared_expert_intermediate_size", 0) or 0
    return Moe(
        experts=experts,
        top_k=top_k,
        expert_intermediate=width,
        shared_experts=_int(cfg, "n_shared_experts", 0) or 0,
        shared_intermediate=shared_int,
        shared_gate=shared_int > 0,
        dense_layers=dense,
        router_bias=model_type == "gpt_oss",
        expert_bias=model_type == "gpt_oss",
        score_bias=model_type == "deepseek_v3" or cfg.get("topk_method") == "noaux_tc",
    )


def _mla(cfg: Mapping[str, Any]) -> Mla | None:
    if cfg.get("kv_lora_rank") is None:
        return None
    _require(cfg, ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    return Mla(
        kv_lora_rank=_int(cfg, "kv_lora_rank") or 0,
        q_lora_rank=_int(cfg, "q_lora_rank"),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim") or 0,
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim") or 0,
        v_head_dim=_int(cfg, "v_head_dim") or 0,
    )


def architecture_from_config(config: Mapping[str, Any], *, extra_params: int = 0) -> Architecture:
    """Parse a config.json dict. Raises SizingError naming the missing or malformed fields."""
    cfg, outer = _text_config(config)
    model_type = str(cfg.get("model_type") or outer.get("model_type") or "").lower()
    required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    has_moe_width = any(
        cfg.get(k) for k in ("num_local_experts", "n_routed_experts", "num_experts")
    )
    if not has_moe_width or model_type in ("deepseek_v2", "deepseek_v3"):
        required.append("intermediate_size")
    _require(cfg, tuple(required))
    hidden = _int(cfg, "hidden_size") or 0
    layers = _int(cfg, "num_hidden_layers") or 0
    heads = _int(cfg, "num_attention_heads") or 0
    if not hidden or not layers or not heads:
        raise SizingError(
            "config.json hidden_size, num_hidden_layers and num_attention_heads must be positive"
        )
    if layers > MAX_LAYERS:
        raise SizingError(
            f"config.json num_hidden_layers={layers} is more than any model has (at most "
            f"{MAX_LAYERS:,})"
        )
    kv_heads = _int(cfg, "num_key_value_heads", heads) or heads
    if heads % kv_heads:
        raise SizingError(
            f"config.json num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = _int(cfg, "head_dim") or hidden // heads
    kinds, window = _layer_kinds(cfg, model_type, layers)
    moe = _moe(cfg, model_type, layers)
    mla = _mla(cfg)
    tied_default = model_type in _TIED_BY_DEFAULT
    tied = cfg.get("tie_word_embeddings", outer.get("tie_word_embeddings", tied_default))
    dtype = str(
        cfg.get("torch_dtype") or outer.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    )
    quant = outer.get("quantization_config") or cfg.get("quantization_config") or {}
    if not isinstance(quant, Mapping):
        raise SizingError("config.json quantization_config is not an object")
    attention_bias = bool(cfg.get("attention_bias", False))
    return Architecture(
        model_type=model_type,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=_int(cfg, "intermediate_size", 0) or 0,
        vocab=_int(cfg, "vocab_size") or 0,
        tied=bool(tied),
        max_context=_max_context(cfg),
        dtype=dtype,
        layer_kinds=kinds,
        sliding_window=window,
        qkv_bias=attention_bias or model_type in _QKV_BIAS,
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type in _QK_NORM,
        norms_per_layer=4 if model_type in _FOUR_NORMS else 2,
        attention_sinks=model_type == "gpt_oss",
        moe=moe,
        mla=mla,
        mtp_layers=_int(cfg, "num_nextn_predict_layers", 0) or 0,
        quantization=dict(quant),
        extra_params=extra_params,
    )
