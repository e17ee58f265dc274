"""What each serving engine takes besides weights and KV cache, and what its fraction flag
covers (pure). Sources and the reasoning behind every constant: docs/sizing.md.

Each engine reads its memory flag differently, so each model says which part of its memory
the flag covers (`inside`) and which part it takes on top (`outside`):

* vLLM `--gpu-memory-utilization`: a per-instance budget, total GPU memory x fraction, that
  must hold weights + peak activations + KV cache (vllm/v1/worker/gpu_worker.py
  determine_available_memory; vllm/utils/mem_utils.py memory_profiling). The CUDA context and
  NCCL buffers (allocated before the baseline snapshot) and the CUDA graph pool (captured
  after the KV cache is sized; from v0.21.0 only with VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0,
  which the hand-off sets: `ENGINE_ENV`) are outside it.
* TGI `--cuda-memory-fraction`: caps torch at fraction x total and sizes the KV cache so that
  (1 - 0.9 x fraction) of the device stays free (server/.../utils/import_utils.py
  get_cuda_free_memory; TGI_WIGGLE_ROOM=0.90 in models/globals.py): everything of TGI's is
  inside, and 10% of it is left over.
* SGLang `--mem-fraction-static`: weights + KV pool = fraction x the memory free at start;
  the rest is left for activations and CUDA graphs, which SGLang sizes with its own formula
  (python/sglang/srt/server_args.py _handle_gpu_memory_settings). Those and the CUDA context
  are outside.

The fraction handed to an engine is therefore (reservation - outside) / device memory,
rounded down to 0.01, so that what the engine takes in all stays within the reservation.
"""

from __future__ import annotations

from dataclasses import dataclass

from extender.sizing.architecture import Architecture

__all__ = [
    "ENGINES",
    "ENGINE_ENV",
    "FLAGS",
    "EngineSettings",
    "Overhead",
    "overhead",
    "outside",
    "fraction",
    "windowed_kv",
    "kv_sequences",
]

MIB = 1 << 20
GIB = 1 << 30
ENGINES = ("vllm", "tgi", "sglang")
FLAGS = {
    "vllm": "--gpu-memory-utilization",
    "tgi": "--cuda-memory-fraction",
    "sglang": "--mem-fraction-static",
}

