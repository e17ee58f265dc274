"""KV cache bytes (pure).

Per token and layer the cache holds a key and a value for every KV head:
`2 x kv_heads x head_dim x dtype_bytes` (GQA/MQA: kv_heads < heads; `head_dim` explicit when
the config says so). MLA (DeepSeek V2/V3) caches one compressed latent instead:
`(kv_lora_rank + qk_rope_head_dim) x dtype_bytes`, the same on every GPU under tensor
parallelism (the latent is not split by head). Layers with a sliding window never hold more
than the window (plus the block being filled) per sequence, when the engine frees what falls
out of it (vLLM's hybrid KV cache manager, SGLang's SWA pool); TGI is counted as if every
layer kept the whole context. Sequences occupy whole blocks of `BLOCK_TOKENS` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from extender.sizing.architecture import Architecture

__all__ = ["KvCache", "kv_cache", "BLOCK_TOKENS"]

#: vLLM's default block size (vllm/v1/kv_cache_interface.py); SGLang's page size is 1.
BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class KvCache:
    bytes_per_token: int  # whole model, every layer at full attention
    total_bytes: int  # every sequence at full length, whole model
    per_gpu_bytes: int
    tokens_per_sequence: int
    sliding_tokens_per_sequence: int | None


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _per_layer_token(a: Architecture, dtype_bytes: int) -> int:
    if a.mla is not None:
        return (a.mla.kv_lora_rank + a.mla.qk_rope_head_dim) * dtype_bytes
    return 2 * a.kv_heads * a.head_dim * dtype_bytes


def kv_cache(
    a: Architecture,
    *,
    dtype_bytes: int,
    context: int,
    sequences: int,
    tp: int = 1,
    windowed: bool = True,
) -> KvCache:
    """The cache for `sequences` sequences of `context` tokens each, whole model and per GPU."""
    per_layer = _per_layer_token(a, dtype_bytes)
    tokens = _round_up(context, BLOCK_TOKENS)
    sliding_tokens: int | None = None
    full_layers, sliding_layers = a.layers, 0
    if windowed and a.sliding_window and a.sliding_layers:
        sliding_tokens = min(tokens, _round_up(a.sliding_window, BLOCK_TOKENS) + BLOCK_TOKENS)
        full_layers, sliding_layers = a.full_layers, a.sliding_layers
    per_sequence = per_layer * (full_layers * tokens + sliding_layers * (sliding_tokens or 0))
    total = per_sequence * sequences
    if a.mla is not None or tp <= 1:
        per_gpu = total
    else:
        heads_per_gpu = max(1, a.kv_heads // tp)
        per_gpu = -(-total * heads_per_gpu // a.kv_heads)
    return KvCache(
        bytes_per_token=per_layer * a.layers,
        total_bytes=total,
        per_gpu_bytes=per_gpu,
        tokens_per_sequence=tokens,
        sliding_tokens_per_sequence=sliding_tokens,
    )
