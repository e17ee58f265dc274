"""`top` and `why` for people (rich tables, colour only on a terminal) and for tools (JSON, YAML).

rich decides whether the output is a terminal (and honours NO_COLOR / FORCE_COLOR); piped output
is plain text as wide as its lines, without trailing blanks, so it greps and diffs like kubectl's.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import IO, Any

import orjson
import yaml
from rich import box
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from extender.observe.usage import DeviceUsage, NodeUsage, PodShare, Summary
from extender.observe.why import Explanation, describe_closest, event_text
from extender.quantity import format_bytes

__all__ = ["console", "emit", "dump", "top_table", "summary_line", "why_renderables", "BAR"]

#: cells of the VRAM bar
BAR = 10


def console(file: IO[str] | None = None) -> Console:
    return Console(file=file or sys.stdout, highlight=False, soft_wrap=False)


def emit(out: Console, *renderables: RenderableType) -> None:
    """Print; off a terminal as plain lines with no trailing blanks and no width limit."""
    if out.is_terminal:
        for r in renderables:
            out.print(r)
        return
    wide = Console(width=100_000, highlight=False, no_color=True, color_system=None)
    with wide.capture() as captured:
        for r in renderables:
            wide.print(r)
    text = "\n".join(line.rstrip() for line in captured.get().splitlines())
    out.file.write(text + "\n")
    out.file.flush()


def dump(doc: Any, fmt: str, file: IO[str] | None = None) -> None:
    """`-o json` (indented, as kubectl) or `-o yaml`."""
    f = file or sys.stdout
    if fmt == "json":
        try:
            text = orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()
        except TypeError:  # a sum beyond 64 bits, which orjson does not write: the slow way
            text = json.dumps(doc, indent=2, ensure_ascii=False)
        f.write(text + "\n")
    else:
        f.write(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False))


def _bar(d: DeviceUsage) -> Text:
    share = d.used / d.memory if d.memory else 0.0
    filled = max(0, min(BAR, round(share * BAR)))  # a device over its memory fills the bar
    style = "red" if share >= 0.9 else "yellow" if share >= 0.6 else "green"
    text = Text("█" * filled, style=style)
    text.append("░" * (BAR - filled), style="dim")
    text.append(f" {format_bytes(d.used)}/{format_bytes(d.memory)}")
    return text


def _pod(p: PodShare, wide: bool) -> str:
    held = "?" if p.bytes is None else format_bytes(p.bytes)
    if p.model_memory is None:
        return f"{p.key} {held} (undeclared: whole device)"
    if wide and p.model_memory != p.bytes:
        return f"{p.key} {held} (model {format_bytes(p.model_memory)})"
    return f"{p.key} {held}"


def top_table(nodes: Sequence[NodeUsage], *, wide: bool = False) -> Table:
    """One row per GPU or MIG slice, grouped by node; the node's name on its first row."""
    table = Table(box=box.SIMPLE_HEAD if wide else None, header_style="bold", pad_edge=False)
    table.add_column("NODE", no_wrap=True)
    table.add_column("GPU", no_wrap=True)
    table.add_column("PRODUCT", no_wrap=True)
    table.add_column("SHARING", no_wrap=True)
    table.add_column("VRAM USED/TOTAL", no_wrap=True)
    table.add_column("REPLICAS", justify="right", no_wrap=True)
    if wide:
        table.add_column("FREE", justify="right", no_wrap=True)
        table.add_column("STRANDED", justify="right", no_wrap=True)
        table.add_column("RESOURCE", no_wrap=True)
    table.add_column("PODS (VRAM held)", no_wrap=True)
    for n in nodes:
        if not n.devices:
            if wide:
                table.add_row(n.name, "-", Text(n.problem or "no GPUs", style="dim"))
            continue
        for j, d in enumerate(n.devices):
            stranded = Text(format_bytes(d.stranded), style="magenta" if d.stranded else "")
            cells: list[Any] = [
                n.name if j == 0 else "",
                d.device_id,
                d.product,
                d.sharing,
                _bar(d),
                f"{d.used_replicas}/{d.replicas}",
            ]
            if wide:
                cells += [format_bytes(d.free), stranded, d.resource or ""]
            cells.append("\n".join(_pod(p, wide) for p in d.pods) or Text("-", style="dim"))
            table.add_row(*cells, end_section=j == len(n.devices) - 1 and wide)
    return table


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def summary_line(s: Summary) -> Text:
    text = Text()
    text.append(f"{s.gpus_in_use}", style="bold")
    text.append(f" of {s.gpus} GPUs in use, ")
    text.append(f"{s.gpus_free}", style="bold green")
    text.append(" fully free; VRAM allocated ")
    text.append(
        f"{format_bytes(s.used)} of {format_bytes(s.memory)} ({100 * s.used_fraction:.1f}%)",
        style="bold",
    )
    text.append("; stranded ")
    text.append(format_bytes(s.stranded), style="bold magenta" if s.stranded else "bold")
    text.append(f"; {_count(s.pods, 'pod')} on {_count(s.nodes, 'node')}")
    return text


