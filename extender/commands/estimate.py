"""`vramsched estimate`: how much VRAM a model needs per GPU, and the annotation that reserves it."""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from extender.commands.argtypes import whole
from extender.quantity import format_bytes
from extender.sizing.architecture import MAX_FIELD
from extender.sizing.engine_args import human_readable_int
from extender.sizing.engines import ENGINES, EngineSettings
from extender.sizing.errors import SizingError
from extender.sizing.estimate import MAX_COUNT, DeviceFit, Estimate, estimate, resolve_model
from extender.sizing.quant import DTYPES, QUANTIZATIONS

__all__ = ["register", "run", "render_text"]

POSITIVE = whole(at_least=1)
COUNT = whole(at_least=1, at_most=MAX_COUNT)
#: vLLM's --kv-cache-memory-bytes, spelled as vLLM reads it
KV_BYTES = whole(
    at_least=1, at_most=MAX_FIELD, read=human_readable_int, spelled="17179869184, 16G or 16g"
)
#: token counts as vLLM spells them too (`32k`, `32K`), so a value copied from its flags works
TOKENS = whole(at_least=1, at_most=MAX_COUNT, read=human_readable_int, spelled="32768, 32k or 32K")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="VRAM a model needs per GPU for an engine, and the annotation to reserve it",
        description="Estimate weights + KV cache + engine overhead per GPU (docs/sizing.md).",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="a catalogue name (e.g. Qwen/Qwen2.5-7B-Instruct, gpt-oss-20b) or a local model "
        "directory / config.json",
    )
    p.add_argument(
        "--engine", choices=ENGINES, default="vllm", help="serving engine (default vllm)"
    )
    p.add_argument(
        "--dtype", choices=DTYPES, default=None, help="weight dtype (default: the checkpoint's)"
    )
    p.add_argument(
        "--quantization", choices=QUANTIZATIONS, default=None, help="weight quantization"
    )
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument(
        "--max-model-len",
        type=TOKENS,
        default=None,
        help="context (default: the model's); 32k is 32,000 tokens and 32K 32,768, as in vLLM",
    )
    p.add_argument(
        "--max-num-seqs",
        type=COUNT,
        default=None,
        help="concurrent sequences, each held at full length in the KV cache (default 1)",
    )
    p.add_argument("--max-num-batched-tokens", type=TOKENS, default=None)
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=KV_BYTES,
        default=None,
        help="vLLM's KV cache per GPU, in place of the sequences' (16G is 16 GiB, 16g 16e9)",
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=POSITIVE, default=1)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--gpu", metavar="PRODUCT", help="size for this GPU and print its engine flag")
    p.add_argument("-o", "--output", choices=("text", "json", "yaml"), default="text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    settings = EngineSettings(
        engine=args.engine,
        model=args.model,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_num_batched_tokens,
        kv_cache_bytes=args.kv_cache_memory_bytes,
        tp=args.tensor_parallel_size,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.enforce_eager,
    )
    try:
        result = estimate(resolve_model(args.model), settings, gpu=args.gpu)
    except SizingError as exc:
        print(f"vramsched estimate: error: {exc}", file=sys.stderr)
        return 2
    if args.output == "json":
        text = json.dumps(result.to_dict(), indent=2) + "\n"
    elif args.output == "yaml":
        text = yaml.safe_dump(result.to_dict(), sort_keys=False)
    else:
        text = render_text(result) + "\n"
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `vramsched estimate ... | head`: the reader left, not an error
        sys.stderr.close()
        return 0
    problem = _fits_nowhere(result)
    if problem:
        print(f"vramsched estimate: error: {problem}", file=sys.stderr)
        return 2
    return 0


def _fits_nowhere(e: Estimate) -> str | None:
    """The estimate is printed either way; a model that fits no GPU is still an error (exit 2)."""
    need = format_bytes(e.reservation_per_gpu)
    fit = e.gpu_fit()
    if e.gpu is not None and fit is not None and not fit.fits:
        return (
            f"{e.model.name} needs {need} per GPU; {e.gpu.product} has {format_bytes(e.gpu.memory_bytes)}: "
            "raise --tensor-parallel-size or quantize"
        )
    if e.gpu is None and e.devices and not any(d.fits for d in e.devices):
        return f"{e.model.name} needs {need} per GPU, more than any GPU vramsched knows: raise --tensor-parallel-size or quantize"
    return None


def _gib(n: int) -> str:
    return format_bytes(n)


def render_text(e: Estimate) -> str:
    s = e.settings
    a = e.model.architecture
    seqs = f"{e.sequences} sequence{'s' if e.sequences != 1 else ''}"
    per_gpu = " per GPU" if s.tp > 1 else ""
    lines = [
        f"{e.model.name}  ({e.model.source})",
        f"  {e.parameters / 1e9:.2f}B parameters, checkpoint {e.checkpoint_bytes:,} bytes; "
        f"{s.engine}, {e.weight_format} weights, KV {s.kv_cache_dtype or 'auto'}, "
        f"context {e.context} x {seqs}, tensor parallel {s.tp}",
        f"  weights{per_gpu:<9} {_gib(e.weights_per_gpu):>9}",
        f"  KV cache{per_gpu:<8} {_gib(e.kv.per_gpu_bytes):>9}   "
        f"({e.kv.bytes_per_token:,} bytes per token over {a.layers} layers)",
        f"  overhead{per_gpu:<8} {_gib(e.overhead.total):>9}   ({e.overhead.detail})",
        f"  total per GPU    {_gib(e.total_per_gpu):>9}",
        "",
        f"  {e.annotation}",
    ]
    if e.gpu is not None:
        fit = e.gpu_fit()
        assert fit is not None
        if fit.fits:
            lines.append(f"  on {e.gpu.product}: {e.flag} {fit.fraction:.2f}")
        else:
            lines.append(f"  does not fit one {e.gpu.product} ({_gib(e.gpu.memory_bytes)})")
    whole = [d for d in e.devices if d.fits and not d.device.profile and e.gpu is None]
    # The smallest MIG profile that fits, per GPU model: bigger ones fit too.
    smallest: dict[str, DeviceFit] = {}
    for d in e.devices:
        if d.fits and d.device.profile:
            best = smallest.get(d.device.product)
            if best is None or d.device.memory_bytes < best.device.memory_bytes:
                smallest[d.device.product] = d
    if whole:
        lines.append(
            f"  fits ({e.flag}): " + ", ".join(f"{d.device.name} {d.fraction:.2f}" for d in whole)
        )
    if smallest:
        lines.append(
            "  smallest MIG slice that fits: "
            + ", ".join(
                f"{d.device.product} {d.device.profile} {d.fraction:.2f}" for d in smallest.values()
            )
        )
    if not whole and not smallest and e.gpu is None:
        lines.append("  fits no single GPU vramsched knows")
    for note in e.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
