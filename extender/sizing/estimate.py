"""The estimate: weights + KV cache + engine overhead per GPU, and the annotation to reserve it.

Pure apart from `resolve_model`, which reads a local model directory when MODEL is a path.
Every input error is a SizingError with one line naming the bad value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from extender.demand import MODEL_MEMORY
from extender.quantity import GIB, MIB
from extender.sizing import catalogue
from extender.sizing.architecture import MAX_FIELD, Architecture, architecture_from_config
from extender.sizing.checkpoint import looks_local, read_model
from extender.sizing.engine_args import flag_names
from extender.sizing.engines import (
    ENGINES,
    FLAGS,
    VLLM_GRAPH_PROFILER_ENV,
    EngineSettings,
    Overhead,
    fraction,
    kv_sequences,
    overhead,
    windowed_kv,
)
from extender.sizing.errors import SizingError
from extender.sizing.gpus import Device, GpuModel, devices, find_gpu
from extender.sizing.kv import KvCache, kv_cache
from extender.sizing.quant import (
    checkpoint_format,
    per_gpu_bytes,
    runtime_format,
    total_bytes,
)
from extender.sizing.tensors import inventory

__all__ = [
    "Model",
    "Estimate",
    "DeviceFit",
    "resolve_model",
    "estimate",
    "format_quantity",
    "ROUND_BYTES",
    "SMALL_GPU",
    "MAX_COUNT",
]

#: The reservation is rounded up to whole quarters of a GiB per GPU.
ROUND_BYTES = 256 * MIB
#: A device size that selects the engines' small-GPU defaults (vLLM 256 sequences, SGLang's
#: smallest band): the optimistic end, for "the declared memory is surely too low" warnings.
SMALL_GPU = 16 * GIB
MAX_TP = 64
#: The most sequences or batched tokens an estimate takes: int32's largest, which no engine
#: setting comes near; beyond it a figure is a typo, and its KV cache would not even fit a float.
MAX_COUNT = 2**31 - 1
_QUARTERS = ("", ".25", ".5", ".75")
_KV_BYTES = {"auto": 2, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2}
_DTYPES = {"auto", "bf16", "bfloat16", "fp16", "float16", "half", "fp8", "int8"}


@dataclass(frozen=True, slots=True)
class Model:
    """A resolved model: its architecture and what is known of its files."""

    name: str
    architecture: Architecture
    checkpoint_bytes: int | None
    source: str
    lm_head_stored: bool = False
    file_tensors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DeviceFit:
    device: Device
    fits: bool
    fraction: float  # the engine flag on this device


@dataclass(frozen=True, slots=True)
class Estimate:
    model: Model
    settings: EngineSettings
    context: int
    sequences: int
    parameters: int
    checkpoint_bytes: int
    weight_format: str
    weights_bytes: int
    weights_per_gpu: int
    kv: KvCache
    overhead: Overhead
    total_per_gpu: int
    reservation_per_gpu: int  # total_per_gpu rounded up to ROUND_BYTES
    notes: tuple[str, ...]
    gpu: GpuModel | None = None
    devices: tuple[DeviceFit, ...] = ()

    @property
    def model_memory(self) -> str:
        """The vramsched.io/model-memory value: the reservation on all tp GPUs together."""
        return format_quantity(self.reservation_per_gpu * max(1, self.settings.tp))

    @property
    def annotation(self) -> str:
        return f"{MODEL_MEMORY}: {self.model_memory}"

    @property
    def flag(self) -> str:
        return FLAGS[self.settings.engine]

    def gpu_fit(self) -> DeviceFit | None:
        return self.devices[0] if self.gpu is not None and self.devices else None

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        out: dict[str, Any] = {
            "model": self.model.name,
            "source": self.model.source,
            "engine": s.engine,
            "settings": {
                "dtype": s.dtype or "auto",
                "quantization": s.quantization or "none",
                "kvCacheDtype": s.kv_cache_dtype or "auto",
                "maxModelLen": self.context,
                "maxNumSeqs": self.sequences,
                "tensorParallelSize": s.tp,
            },
            "parameters": self.parameters,
            "checkpointBytes": self.checkpoint_bytes,
            "weightFormat": self.weight_format,
            "weightsBytes": self.weights_bytes,
            "kvBytesPerToken": self.kv.bytes_per_token,
            "kvCacheBytes": self.kv.total_bytes,
            "overheadBytes": self.overhead.total,
            "perGpu": {
                "weightsBytes": self.weights_per_gpu,
                "kvCacheBytes": self.kv.per_gpu_bytes,
                "overheadBytes": self.overhead.total,
                "outsideFlagBytes": self.overhead.outside,
            },
            "totalBytesPerGpu": self.total_per_gpu,
            "modelMemory": self.model_memory,
            "annotation": self.annotation,
            "fits": [
                {
                    "device": d.device.name,
                    "memoryBytes": d.device.memory_bytes,
                    "flag": f"{self.flag} {d.fraction:.2f}",
                }
                for d in self.devices
                if d.fits
            ],
            "notes": list(self.notes),
        }
        fit = self.gpu_fit()
        if fit is not None and self.gpu is not None:
            out["gpu"] = {
                "product": self.gpu.product,
                "memoryBytes": self.gpu.memory_bytes,
                "fits": fit.fits,
                "fraction": fit.fraction,
                "flag": f"{self.flag} {fit.fraction:.2f}",
            }
        return out


def format_quantity(n: int) -> str:
    """Bytes as a Kubernetes quantity in Gi, rounded up to a quarter: `22.5Gi`, `8Gi`.

    Written digit by digit, not through a float, so that a size of any magnitude stays exact and
    a quantity Kubernetes reads (a float's `1e+06Gi` is neither)."""
    quarters = -(-n // ROUND_BYTES)
    whole, rest = divmod(quarters, 4)
    return f"{whole}{_QUARTERS[rest]}Gi"


def resolve_model(name: str) -> Model:
    """A catalogue name, or a local model directory / config.json path."""
    if not name or not name.strip():
        raise SizingError("no model given")
    if looks_local(name) and not catalogue.is_known(name):
        local = read_model(name)
        arch = architecture_from_config(local.config)
        return Model(
            str(local.path),
            arch,
            local.checkpoint_bytes,
            f"{local.path} ({local.source})",
            file_tensors=local.tensor_bytes,
        )
    entry = catalogue.lookup(name)
    source = "vramsched catalogue" + (
        "" if entry.checkpoint_bytes else " (architecture only: no published checkpoint size)"
    )
    return Model(
        entry.name, entry.architecture, entry.checkpoint_bytes, source, entry.lm_head_stored
    )


#: how the estimate's messages name each setting: `vramsched estimate`'s flags, which are
#: vLLM's, and SGLang's for the two settings vLLM has no flag for (its token pool, graph batch)
CLI_NAMES = {**flag_names("sglang"), **flag_names("vllm")}


def _flag_name(setting: str, names: Mapping[str, str] | None) -> str:
    """How a message names `setting`: as the user wrote it (`names`: an engine's own flag in
    the webhook), else as `vramsched estimate` spells it."""
    return (names or {}).get(setting) or CLI_NAMES[setting]


def _check(
    s: EngineSettings, a: Architecture, name: str, names: Mapping[str, str] | None = None
) -> None:
    """Refuse settings no engine runs with, each named by `_flag_name`."""

    def named(setting: str) -> str:
        return _flag_name(setting, names)

    if s.engine not in ENGINES:
        raise SizingError(f"engine {s.engine!r} is not one of {', '.join(ENGINES)}")
    if not 1 <= s.tp <= MAX_TP:
        raise SizingError(f"{named('tp')} {s.tp} is not between 1 and {MAX_TP}")
    if a.heads % s.tp:
        raise SizingError(
            f"{named('tp')} {s.tp} does not divide the {a.heads} attention heads of {name}"
        )
    if s.dtype and s.dtype.lower() not in _DTYPES:
        raise SizingError(f"dtype {s.dtype!r} is not one of bf16, fp16, fp8, int8")
    if (
        s.kv_cache_dtype
        and s.kv_cache_dtype.lower() not in _KV_BYTES
        and not s.kv_cache_dtype.lower().startswith("fp8")
    ):
        raise SizingError(f"kv-cache-dtype {s.kv_cache_dtype!r} is not auto or fp8")
    for setting, value, least in (
        ("max_model_len", s.max_model_len, 1),
        ("max_num_seqs", s.max_num_seqs, 1),
        # SGLang's --chunked-prefill-size: -1 (any size not above 0) turns chunking off.
        ("max_batched_tokens", s.max_batched_tokens, None if s.engine == "sglang" else 1),
        ("kv_tokens", s.kv_tokens, 0),  # 0: the engine's default
        ("cuda_graph_max_bs", s.cuda_graph_max_bs, 0),
    ):
        if value is None or (least is None or value >= least) and value <= MAX_COUNT:
            continue
        wanted = (
            f"more than {MAX_COUNT:,}"
            if least is None
            else f"not between {least} and {MAX_COUNT:,}"
        )
        raise SizingError(f"{named(setting)} {value} is {wanted}")
    if s.kv_cache_bytes is not None and not 1 <= s.kv_cache_bytes <= MAX_FIELD:
        raise SizingError(
            f"{named('kv_cache_bytes')} {s.kv_cache_bytes} is not between 1 and {MAX_FIELD:,}"
        )
    if s.max_model_len and s.max_model_len > a.max_context:
        raise SizingError(
            f"{named('max_model_len')} {s.max_model_len} is longer than the {a.max_context} "
            f"tokens {name} supports"
        )


def _weights(m: Model, s: EngineSettings) -> tuple[int, int, int, int, str, list[str]]:
    a = m.architecture
    stored = checkpoint_format(a.quantization, a.dtype)
    dtype = (s.dtype or "").lower() or None
    runtime, note = runtime_format(
        stored, quantization=s.quantization, dtype=dtype, hidden=a.hidden
    )
    notes = [note] if note else []
    tensors = inventory(a)
    weights = total_bytes(tensors, runtime)
    per_gpu = per_gpu_bytes(tensors, runtime, s.tp, a.kv_heads)
    files = inventory(a, checkpoint=True, lm_head_stored=m.lm_head_stored)
    derived = total_bytes(files, stored)
    checkpoint = m.checkpoint_bytes or derived
    params = sum(t.params for t in tensors)
    if m.checkpoint_bytes and abs(m.checkpoint_bytes - derived) > derived // 100:
        # The files disagree with the architecture (a custom model): trust the files.
        ratio = m.checkpoint_bytes / derived
        weights, per_gpu = int(weights * ratio) + 1, int(per_gpu * ratio) + 1
        notes.append(
            f"weights scaled to the checkpoint files ({m.checkpoint_bytes:,} bytes), which the "
            f"architecture count misses by {100 * (derived - m.checkpoint_bytes) / m.checkpoint_bytes:+.1f}%"
        )
    return params, checkpoint, weights, per_gpu, runtime.describe(), notes


def _kv_of_bytes(
    a: Architecture,
    s: EngineSettings,
    dtype_bytes: int,
    context: int,
    name: str,
    names: Mapping[str, str] | None,
) -> tuple[KvCache, int]:
    """vLLM's `--kv-cache-memory-bytes`: the KV cache per GPU is that, whatever the memory
    fraction says; and the full-length sequences it holds. vLLM refuses to start when it holds
    not even one (`check_enough_kv_cache_memory`), so the estimate does too."""
    one = kv_cache(
        a,
        dtype_bytes=dtype_bytes,
        context=context,
        sequences=1,
        tp=s.tp,
        windowed=windowed_kv(s.engine),
    )
    held = s.kv_cache_bytes or 0
    if held < one.per_gpu_bytes:
        raise SizingError(
            f"{_flag_name('kv_cache_bytes', names)} {held:,} holds less than one sequence of {context} tokens of {name} "
            f"({one.per_gpu_bytes:,} bytes per GPU); vLLM would not start"
        )
    sequences = held // one.per_gpu_bytes
    total = -(-one.total_bytes * held // one.per_gpu_bytes)
    return replace(one, total_bytes=total, per_gpu_bytes=held), sequences


def _total(weights_per_gpu: int, kv_per_gpu: int, o: Overhead) -> int:
    inside = weights_per_gpu + kv_per_gpu + o.inside
    return -(-int(inside * 1000) // int(o.wiggle * 1000)) + o.outside


def estimate(
    model: Model,
    settings: EngineSettings,
    *,
    gpu: str | None = None,
    gpu_memory: int | None = None,
    list_devices: bool = True,
    names: Mapping[str, str] | None = None,
) -> Estimate:
    """Per-GPU memory for serving `model` with `settings`. `gpu` (a product name) sizes the
    engine defaults for that GPU and yields its flag; `gpu_memory` alone only picks the
    defaults (SMALL_GPU: the optimistic end). `names`: how errors name the settings (`_check`)."""
    a = model.architecture
    s = settings
    _check(s, a, model.name, names)
    gpu_model = find_gpu(gpu) if gpu is not None else None
    memory = gpu_model.memory_bytes if gpu_model else gpu_memory
    product = gpu_model.product if gpu_model else ""
    params, checkpoint, weights, weights_gpu, fmt, notes = _weights(model, s)
    context = s.max_model_len or a.max_context
    kv_dtype = (s.kv_cache_dtype or "auto").lower()
    kv_bytes = _KV_BYTES.get(kv_dtype, 1)
    if s.kv_cache_bytes:
        kv, sequences = _kv_of_bytes(a, s, kv_bytes, context, model.name, names)
        notes.append(
            "vLLM sizes its KV cache by --kv-cache-memory-bytes and ignores "
            "--gpu-memory-utilization: the fractions below only say where the estimate fits"
        )
    elif s.kv_tokens:
        kv = kv_cache(
            a, dtype_bytes=kv_bytes, context=s.kv_tokens, sequences=1, tp=s.tp, windowed=False
        )
        sequences = max(1, s.kv_tokens // context)
    else:
        sequences = kv_sequences(s)
        kv = kv_cache(
            a,
            dtype_bytes=kv_bytes,
            context=context,
            sequences=sequences,
            tp=s.tp,
            windowed=windowed_kv(s.engine),
        )
    if kv.sliding_tokens_per_sequence is not None:
        notes.append(
            f"{a.sliding_layers} of {a.layers} layers keep only the {a.sliding_window}-token sliding window"
        )
    if a.mla is not None:
        notes.append("MLA: one compressed KV latent per token and layer, the same on every GPU")
    if a.moe is not None:
        notes.append(f"all {a.moe.experts} experts resident ({a.moe.top_k} active per token)")
    o = overhead(a, s, memory, product)
    if s.engine == "vllm" and not s.enforce_eager:
        notes.append(
            f"vLLM 0.21 and later: run it with {VLLM_GRAPH_PROFILER_ENV}=0 (the webhook sets "
            "it), or it counts its CUDA graphs inside the fraction and its KV cache comes out "
            "smaller than this"
        )
    if memory is None and s.engine == "vllm" and not s.max_num_seqs:
        notes.append(
            "vLLM's defaults for GPUs of 70 GiB and more assumed (1024 sequences, 8192 batched "
            "tokens); --gpu or --max-num-seqs size it for a smaller GPU"
        )
    total = _total(weights_gpu, kv.per_gpu_bytes, o)
    reservation = -(-total // ROUND_BYTES) * ROUND_BYTES
    fits: list[DeviceFit] = []
    if list_devices:
        for d in devices(gpu_model):
            # A device fits when the reservation does (that is what the scheduler checks); the
            # flag's share outside it follows the device (SGLang sizes its reserve by memory).
            od = overhead(a, s, d.memory_bytes, d.product)
            fits.append(
                DeviceFit(
                    d, reservation <= d.memory_bytes, fraction(reservation, d.memory_bytes, od)
                )
            )
    return Estimate(
        model=model,
        settings=replace(s, max_model_len=context),
        context=context,
        sequences=sequences,
        parameters=params,
        checkpoint_bytes=checkpoint,
        weight_format=fmt,
        weights_bytes=weights,
        weights_per_gpu=weights_gpu,
        kv=kv,
        overhead=o,
        total_per_gpu=total,
        reservation_per_gpu=reservation,
        notes=tuple(notes),
        gpu=gpu_model,
        devices=tuple(fits),
    )
