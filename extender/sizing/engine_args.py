"""Which serving engine a container runs and with which memory-relevant flags (pure).

Read from the container spec only: `command` + `args` (a `sh -c` script is split too), the
image name as a hint, and for TGI the environment variables its launcher also reads. Values
that Kubernetes would substitute (`$(VAR)`) are unknown here and ignored.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import orjson

from extender.sizing.engines import FLAGS, EngineSettings

__all__ = [
    "Invocation",
    "parse_container",
    "flag_names",
    "human_readable_int",
    "ENGINE_ANNOTATION_VALUES",
]

ENGINE_ANNOTATION_VALUES = ("vllm", "tgi", "sglang")

# flag -> EngineSettings field, per engine (every spelling the engine's CLI accepts).
_FLAGS: dict[str, dict[str, str]] = {
    "vllm": {
        "--model": "model",
        "--max-model-len": "max_model_len",
        "--max-num-seqs": "max_num_seqs",
        "--max-num-batched-tokens": "max_batched_tokens",
        "--tensor-parallel-size": "tp",
        "-tp": "tp",
        "--pipeline-parallel-size": "pp",
        "-pp": "pp",
        "--dtype": "dtype",
        "--quantization": "quantization",
        "-q": "quantization",
        "--kv-cache-dtype": "kv_cache_dtype",
        "--kv-cache-memory-bytes": "kv_cache_bytes",
    },
    "tgi": {
        "--model-id": "model",
        "--max-total-tokens": "max_model_len",
        "--max-batch-prefill-tokens": "max_batched_tokens",
        "--max-batch-total-tokens": "kv_tokens",
        "--num-shard": "tp",
        "--dtype": "dtype",
        "--quantize": "quantization",
        "--kv-cache-dtype": "kv_cache_dtype",
    },
    "sglang": {
        "--model-path": "model",
        "--model": "model",
        "--context-length": "max_model_len",
        "--max-running-requests": "max_num_seqs",
        "--chunked-prefill-size": "max_batched_tokens",
        "--max-total-tokens": "kv_tokens",
        "--tp-size": "tp",
        "--tp": "tp",
        "--tensor-parallel-size": "tp",
        "--pp-size": "pp",
        "--pipeline-parallel-size": "pp",
        "--dtype": "dtype",
        "--quantization": "quantization",
        "--kv-cache-dtype": "kv_cache_dtype",
        "--cuda-graph-max-bs": "cuda_graph_max_bs",
    },
}
_EAGER = {"vllm": "--enforce-eager", "sglang": "--disable-cuda-graph"}
#: flags that load more onto the GPU than the estimate counts (a draft model, LoRA slots, a KV
#: cache sized apart from the fraction): a pod using them is not sized, since an estimate
#: without them would be too small
_UNESTIMATED: dict[str, dict[str, str]] = {
    "vllm": {
        "--speculative-config": "speculative decoding",
        "--speculative-model": "speculative decoding",
        "--enable-lora": "LoRA adapters",
        # a KV cache of that many blocks whatever the fraction leaves for it (vLLM replaces the
        # count it works out from the free memory: `may_override_num_blocks`)
        "--num-gpu-blocks-override": "a fixed KV cache size",
        # flags in a YAML file the webhook cannot read: any of the above, or a fraction
        "--config": "settings in a file",
    },
    "tgi": {"--lora-adapters": "LoRA adapters"},
    "sglang": {
        "--speculative-algorithm": "speculative decoding",
        "--speculative-draft-model-path": "speculative decoding",
        "--enable-lora": "LoRA adapters",
        "--lora-paths": "LoRA adapters",
    },
}
_INT_FIELDS = {
    "max_model_len",
    "max_num_seqs",
    "max_batched_tokens",
    "kv_tokens",
    "kv_cache_bytes",
    "tp",
    "pp",
    "cuda_graph_max_bs",
}
# Spellings that mean the same thing to the estimator.
_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "auto": None}
_QUANT = {"awq_marlin": "awq", "gptq_marlin": "gptq", "bitsandbytes-nf4": None, "eetq": None}


@dataclass(frozen=True, slots=True)
class Invocation:
    """A recognised engine in one container."""

    settings: EngineSettings
    tokens: tuple[str, ...]  # command + args as the container runs them
    shell: bool  # the engine runs inside `sh -c ...`: flags cannot be appended to args
    fraction_flag_set: bool  # the container already passes the engine's memory flag
    #: the value it passes there when written out (`0.9`), not a `$(VAR)` the kubelet or the
    #: shell fills in: the engine then takes that share of whichever GPU the pod lands on
    fixed_fraction: str | None = None
    #: what it runs that the estimate does not count (`--enable-lora (LoRA adapters)`)
    unestimated: tuple[str, ...] = ()
    #: the memory flag (TGI: or its variable) is given from a variable, as the fraction
    #: hand-off does (`--gpu-memory-utilization=$(VRAMSCHED_GPU_MEMORY_FRACTION)`)
    fraction_from_variable: bool = False

    @property
    def engine(self) -> str:
        return self.settings.engine


def _strings(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


def _detect(tokens: Sequence[str], image: str) -> str | None:
    joined = " ".join(tokens)
    for i, t in enumerate(tokens):
        base = t.rsplit("/", 1)[-1]
        if base == "vllm" and i + 1 < len(tokens) and tokens[i + 1] == "serve":
            return "vllm"
        if base == "text-generation-launcher":
            return "tgi"
    if "vllm.entrypoints" in joined:
        return "vllm"
    if "sglang.launch_server" in joined or "sglang serve" in joined:
        return "sglang"
    image = image.lower()
    if "vllm" in image:
        return "vllm"
    if "text-generation-inference" in image:
        return "tgi"
    if "sglang" in image:
        return "sglang"
    return None


#: vLLM's fields whose flags take `32k` (32,000) or `32K` (32,768): vllm/utils/argparse_utils.py
#: `human_readable_int`, used for `--max-model-len`, `--max-num-batched-tokens` and
#: `--kv-cache-memory-bytes`
_VLLM_HUMAN = frozenset({"max_model_len", "max_batched_tokens", "kv_cache_bytes"})
_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(raw: str) -> int:
    """A count as vLLM reads `--max-model-len`: `32768`, `32k` (decimal: 32,000; decimals
    allowed, `25.6k`) or `32K` (binary: 32,768; whole numbers only). ValueError otherwise.

    Why mirror it rather than take ints only: `--max-model-len 32k` read as no flag at all
    sized the pod for the model's whole context, 12 GiB too much for Llama-3.1-8B."""
    text = raw.strip()
    match = _HUMAN.fullmatch(text)
    if match is None:
        return int(text)
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        value = float(number) * _DECIMAL[suffix]  # as vLLM rounds: 1.001k is 1,000
        if math.isfinite(value):
            return int(value)
        return int(Fraction(number) * _DECIMAL[suffix])  # beyond a float: exact, then refused
    return int(number) * _BINARY[suffix]  # "1.5K": ValueError, as vLLM refuses it


