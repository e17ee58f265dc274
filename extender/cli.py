"""`vramsched` command line. Each subcommand lives in `extender/commands/<name>.py` and
provides `register(subparsers)`; this module only discovers and dispatches them."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import extender
import extender.commands

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vramsched", description="VRAM-aware GPU scheduler extender for Kubernetes"
    )
    parser.add_argument("--version", action="version", version=f"vramsched {extender.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(extender.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"extender.commands.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help(sys.stderr)
        return 2
    return int(args.run(args) or 0)
