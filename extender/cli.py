"""`vramsched` command line. Each subcommand lives in `extender/commands/<name>.py` and
provides `register(subparsers)`; this module only discovers and dispatches them.

`kubectl-vramsched` is the same program as a kubectl plugin (kubectl runs `kubectl-<name>` found
on PATH for `kubectl <name>`), offering the commands an operator runs against a cluster."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Collection, Sequence

import extender
import extender.commands

__all__ = ["main", "kubectl_main", "build_parser", "KUBECTL_COMMANDS"]

#: what `kubectl vramsched` offers
KUBECTL_COMMANDS = frozenset({"top", "why"})


def build_parser(
    prog: str = "vramsched", only: Collection[str] | None = None
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="VRAM-aware GPU scheduler extender for Kubernetes"
    )
    parser.add_argument("--version", action="version", version=f"vramsched {extender.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(extender.commands.__path__), key=lambda m: m.name):
        if only is not None and info.name.replace("_", "-") not in only:
            continue
        module = importlib.import_module(f"extender.commands.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help(sys.stderr)
        return 2
    return int(args.run(args) or 0)


def kubectl_main(argv: Sequence[str] | None = None) -> int:
    """`kubectl vramsched top|why ...`."""
    return main(argv, build_parser("kubectl vramsched", KUBECTL_COMMANDS))
