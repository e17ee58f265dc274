"""Bytes per tensor under each weight format (pure).

Formats, as the checkpoints store them and vLLM/SGLang/TGI keep them on the GPU:

* 16-bit (bf16/fp16): 2 bytes a parameter; float32 checkpoints (Gemma 2 2B) take 4 on disk
  and are served in 16 bits.
* AWQ (AutoAWQ GEMM): per projection `[out, in]` a packed `qweight` of in*out*bits/8 bytes,
  `qzeros` of (in/g)*out*bits/8 and fp16 `scales` of (in/g)*out*2, g = group_size.
* GPTQ: the same three plus `g_idx`, one int32 per input row (on the GPU only with act-order).
* FP8 (`--quantization fp8`, compressed-tensors FP8): one byte a weight plus a float32 scale
  per output channel; DeepSeek's block FP8 keeps a float32 scale per 128x128 block instead.
* MXFP4 (gpt-oss experts): 4 bits a weight plus one 8-bit scale per 32 weights.
* int8 (W8A8): one byte a weight plus a float32 scale per output channel.

Embeddings, the LM head, norms, biases and routers stay 16-bit in every format.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from extender.sizing.architecture import is_whole
from extender.sizing.errors import SizingError
from extender.sizing.tensors import EXPERT, FP32, KV, LINEAR, REPLICATE, Tensor

__all__ = [
    "WeightFormat",
    "NONE",
    "checkpoint_format",
    "runtime_format",
    "tensor_bytes",
    "total_bytes",
    "per_gpu_bytes",
    "QUANTIZATIONS",
    "DTYPES",
]

QUANTIZATIONS = ("none", "awq", "gptq", "fp8")
DTYPES = ("bf16", "fp16", "fp8", "int8")


@dataclass(frozen=True, slots=True)
class WeightFormat:
    method: str = "none"  # none, awq, gptq, fp8, fp8-block, int8, mxfp4, int4, nf4
    bits: int = 16
    group_size: int = 128
    zero_point: bool = True
    g_idx: bool = False  # bytes include GPTQ's g_idx (always in the files)
    act_order: bool = False  # GPTQ desc_act: the engine keeps g_idx on the GPU too
    block: tuple[int, int] = (128, 128)
    base_bytes: int = 2  # bytes per parameter of everything left unquantised
    experts_only: bool = False  # MXFP4 in gpt-oss: attention stays 16-bit
    pad_to: int = 0  # vLLM pads MXFP4 expert hidden dims to a multiple of this on the GPU

    def describe(self) -> str:
        if self.method == "none":
            return "float32" if self.base_bytes == 4 else "16-bit"
        if self.method in ("awq", "gptq", "int4"):
            return f"{self.method} {self.bits}-bit, group {self.group_size}"
        return self.method


NONE = WeightFormat()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _base_bytes(dtype: str) -> int:
    return 4 if str(dtype).lower() in ("float32", "fp32", "float") else 2


def _whole(
    quant: Mapping[str, Any], keys: tuple[str, ...], default: int, low: int, high: int
) -> int:
    """The first of `keys` present in a quantization config, as a whole number in [low, high]."""
    key = next((k for k in keys if k in quant), keys[0])
    return _whole_value(key, quant.get(key, default), low, high)


def _whole_value(key: str, value: Any, low: int, high: int) -> int:
    if not is_whole(value) or not low <= value <= high:
        raise SizingError(
            f"quantization_config {key}={value!r} in config.json is not a whole number "
            f"from {low} to {high}"
        )
    return int(value)


#: bits per quantized weight the formats use (1 to 16; NF4 4, AWQ/GPTQ 2-8, FP8 8)
BITS = (1, 16)
#: group sizes: <= 0 is one group per row (GPTQ writes -1), so only the upper end is bounded
GROUP = (-1, 1 << 20)


def checkpoint_format(quant: Mapping[str, Any], dtype: str) -> WeightFormat:
    """The format of the files, from config.json's quantization_config and torch_dtype."""
    base = _base_bytes(dtype)
    if not quant:
        return WeightFormat(base_bytes=base)
    method = str(quant.get("quant_method") or quant.get("quant_type") or "").lower()
    if method == "awq":
        return WeightFormat(
            "awq",
            _whole(quant, ("bits", "w_bit"), 4, *BITS),
            _whole(quant, ("group_size", "q_group_size"), 128, *GROUP),
            bool(quant.get("zero_point", True)),
            base_bytes=2,
        )
    if method == "gptq":
        return WeightFormat(
            "gptq",
            _whole(quant, ("bits",), 4, *BITS),
            _whole(quant, ("group_size",), 128, *GROUP),
            True,
            g_idx=True,
            act_order=bool(quant.get("desc_act", False)),
            base_bytes=2,
        )
    if method == "fp8":
        block = quant.get("weight_block_size")
        if block:
            if not isinstance(block, list | tuple) or len(block) != 2:
                raise SizingError(
                    f"quantization_config weight_block_size={block!r} in config.json is not "
                    "[rows, columns]"
                )
            rows, cols = (_whole_value("weight_block_size", b, 1, 1 << 20) for b in block)
            return WeightFormat("fp8-block", 8, block=(rows, cols), base_bytes=2)
        return WeightFormat("fp8", 8, base_bytes=2)
    if method == "mxfp4":
        return WeightFormat("mxfp4", 4, 32, experts_only=True, base_bytes=2)
    if method == "bitsandbytes":
        if quant.get("load_in_8bit"):
            return WeightFormat("int8", 8, base_bytes=2)
        return WeightFormat("nf4", 4, 64, base_bytes=2)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    raise SizingError(
        f"quantization method {method or '(empty)'!r} in config.json is not one the estimator knows"
    )