def _value(field: str, raw: str, engine: str = "") -> Any:
    if "$(" in raw or raw.startswith("$"):
        return None  # substituted by kubelet or the shell: unknown here
    if engine == "vllm" and field in _VLLM_HUMAN:
        if field == "max_model_len" and raw.strip().lower() in ("-1", "auto"):
            # vLLM fits the context to the memory it is given: sized as unset, the model's
            # whole context, the most vLLM takes
            return None
        try:
            return human_readable_int(raw)
        except ValueError:
            return None
    if field in _INT_FIELDS:
        try:
            return int(raw)
        except ValueError:
            return None
    raw = raw.strip().lower() if field != "model" else raw.strip()
    if field == "dtype":
        return _DTYPE.get(raw, raw)
    if field == "quantization":
        return _QUANT.get(raw, raw)
    return raw


def _next(tokens: Sequence[str], i: int) -> str:
    return tokens[i + 1] if i + 1 < len(tokens) else ""


def _parse_flags(engine: str, tokens: Sequence[str]) -> tuple[dict[str, Any], bool, str | None]:
    names = _FLAGS[engine]
    found: dict[str, Any] = {}
    fraction = FLAGS[engine]
    fraction_set = False
    fixed: str | None = None
    i = 0
    while i < len(tokens):
        flag, _, inline = _flag(engine, tokens[i])
        if flag == fraction:
            fraction_set = True
            raw = inline or _next(tokens, i)
            fixed = _literal(raw)  # the last one given wins, as with argparse and clap
        if flag == _EAGER.get(engine):
            found["enforce_eager"] = True
        field = names.get(flag)
        if field is not None:
            raw = inline or _next(tokens, i)
            value = _value(field, raw, engine)
            if value is not None:
                found[field] = value
            if not inline:
                i += 1
        i += 1
    if engine == "vllm" and "model" not in found:
        # `vllm serve MODEL`: the first word after `serve` that is not a flag.
        for i, t in enumerate(tokens[:-1]):
            if t == "serve" and not tokens[i + 1].startswith("-"):
                found["model"] = tokens[i + 1]
                break
    return found, fraction_set, fixed