# CUDA context + cuBLAS workspace (+ NCCL and custom all-reduce buffers with tensor parallelism):
# 79.18 GiB H100, 78.57 GiB free at vLLM start-up with TP=1 (0.61 GiB), 77.64 GiB with TP=2
# (1.54 GiB) in llm-d's measurements; rounded up.
CONTEXT_BYTES = 768 * MIB
CONTEXT_BYTES_TP = 1792 * MIB
# vLLM's CUDA graph pool: -0.45 .. +1.03 GiB measured (gpt-oss-120b the largest); rounded up.
VLLM_GRAPH_BYTES = 1 * GIB
#: From v0.21.0 vLLM estimates its CUDA graph pool before sizing the KV cache and takes it out of
#: the `--gpu-memory-utilization` budget (gpu_worker.py, "CUDA graph memory profiling is enabled
#: (default since v0.21.0)"); with this variable at 0 it captures the graphs after, outside the
#: budget, as every earlier version does. The fraction above counts the pool outside, so vLLM
#: runs with the variable at 0 (`ENGINE_ENV`); left at its default, the KV cache would come out
#: smaller by vLLM's estimate of the pool than the estimate sized it.
VLLM_GRAPH_PROFILER_ENV = "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"
#: environment an engine needs, beside its fraction flag, to take what the estimate counts
ENGINE_ENV: dict[str, dict[str, str]] = {"vllm": {VLLM_GRAPH_PROFILER_ENV: "0"}}
# vLLM's profiled peak is the sampler on max_num_seqs rows of logits: 38.5-39.9 bytes per
# (sequence x vocabulary entry) in those measurements (Llama-3.1-8B 4.76 GiB, Qwen3-0.6B and
# Qwen3-32B 5.56/5.64 GiB, gpt-oss-20b 7.38 GiB, all at 1024 sequences); 40 is used.
VLLM_SAMPLER_BYTES = 40
# vLLM's non-torch memory growth during profiling: 0.13 GiB at TP=1, 0.55 GiB at TP=2.
VLLM_NON_TORCH = 256 * MIB
VLLM_NON_TORCH_TP = 768 * MIB
TGI_WIGGLE = 0.90
TGI_GRAPH_BYTES = 512 * MIB
TGI_MIN_PREFILL = 4096
TGI_MAX_DEFAULT_PREFILL = 16384
#: SGLang's `--max-prefill-tokens` default: its reserve's activation term when chunked prefill is
#: off (`--chunked-prefill-size -1`; server_args.py `_handle_gpu_memory_settings`)
SGLANG_MAX_PREFILL_TOKENS = 16384


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The memory-relevant flags of one engine invocation (None: the engine's default)."""

    engine: str = "vllm"
    model: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_batched_tokens: int | None = None
    kv_tokens: int | None = None  # TGI --max-batch-total-tokens, SGLang --max-total-tokens
    kv_cache_bytes: int | None = None  # vLLM --kv-cache-memory-bytes: the KV cache per GPU
    tp: int = 1
    pp: int = 1  # pipeline stages: not estimated (the webhook leaves such pods unfilled)
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    enforce_eager: bool = False
    cuda_graph_max_bs: int | None = None


@dataclass(frozen=True, slots=True)
class Overhead:
    """Per-GPU memory besides weights and KV cache. `inside` is covered by the engine's fraction
    flag, `outside` is not; `wiggle` is the share of the fraction the engine actually uses."""

    inside: int
    outside: int
    wiggle: float = 1.0
    detail: str = ""

    @property
    def total(self) -> int:
        return self.inside + self.outside


def _forward_bytes_per_token(a: Architecture, tp: int) -> int:
    """Live activations of one token in a forward pass (16-bit): residual stream, attention
    projections and the widest MLP intermediate (gate and up together)."""
    width = a.intermediate
    if a.moe is not None:
        routed = a.moe.expert_intermediate * max(1, a.moe.top_k)
        width = max(
            width,
            routed + a.moe.expert_intermediate * a.moe.shared_experts + a.moe.shared_intermediate,
        )
    q = a.heads * a.head_dim
    kv = 2 * a.kv_heads * a.head_dim
    return 2 * (4 * a.hidden + (3 * width + q + kv) // max(1, tp))


def _vllm_defaults(gpu_memory: int | None, product: str) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) vLLM picks for its OpenAI server
    (vllm/engine/arg_utils.py get_batch_defaults): 1024/8192 on GPUs of 70 GiB and more that
    are not A100s, else 256/2048. An unknown GPU gets the larger pair."""
    if gpu_memory is None:
        return 1024, 8192
    if gpu_memory >= 70 * GIB and "A100" not in product.upper():
        return 1024, 8192
    return 256, 2048


def _sglang_defaults(gpu_memory: int | None, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, cuda_graph_max_bs) by SGLang's GPU memory bands."""
    if gpu_memory is None:
        return 8192, 256 if tp < 4 else 512
    mib = gpu_memory // MIB
    if mib < 20 * 1024:
        return 2048, 8
    if mib < 35 * 1024:
        return 2048, 24 if tp < 4 else 80
    if mib < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if mib < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def _sglang_chunking_off(s: EngineSettings) -> bool:
    """`--chunked-prefill-size -1` (SGLang: any size not above 0) turns chunked prefill off; its
    reserve then covers a whole prefill batch of `--max-prefill-tokens`."""
    return s.max_batched_tokens is not None and s.max_batched_tokens <= 0


def _sglang_reserve(s: EngineSettings, gpu_memory: int | None) -> tuple[int, int, int]:
    """SGLang's own estimate of activations + CUDA graphs (MiB in its code), with the chunk and
    graph batch it assumed."""
    tp = max(1, s.tp)
    chunk, graph_bs = _sglang_defaults(gpu_memory, tp)
    if _sglang_chunking_off(s):
        chunk = SGLANG_MAX_PREFILL_TOKENS
    else:
        chunk = s.max_batched_tokens or chunk
    graph_bs = s.cuda_graph_max_bs or graph_bs
    reserve_mib = (
        512 + max(chunk, 2048) * 1.5 + (0 if s.enforce_eager else graph_bs * 2) + tp / 8 * 1024
    )
    return int(reserve_mib * MIB), chunk, graph_bs


def outside(s: EngineSettings, gpu_memory: int | None = None) -> int:
    """The part of the engine's memory its fraction flag does not cover (needs no model)."""
    context = CONTEXT_BYTES if max(1, s.tp) == 1 else CONTEXT_BYTES_TP
    if s.engine == "vllm":
        return context + (0 if s.enforce_eager else VLLM_GRAPH_BYTES)
    if s.engine == "sglang":
        return context + _sglang_reserve(s, gpu_memory)[0]
    return 0


def overhead(
    a: Architecture, s: EngineSettings, gpu_memory: int | None = None, product: str = ""
) -> Overhead:
    """The engine's per-GPU memory besides weights and KV cache, split by what its flag covers."""
    tp = max(1, s.tp)
    context = CONTEXT_BYTES if tp == 1 else CONTEXT_BYTES_TP
    fwd = _forward_bytes_per_token(a, tp)
    if s.engine == "vllm":
        seqs, tokens = _vllm_defaults(gpu_memory, product)
        seqs = s.max_num_seqs or seqs
        tokens = s.max_batched_tokens or tokens
        sampler = seqs * a.vocab * VLLM_SAMPLER_BYTES
        activations = max(sampler, tokens * fwd) + (
            VLLM_NON_TORCH if tp == 1 else VLLM_NON_TORCH_TP
        )
        return Overhead(
            activations,
            outside(s, gpu_memory),
            detail=f"activations for {seqs} sequences / {tokens} batched tokens, CUDA context"
            + ("" if s.enforce_eager else ", CUDA graphs"),
        )
    if s.engine == "tgi":
        # TGI's launcher defaults the prefill batch to what the GPU computes fastest (at least
        # 4096 tokens, at most the context); without the flag, up to 16384 tokens are assumed.
        default = max(
            TGI_MIN_PREFILL, min(s.max_model_len or a.max_context, TGI_MAX_DEFAULT_PREFILL)
        )
        prefill = s.max_batched_tokens or default
        inside = context + prefill * fwd + TGI_GRAPH_BYTES
        return Overhead(
            inside,
            0,
            TGI_WIGGLE,
            detail=f"CUDA context, {prefill} prefill tokens, CUDA graphs, 10% kept free",
        )
    if s.engine == "sglang":
        _, chunk, graph_bs = _sglang_reserve(s, gpu_memory)
        return Overhead(
            0,
            outside(s, gpu_memory),
            detail=f"CUDA context, SGLang's reserve for {chunk}-token prefill "
            + ("batches (chunked prefill off)" if _sglang_chunking_off(s) else "chunks")
            + ("" if s.enforce_eager else f" and CUDA graphs up to batch {graph_bs}"),
        )
    raise ValueError(f"unknown engine {s.engine!r}")


def windowed_kv(engine: str) -> bool:
    """Whether the engine frees KV outside a sliding window (vLLM, SGLang) or keeps it (TGI)."""
    return engine in ("vllm", "sglang")


def kv_sequences(s: EngineSettings) -> int:
    """Sequences the KV cache must hold at full length: the engine's concurrency cap when the
    pod sets one, else one (what every engine needs to start with that context)."""
    return max(1, s.max_num_seqs or 1)


def fraction(reservation_per_gpu: int, device_memory: int, o: Overhead) -> float:
    """The engine flag for a device: the part of the reservation the flag covers, as a fraction
    of the device's memory, rounded down to 0.01 (never above 1)."""
    if device_memory <= 0:
        return 0.0
    covered = max(0, reservation_per_gpu - o.outside)
    hundredths = covered * 100 // device_memory
    return min(100, hundredths) / 100
