"""Regenerate the Python gRPC stubs of the kubelet APIs from the .proto files beside this module.

`make protos` runs `python -m extender.device_plugin.api.generate`; `tests/test_device_plugin.py`
regenerates into a temporary folder and fails when the committed stubs differ (someone edited a
.proto, or the pinned grpcio-tools changed). To take a newer upstream file (Kubernetes
`staging/src/k8s.io/kubelet/pkg/apis/{deviceplugin/v1beta1,podresources/v1}/api.proto`):
`python -m extender.device_plugin.api.generate --import UPSTREAM.proto deviceplugin_v1beta1.proto`,
which drops gogo-protobuf (Go-only code generation options that protoc cannot resolve here) and
keeps everything that reaches the wire.

Stubs are generated with the repository root as include path, so they import each other as
`extender.device_plugin.api.*` and register under that file name in the protobuf pool.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["PROTOS", "API_DIR", "clean", "generate", "main"]

API_DIR = Path(__file__).resolve().parent
REPO_ROOT = API_DIR.parents[2]
PROTOS = ("deviceplugin_v1beta1.proto", "podresources_v1.proto")

_GOGO_IMPORT = re.compile(
    r'^\s*import\s+"github\.com/gogo/protobuf/gogoproto/gogo\.proto";\s*\n', re.M
)
_GOGO_OPTION = re.compile(r"^\s*option\s+\(gogoproto\.[a-z_]+\)\s*=\s*[^;]+;\s*\n", re.M)
# field options: `[(gogoproto.customname) = "ID", (gogoproto.nullable) = false]`, alone or mixed
_GOGO_FIELD_OPTION = re.compile(r"\(gogoproto\.[a-z_]+\)\s*=\s*[^,\]]+")


def _strip_field_options(match: re.Match[str]) -> str:
    inner = _GOGO_FIELD_OPTION.sub("", match.group(1))
    parts = [p.strip() for p in inner.split(",") if p.strip()]
    return f" [{', '.join(parts)}]" if parts else ""


def clean(text: str) -> str:
    """An upstream kubelet .proto without gogo-protobuf: its import, file options and field options.

    Messages, field names and numbers, services and the package stay as they are, so the stubs
    speak the kubelet's wire format."""
    text = _GOGO_IMPORT.sub("", text)
    text = _GOGO_OPTION.sub("", text)
    return re.sub(r"\s*\[([^\]]*gogoproto[^\]]*)\]", _strip_field_options, text)


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Run protoc (grpcio-tools) on `PROTOS`; stubs land in `out_root`/extender/device_plugin/api."""
    try:
        import grpc_tools
    except ImportError:
        raise SystemExit(
            "grpcio-tools is not installed: pip install -e '.[dev]' (make venv)"
        ) from None
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    rel = API_DIR.relative_to(REPO_ROOT)
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(rel / p) for p in PROTOS),
    ]
    out_root.mkdir(parents=True, exist_ok=True)
    # a process of its own: protoc's C++ runtime must not meet the protobuf already loaded here
    # (ortools'); proto paths are relative to the include path
    proc = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"protoc failed with exit code {proc.returncode}: {proc.stderr.strip()}")
    out = out_root / rel
    return sorted(p for p in out.iterdir() if p.name.endswith((".py", ".pyi")) and "_pb2" in p.name)


def _leading_comments(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        if not line.startswith("//"):
            break
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--import",
        dest="upstream",
        nargs=2,
        metavar=("UPSTREAM", "NAME"),
        help="clean an upstream api.proto into NAME (one of " + ", ".join(PROTOS) + ") first",
    )
    args = parser.parse_args(argv)
    if args.upstream:
        source, name = args.upstream
        if name not in PROTOS:
            parser.error(f"NAME must be one of {', '.join(PROTOS)}, not {name!r}")
        target = API_DIR / name
        # keep the header that says where the file comes from
        old = target.read_text().splitlines(keepends=True) if target.exists() else []
        header = "".join(line for line in _leading_comments(old))
        target.write_text(header + clean(Path(source).read_text()))
    for path in generate():
        print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