def _compressed_tensors(quant: Mapping[str, Any]) -> WeightFormat:
    groups = quant.get("config_groups") or {}
    for group in groups.values() if isinstance(groups, Mapping) else []:
        weights = (group if isinstance(group, Mapping) else {}).get("weights") or {}
        if not isinstance(weights, Mapping):
            raise SizingError(f"compressed-tensors weights={weights!r} is not an object")
        bits = _whole(weights, ("num_bits",), 8, *BITS)
        if weights.get("type") == "float" and bits == 8:
            return WeightFormat("fp8", 8, base_bytes=2)
        if bits == 8:
            return WeightFormat("int8", 8, base_bytes=2)
        return WeightFormat(
            "int4",
            bits,
            _whole_value("group_size", weights.get("group_size") or 128, *GROUP),
            not bool(weights.get("symmetric", True)),
            base_bytes=2,
        )
    raise SizingError("compressed-tensors quantization_config has no config_groups")


def runtime_format(
    stored: WeightFormat, *, quantization: str | None, dtype: str | None, hidden: int
) -> tuple[WeightFormat, str | None]:
    """What the engine keeps on the GPU, and a note when the estimate assumes a conversion.

    A quantised checkpoint is served as stored; `quantization` must then name its method (or
    be none/auto). On a 16-bit checkpoint, `--quantization fp8` and `--dtype fp8|int8` quantise
    the projections online; `--quantization awq|gptq` estimates a 4-bit group-128 checkpoint of
    the same model.
    """
    q = (quantization or "none").lower()
    if q in ("auto", ""):
        q = "none"
    if stored.method != "none":
        family = {"fp8-block": "fp8", "int4": "gptq", "nf4": "bitsandbytes"}.get(
            stored.method, stored.method
        )
        if q not in ("none", family, stored.method) and not (q == "fp8" and family == "fp8"):
            raise SizingError(
                f"the checkpoint is quantized with {stored.method}; --quantization {q} does not apply to it"
            )
        if dtype in ("fp8", "int8") and not (dtype == "fp8" and family == "fp8"):
            raise SizingError(
                f"the checkpoint is quantized with {stored.method}; --dtype {dtype} does not apply "
                "to it (its weights are served as stored: leave --dtype out, or bf16/fp16)"
            )
        if stored.method == "mxfp4":
            pad = 256 if hidden % 256 else 0
            return WeightFormat("mxfp4", 4, 32, experts_only=True, pad_to=pad), None
        fmt = WeightFormat(
            stored.method,
            stored.bits,
            stored.group_size,
            stored.zero_point,
            g_idx=stored.act_order,
            act_order=stored.act_order,
            block=stored.block,
        )
        return fmt, None
    if q == "none":
        if dtype in ("fp8", "int8"):
            return WeightFormat(
                "fp8" if dtype == "fp8" else "int8", 8
            ), f"weights quantised to {dtype} at load"
        return WeightFormat(), None
    if dtype in ("fp8", "int8") and not (q == "fp8" and dtype == "fp8"):
        raise SizingError(
            f"--dtype {dtype} and --quantization {q} both say how the weights are quantised: "
            "give one"
        )
    if q == "fp8":
        return WeightFormat("fp8", 8), "weights quantised to fp8 at load (--quantization fp8)"
    if q in ("awq", "gptq"):
        return (
            WeightFormat(q, 4, 128, True),
            f"as a 4-bit group-128 {q.upper()} checkpoint of this model",
        )
    raise SizingError(f"--quantization {q!r} is not one of {', '.join(QUANTIZATIONS)}")