def why_renderables(e: Explanation, *, wide: bool = False, limit: int = 5) -> list[RenderableType]:
    """The verdict, the reasons with their nodes (`limit` names each unless `wide`), the closest
    node and what would make the pod fit there."""
    out: list[RenderableType] = []
    head = Text(f"pod {e.pod}", style="bold")
    if e.error:
        # a demand error names the pod already
        out.append(head + Text(f": {e.error.removeprefix(f'pod {e.pod}: ')}", style="red"))
        if e.bound_to:
            where = ", ".join(e.held) if e.held else "no device"
            out.append(Text(f"bound to {e.bound_to}; the ledger counts it on {where}"))
        return out
    head.append(f" asks for {e.demand}", style="")
    out.append(head)
    if e.bound_to:
        out.append(Text(f"already bound to {e.bound_to}; this is what filter would say now"))
    elif e.gates:
        out.append(
            Text(
                f"held by scheduling gates ({', '.join(e.gates)}): kube-scheduler does not try "
                "it until they are removed; this is what filter would say now",
                style="yellow",
            )
        )
    if e.feasible:
        names = ", ".join(e.feasible[: None if wide else limit])
        more = "" if wide or len(e.feasible) <= limit else f" (+{len(e.feasible) - limit} more)"
        out.append(
            Text(f"fits now on {len(e.feasible)} of {e.nodes} nodes: {names}{more}", style="green")
        )
        if not e.gates:  # else the gates hold it, said above
            out.append(
                Text(
                    "vramsched would not refuse it: if it is still pending, kube-scheduler's own "
                    "filters (CPU, memory, taints, affinity) or a retry backoff hold it "
                    "(kubectl describe pod)",
                    style="dim",
                )
            )
        if not e.groups:
            return out
    else:
        out.append(Text(event_text(e), style="yellow"))
    table = Table(box=None, header_style="bold", pad_edge=False, show_edge=False)
    table.add_column("NODES", justify="right", no_wrap=True)
    table.add_column("REASON")
    table.add_column("", no_wrap=True)
    table.add_column("WHICH")
    for reason, nodes, unresolvable in e.groups:
        shown = nodes if wide else nodes[:limit]
        which = ", ".join(shown) + (
            "" if len(shown) == len(nodes) else f" (+{len(nodes) - len(shown)})"
        )
        table.add_row(
            str(len(nodes)),
            reason,
            Text("never" if unresolvable else "now", style="dim" if unresolvable else "yellow"),
            which,
        )
    out.append(table)
    if e.closest is not None:
        out.append(Text("closest: ", style="bold") + Text(describe_closest(e.closest)))
    if e.mig is not None:
        m = e.mig
        if m.reconfigure:
            line = (
                f"no MIG slice that holds it exists: a {', '.join(m.reconfigure)} GPU repartitioned "
                f"with {m.profile} ({format_bytes(m.memory)}) would (vramsched plan-mig)"
            )
        else:
            line = (
                f"smallest MIG profile that holds it: {m.profile} ({format_bytes(m.memory)}; "
                f"request {m.resource}); {m.free_slices} free on "
                f"{len(m.nodes)} node{'s' if len(m.nodes) != 1 else ''}"
                + (f": {', '.join(m.nodes[:limit])}" if m.nodes else "")
            )
        out.append(Text("MIG: ", style="bold") + Text(line))
    return out
