"""A model on local disk: its config.json and the exact bytes of its safetensors files.

The only module of the sizing package that reads files. The byte count comes from, in order:
the safetensors headers of every shard (exact, and it tells which tensors the files hold),
else `metadata.total_size` of model.safetensors.index.json, else nothing (the architecture
count is used). Headers are read, never the tensor data: a 140 GB checkpoint costs a few
kilobytes of I/O.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extender.sizing.architecture import MAX_FIELD
from extender.sizing.errors import SizingError

__all__ = ["LocalModel", "read_model", "safetensors_header", "looks_local"]

# A header larger than this is not a safetensors header (the biggest real ones are ~15 MB).
MAX_HEADER_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class LocalModel:
    path: Path
    config: dict[str, Any]
    checkpoint_bytes: int | None  # tensor bytes of the files (headers excluded)
    source: str  # how checkpoint_bytes was found
    tensor_bytes: dict[str, int] = field(default_factory=dict)  # per tensor, when headers were read


def looks_local(model: str) -> bool:
    """Whether MODEL names a path (the CLI takes either a path or a catalogue name)."""
    return model.startswith((".", "/", "~")) or Path(model).expanduser().exists()


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of one .safetensors file: {name: {dtype, shape, data_offsets}, ...}."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SizingError(f"{path.name} is not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", raw)
            if length > MAX_HEADER_BYTES:
                raise SizingError(
                    f"{path.name} is not a safetensors file (header of {length} bytes)"
                )
            body = f.read(length)
    except OSError as exc:
        raise SizingError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(body) != length:
        raise SizingError(f"{path.name} is truncated (header of {length} bytes)")
    try:
        header = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep
        raise SizingError(f"{path.name} has no valid safetensors JSON header") from None
    if not isinstance(header, dict):
        raise SizingError(f"{path.name} has no valid safetensors JSON header")
    return header


def _tensor_bytes(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, info in safetensors_header(path).items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            size = int(end) - int(begin)
        except (KeyError, TypeError, ValueError, OverflowError):
            raise SizingError(f"{path.name}: tensor {name!r} has no data_offsets") from None
        if size < 0:
            raise SizingError(f"{path.name}: tensor {name!r} has negative size")
        if size > MAX_FIELD:  # 8 PiB: more than any tensor holds
            raise SizingError(f"{path.name}: tensor {name!r} has {size} bytes, more than 2**53")
        out[name] = size
    return out


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise SizingError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SizingError(f"{what} at {path} is not valid JSON ({exc})") from None
    except RecursionError:  # json.loads recurses once per level of nesting
        raise SizingError(f"{what} at {path} is nested too deeply to be a model's") from None


def read_model(model: str) -> LocalModel:
    """A Hugging Face model directory, or the path of its config.json."""
    path = Path(model).expanduser()
    directory = path.parent if path.is_file() else path
    config_path = path if path.is_file() else path / "config.json"
    if not directory.is_dir():
        raise SizingError(f"{model} is neither a catalogue model nor a model directory")
    if not config_path.is_file():
        raise SizingError(f"{directory} has no config.json")
    config = _read_json(config_path, "config.json")
    if not isinstance(config, dict):
        raise SizingError(f"config.json at {config_path} is not a JSON object")
    shards = sorted(directory.glob("*.safetensors"))
    index_path = directory / "model.safetensors.index.json"
    wanted: set[str] = set()
    index_total: int | None = None
    if index_path.is_file():
        index = _read_json(index_path, "model.safetensors.index.json")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if isinstance(weight_map, dict):
            wanted = {str(f) for f in weight_map.values()}
        meta = index.get("metadata") if isinstance(index, dict) else None
        total = meta.get("total_size") if isinstance(meta, dict) else None
        # NaN fails both comparisons; math.isfinite would raise on an int beyond a float.
        if (
            isinstance(total, int | float)
            and not isinstance(total, bool)
            and 0 < total <= MAX_FIELD
        ):
            index_total = int(total)
    present = {p.name for p in shards}
    if shards and (not wanted or wanted <= present):
        files = [p for p in shards if not wanted or p.name in wanted]
        tensors: dict[str, int] = {}
        for p in files:
            tensors.update(_tensor_bytes(p))
        return LocalModel(
            directory,
            config,
            sum(tensors.values()),
            f"safetensors headers of {len(files)} file{'s' if len(files) != 1 else ''}",
            tensors,
        )
    if index_total is not None:
        return LocalModel(directory, config, index_total, "model.safetensors.index.json total_size")
    return LocalModel(directory, config, None, "config.json only (no safetensors files)")
