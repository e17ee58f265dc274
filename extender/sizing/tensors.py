"""The tensors of a checkpoint, derived from its architecture (pure).

Each entry is one tensor shape with how many copies the model holds (layers x experts), what
it is (a projection the quantisers compress, an embedding, a norm, ...) and how tensor
parallelism splits it. Counting the shapes reproduces the published `total_size` of the
checkpoints exactly (tests/test_sizing_checkpoints.py), which is what makes the weights
estimate trustworthy; quantised byte counts are then applied per tensor by `quant`.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from extender.sizing.architecture import Architecture

__all__ = [
    "Tensor",
    "inventory",
    "LINEAR",
    "EXPERT",
    "EMBED",
    "HEAD",
    "NORM",
    "BIAS",
    "ROUTER",
    "OTHER",
    "FP32",
    "SHARD",
    "REPLICATE",
    "KV",
]

# What a tensor is: quantisation methods compress LINEAR (and EXPERT) projections only.
LINEAR = "linear"
EXPERT = "expert"  # one projection of one routed expert
EMBED = "embed"
HEAD = "lm_head"
NORM = "norm"
BIAS = "bias"
ROUTER = "router"
OTHER = "other"  # attention sinks, a vision tower: kept 16-bit
FP32 = "fp32"  # DeepSeek-V3's e_score_correction_bias is stored as float32

# How tensor parallelism splits it across GPUs.
SHARD = "shard"  # each of tp GPUs holds 1/tp
REPLICATE = "replicate"  # every GPU holds all of it
KV = "kv"  # split by KV head: once tp exceeds the KV heads, heads are replicated


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # (out_features, in_features) for projections
    role: str
    count: int = 1
    split: str = SHARD

    @property
    def params(self) -> int:
        return prod(self.shape) * self.count


def _attention(a: Architecture, n: int) -> list[Tensor]:
    h = a.hidden
    if a.mla is not None:
        m = a.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        out: list[Tensor] = []
        if m.q_lora_rank:
            out += [
                Tensor("q_a_proj", (m.q_lora_rank, h), LINEAR, n, REPLICATE),
                Tensor("q_a_layernorm", (m.q_lora_rank,), NORM, n, REPLICATE),
                Tensor("q_b_proj", (a.heads * qk, m.q_lora_rank), LINEAR, n),
            ]
        else:
            out.append(Tensor("q_proj", (a.heads * qk, h), LINEAR, n))
        out += [
            Tensor(
                "kv_a_proj_with_mqa", (m.kv_lora_rank + m.qk_rope_head_dim, h), LINEAR, n, REPLICATE
            ),
            Tensor("kv_a_layernorm", (m.kv_lora_rank,), NORM, n, REPLICATE),
            Tensor(
                "kv_b_proj",
                (a.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                LINEAR,
                n,
            ),
            Tensor("o_proj", (h, a.heads * m.v_head_dim), LINEAR, n),
        ]
        return out
    q = a.heads * a.head_dim
    kv = a.kv_heads * a.head_dim
    out = [
        Tensor("q_proj", (q, h), LINEAR, n),
        Tensor("k_proj", (kv, h), LINEAR, n, KV),
        Tensor("v_proj", (kv, h), LINEAR, n, KV),
        Tensor("o_proj", (h, q), LINEAR, n),
    ]
    if a.qkv_bias:
        out += [
            Tensor("q_proj.bias", (q,), BIAS, n),
            Tensor("k_proj.bias", (kv,), BIAS, n, KV),
            Tensor("v_proj.bias", (kv,), BIAS, n, KV),
        ]
    if a.o_bias:
        out.append(Tensor("o_proj.bias", (h,), BIAS, n, REPLICATE))
    if a.qk_norm:
        out += [
            Tensor("q_norm", (a.head_dim,), NORM, n, REPLICATE),
            Tensor("k_norm", (a.head_dim,), NORM, n, REPLICATE),
        ]
    if a.attention_sinks:
        out.append(Tensor("sinks", (a.heads,), OTHER, n))
    return out


def _mlp(prefix: str, width: int, hidden: int, n: int, role: str, bias: bool) -> list[Tensor]:
    if n <= 0 or width <= 0:
        return []
    out = [
        Tensor(f"{prefix}gate_proj", (width, hidden), role, n),
        Tensor(f"{prefix}up_proj", (width, hidden), role, n),
        Tensor(f"{prefix}down_proj", (hidden, width), role, n),
    ]
    if bias:
        out += [
            Tensor(f"{prefix}gate_up_proj.bias", (2 * width,), BIAS, n),
            Tensor(f"{prefix}down_proj.bias", (hidden,), BIAS, n, REPLICATE),
        ]
    return out


def _moe(a: Architecture, n_moe: int) -> list[Tensor]:
    e = a.moe
    assert e is not None
    h = a.hidden
    out = [Tensor("router", (e.experts, h), ROUTER, n_moe, REPLICATE)]
    if e.router_bias:
        out.append(Tensor("router.bias", (e.experts,), BIAS, n_moe, REPLICATE))
    if e.score_bias:
        out.append(Tensor("e_score_correction_bias", (e.experts,), FP32, n_moe, REPLICATE))
    out += _mlp("experts.", e.expert_intermediate, h, n_moe * e.experts, EXPERT, e.expert_bias)
    if e.shared_experts:
        out += _mlp(
            "shared_experts.", e.expert_intermediate * e.shared_experts, h, n_moe, LINEAR, False
        )
    if e.shared_intermediate:
        out += _mlp("shared_expert.", e.shared_intermediate, h, n_moe, LINEAR, False)
        if e.shared_gate:
            out.append(Tensor("shared_expert_gate", (1, h), ROUTER, n_moe, REPLICATE))
    return out


def _decoder(a: Architecture, layers: int, moe_layers: int) -> list[Tensor]:
    out = _attention(a, layers)
    out.append(Tensor("layernorms", (a.hidden,), NORM, layers * a.norms_per_layer, REPLICATE))
    out += _mlp("mlp.", a.intermediate, a.hidden, layers - moe_layers, LINEAR, a.mlp_bias)
    if a.moe is not None and moe_layers:
        out += _moe(a, moe_layers)
    return out


def inventory(
    a: Architecture, *, checkpoint: bool = False, lm_head_stored: bool = False
) -> list[Tensor]:
    """Every tensor of the model. `checkpoint`: also what only the files hold (DeepSeek's
    multi-token-prediction layers, and a tied lm_head some checkpoints store anyway when
    `lm_head_stored`); engines load neither for plain serving."""
    moe_layers = 0 if a.moe is None else a.layers - len(a.moe.dense_layers)
    out = _decoder(a, a.layers, moe_layers)
    out.append(Tensor("embed_tokens", (a.vocab, a.hidden), EMBED))
    out.append(Tensor("norm", (a.hidden,), NORM, 1, REPLICATE))
    if not a.tied or (checkpoint and lm_head_stored):
        out.append(Tensor("lm_head", (a.vocab, a.hidden), HEAD))
    if a.extra_params:
        out.append(Tensor("vision_tower", (a.extra_params,), OTHER, 1, REPLICATE))
    if checkpoint and a.mtp_layers:
        n = a.mtp_layers
        out += _decoder(a, n, n if a.moe is not None else 0)
        out += [
            Tensor(
                "mtp.norms", (a.hidden,), NORM, 3 * n, REPLICATE
            ),  # enorm, hnorm, shared_head.norm
            Tensor("mtp.eh_proj", (a.hidden, 2 * a.hidden), OTHER, n),
            Tensor("mtp.embed_tokens", (a.vocab, a.hidden), EMBED, n),
            Tensor("mtp.shared_head", (a.vocab, a.hidden), HEAD, n),
        ]
    return out