def _flag(engine: str, token: str) -> tuple[str, str, str]:
    """`token` split at its first `=` into (flag, "=", inline value), the flag spelled as the
    engine reads it: vLLM's parser takes `--max_model_len` for `--max-model-len` (underscores
    in the name before any `.`, vllm/utils/argparse_utils.py `FlexibleArgumentParser`)."""
    flag, eq, inline = token.partition("=")
    if engine == "vllm" and flag.startswith("--") and "_" in flag:
        name, dot, rest = flag[2:].partition(".")
        flag = "--" + name.replace("_", "-") + dot + rest
    return flag, eq, inline


def _literal(raw: str) -> str | None:
    """`raw` when it is written out, None when a variable fills it in (or it is empty)."""
    raw = raw.strip()
    return None if not raw or "$" in raw else raw


def flag_names(engine: str) -> dict[str, str]:
    """EngineSettings field -> the engine's own long flag, without its dashes (TGI's
    `max-total-tokens` for the context): how the estimate's errors name what the pod set."""
    out: dict[str, str] = {}
    for flag, field in _FLAGS.get(engine, {}).items():
        if flag.startswith("--"):
            out.setdefault(field, flag[2:])
    return out


def _tgi_env(env: Any, found: dict[str, Any]) -> tuple[bool, str | None]:
    """TGI's launcher reads every flag from the environment too (clap `env`); returns whether
    the memory fraction (`CUDA_MEMORY_FRACTION`) is given there, and its value if written out."""
    given, fixed = False, None
    for entry in env if isinstance(env, list) else []:
        if not isinstance(entry, Mapping) or "value" not in entry:
            continue
        name = str(entry.get("name", ""))
        flag = "--" + name.lower().replace("_", "-")
        if flag == FLAGS["tgi"]:
            given, fixed = True, _literal(str(entry["value"]))
        field = _FLAGS["tgi"].get(flag)
        if field is not None and field not in found:
            value = _value(field, str(entry["value"]))
            if value is not None:
                found[field] = value
    return given, fixed


def parse_container(
    container: Mapping[str, Any], engine_hint: str | None = None
) -> Invocation | None:
    """The engine a container runs (None: none recognised). `engine_hint` (the pod's
    vramsched.io/engine annotation) overrides detection."""
    command = _strings(container.get("command"))
    args = _strings(container.get("args"))
    tokens = command + args
    shell = False
    if command and command[0].rsplit("/", 1)[-1] in ("sh", "bash") and "-c" in tokens:
        script = tokens[tokens.index("-c") + 1] if tokens.index("-c") + 1 < len(tokens) else ""
        try:
            tokens = shlex.split(script)
        except ValueError:
            tokens = script.split()
        shell = True
    engine = engine_hint if engine_hint in ENGINE_ANNOTATION_VALUES else None
    engine = engine or _detect(tokens, str(container.get("image") or ""))
    if engine is None:
        return None
    found, fraction_set, fixed = _parse_flags(engine, tokens)
    given = fraction_set
    if engine == "tgi":
        in_env, from_env = _tgi_env(container.get("env"), found)
        if not fraction_set:  # clap: the command line beats the environment
            given, fixed = in_env, from_env
    settings = replace(EngineSettings(engine=engine), **found)
    extra = _unestimated(engine, tokens, container.get("env"))
    variable = given and fixed is None
    return Invocation(settings, tuple(command + args), shell, fraction_set, fixed, extra, variable)


#: vLLM's speculative methods that propose tokens from the prompt, with no draft model to load
_DRAFTLESS = frozenset({"ngram", "suffix"})


def _draftless(config: str) -> bool:
    """A `--speculative-config` (JSON) that loads no draft model: n-gram or suffix lookup."""
    try:
        parsed = orjson.loads(config)  # nesting capped (json.loads recurses past the stack)
    except orjson.JSONDecodeError:
        return False
    return (
        isinstance(parsed, dict) and parsed.get("method") in _DRAFTLESS and not parsed.get("model")
    )


#: the largest CUDA graph vLLM captures by default (`max_cudagraph_capture_size`: at most 512
#: tokens); the 1 GiB the estimate counts for the graph pool was measured at vLLM's defaults
VLLM_GRAPH_CAPTURE_MAX = 512
#: vLLM's spellings of the CUDA graph sizes it captures: list flags (nargs, `--cuda-graph-sizes`
#: before v0.12), the largest size, and both as fields of the compilation config (`-cc`)
_GRAPH_LISTS = ("--cudagraph-capture-sizes", "--cuda-graph-sizes")
_GRAPH_MAX = "--max-cudagraph-capture-size"
_COMPILATION = ("--compilation-config", "-cc", "-O")
_GRAPH_FIELDS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")