def tensor_bytes(t: Tensor, fmt: WeightFormat) -> int:
    """Bytes of all `t.count` copies of `t` in format `fmt`."""
    if t.role == FP32:
        return t.params * 4
    quantised = t.role == EXPERT or (t.role == LINEAR and not fmt.experts_only)
    if fmt.method == "none" or not quantised or len(t.shape) != 2:
        return t.params * fmt.base_bytes
    out, inp = t.shape
    n = t.count
    m = fmt.method
    if m in ("awq", "gptq", "int4"):
        groups = _ceil_div(inp, fmt.group_size if fmt.group_size > 0 else inp)
        packed = inp * out * fmt.bits // 8
        scales = groups * out * 2
        zeros = groups * out * fmt.bits // 8 if fmt.zero_point else 0
        g_idx = inp * 4 if fmt.g_idx else 0
        return n * (packed + scales + zeros + g_idx)
    if m == "fp8" or m == "int8":
        return n * (out * inp + out * 4)
    if m == "fp8-block":
        b0, b1 = fmt.block
        return n * (out * inp + _ceil_div(out, b0) * _ceil_div(inp, b1) * 4)
    if m == "mxfp4":
        # vLLM's MXFP4 MoE kernels pad one dimension of each expert to a multiple of 256
        # (gpt-oss-20b: 13.47 GiB loaded against 12.82 GiB of files).
        size = out * (_ceil_div(inp, fmt.pad_to) * fmt.pad_to if fmt.pad_to else inp)
        return n * (size // 2 + size // 32)
    if m == "nf4":
        size = out * inp
        return n * (size // 2 + _ceil_div(size, 64) * 4)
    raise SizingError(f"weight format {m!r} is unknown")


def total_bytes(tensors: Iterable[Tensor], fmt: WeightFormat) -> int:
    return sum(tensor_bytes(t, fmt) for t in tensors)


def _share(t: Tensor, tp: int, kv_heads: int) -> tuple[int, int]:
    """(numerator, denominator) of the part of `t` one of `tp` GPUs holds."""
    if tp <= 1 or t.split == REPLICATE:
        return 1, 1
    if t.split == KV and tp > kv_heads:
        return 1, kv_heads  # one whole KV head per GPU
    return 1, tp


def per_gpu_bytes(tensors: Iterable[Tensor], fmt: WeightFormat, tp: int, kv_heads: int) -> int:
    """Bytes on each GPU under tensor parallelism (rounded up: no GPU gets less)."""
    total = 0
    for t in tensors:
        num, den = _share(t, tp, kv_heads)
        total += _ceil_div(tensor_bytes(t, fmt) * num, den)
    return total