def _sizes(raw: Any) -> list[int] | None:
    """Graph sizes written as a number, a flat JSON list of numbers or comma-separated text; None
    if any entry is not a whole number written out (a variable, a nested list)."""
    items = raw if isinstance(raw, list) else [raw]
    out: list[int] = []
    for item in items:
        if isinstance(item, bool) or isinstance(item, (list, dict)):
            return None
        if isinstance(item, int):
            out.append(item)
            continue
        parts = [p for p in re.split(r"[\s,\[\]]+", str(item)) if p]
        if not parts or not all(p.isascii() and p.isdigit() for p in parts):
            return None
        out += [int(p) for p in parts]
    return out


def _graph_sizes(tokens: Sequence[str]) -> list[tuple[str, list[int] | None]]:
    """Every setting of the CUDA graph sizes on a vLLM command line: the flag, and the sizes it
    gives (None where they are not written out). Empty where vLLM keeps its default."""
    found: list[tuple[str, list[int] | None]] = []
    for i, token in enumerate(tokens):
        flag, eq, inline = _flag("vllm", token)
        base, dot, field = flag.partition(".")
        field = field.replace("-", "_")  # `-cc.max-cudagraph-capture-size` names the same field
        if flag in _GRAPH_LISTS:
            values = [inline] if eq else list(_list_values(tokens, i))
            found.append((flag, _sizes(values) if values else None))
        elif flag == _GRAPH_MAX:
            found.append((flag, _sizes(inline if eq else _next(tokens, i))))
        elif base in _COMPILATION and dot and field in _GRAPH_FIELDS:
            raw = inline if eq else _next(tokens, i)
            try:
                value: Any = orjson.loads(raw)
            except orjson.JSONDecodeError:
                value = raw
            found.append((flag, _sizes(value)))
        elif flag in _COMPILATION and not dot:
            try:
                config = orjson.loads(inline if eq else _next(tokens, i))
            except orjson.JSONDecodeError:
                continue  # `-O3`, a level: no sizes
            if isinstance(config, dict):
                found += [(f"{flag} {n}", _sizes(config[n])) for n in _GRAPH_FIELDS if n in config]
    return found


def _list_values(tokens: Sequence[str], i: int) -> Sequence[str]:
    """The values after an `nargs="+"` flag at `i`: up to the next flag."""
    end = i + 1
    while end < len(tokens) and not tokens[end].startswith("-"):
        end += 1
    return tokens[i + 1 : end]


def _large_graphs(tokens: Sequence[str]) -> str | None:
    """A vLLM command line that may capture CUDA graphs beyond the sizes the estimate measured
    (any setting above them, or one not written out), described as `_unestimated` describes a
    flag; None when it keeps within them or captures none (`--enforce-eager`)."""
    if any(_flag("vllm", t)[0] == _EAGER["vllm"] for t in tokens):
        return None
    measured = f"the estimate counts up to {VLLM_GRAPH_CAPTURE_MAX}"
    for flag, sizes in _graph_sizes(tokens):
        if sizes is None:
            return f"{flag} (CUDA graph sizes not written out; {measured})"
        if max(sizes, default=0) > VLLM_GRAPH_CAPTURE_MAX:
            return f"{flag} (CUDA graphs up to {max(sizes)} tokens; {measured})"
    return None


def _unestimated(engine: str, tokens: Sequence[str], env: Any) -> tuple[str, ...]:
    """The flags (TGI: or their environment variables) of `_UNESTIMATED` the container passes,
    each with what it loads; for vLLM also CUDA graphs larger than the estimate counts."""
    known = _UNESTIMATED[engine]
    given = [
        flag
        for i, t in enumerate(tokens)
        for flag, eq, inline in [_flag(engine, t)]
        if not (flag == "--speculative-config" and _draftless(inline if eq else _next(tokens, i)))
    ]
    if engine == "tgi":
        given += [
            "--" + str(e.get("name", "")).lower().replace("_", "-")
            for e in (env if isinstance(env, list) else [])
            if isinstance(e, Mapping) and str(e.get("value") or "").strip()
        ]
    found = [f"{f} ({known[f]})" for f in given if f in known]
    large = _large_graphs(tokens) if engine == "vllm" else None
    return tuple(dict.fromkeys(found + ([large] if large else [])))
