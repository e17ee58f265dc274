"""Per-GPU gauges, written straight in the Prometheus text format from the ledger's arrays.

One series per device (whole GPU or MIG slice) and family, labelled `node`, `gpu` (the ledger's
device id: `0`, or `0:3g.40gb:1` for a slice), `product` and `sharing`: 160,000 samples at 5,000
nodes x 8 GPUs. prometheus_client's `generate_latest` formats every sample anew through Python
objects, 3.6 s for that many on the event loop every scrape; here the label part of each line is
built once per inventory (the arrays are rebuilt only when a node's devices change), the two
static families are kept whole, and only the lines of devices whose allocation changed since the
last scrape are written again (benchmarks/metrics_scrape.py measures both ways).

Nothing is done per request: the ledger is only read, at scrape time, on the loop that owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from extender.inventory import MigSlice
from extender.ledger import DeviceArrays, Ledger
from extender.observe.usage import MIG

__all__ = ["GpuExposition", "FAMILIES", "escape_label"]

#: (name, help); the first and third are static (labels), the others the allocation
FAMILIES = (
    ("vramsched_gpu_memory_bytes", "VRAM of the device (a whole GPU or a MIG slice)"),
    ("vramsched_gpu_memory_allocated_bytes", "VRAM reserved by the pods on the device"),
    (
        "vramsched_gpu_replicas",
        "Pods the device can hold at once (time-slicing or MPS replicas; 1 when exclusive)",
    ),
    ("vramsched_gpu_replicas_allocated", "Pods holding the device"),
)


def escape_label(value: str) -> str:
    """A label value as the text format wants it (backslash, double quote and newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _header(name: str, doc: str) -> bytes:
    return f"# HELP {name} {doc}\n# TYPE {name} gauge\n".encode()


#: lines per piece of `pieces()`: about 0.5 MB, half a millisecond to join
CHUNK = 4096
#: lines formatted between two pauses (label text, or a line rewritten after a change): about
#: half a millisecond too; formatting a line costs ~8 times joining one
FORMAT = CHUNK // 8


class GpuExposition:
    """The four per-device families for `/metrics`, read on the loop that owns the ledger.

    `pieces()` yields the text in pieces of at most `chunk` lines, so that the server writes each
    and lets other requests run in between (a whole scrape at 80,000 devices is 40 MB; at no point
    does the loop stay longer than one piece). A piece may be empty: a pause every `step` lines
    formatted, while labels are built after the inventory changed or the lines of devices whose
    allocation changed are written again."""

    def __init__(
        self, ledger: Callable[[], Ledger], chunk: int = CHUNK, step: int = FORMAT
    ) -> None:
        self._ledger = ledger
        self.chunk = chunk
        self.step = step
        self._arrays: DeviceArrays | None = None
        self._labels: list[bytes] = []
        self._static: tuple[list[bytes], list[bytes]] = ([], [])
        self._used = np.zeros(0, np.int64)
        self._used_replicas = np.zeros(0, np.int32)
        self._lines: tuple[list[bytes], list[bytes]] = ([], [])
        self._headers = tuple(_header(name, doc) for name, doc in FAMILIES)

    def render(self) -> bytes:
        return b"".join(self.pieces())

    def pieces(self) -> Iterator[bytes]:
        a = self._ledger().arrays
        if a is not self._arrays:
            yield from self._relabel(a)
        else:
            yield from self._refresh(a)
        mem, reps = self._static
        used, used_reps = self._lines  # this scrape's lists: a relabel meanwhile makes new ones
        for header, lines in zip(self._headers, (mem, used, reps, used_reps)):
            yield header
            for lo in range(0, len(lines), self.chunk):
                yield b"".join(lines[lo : lo + self.chunk])

    def _relabel(self, a: DeviceArrays) -> Iterator[bytes]:
        """Label text of every device, and every line, anew: after the arrays were rebuilt."""
        labels: list[bytes] = []
        step = self.step
        for lo in range(0, len(a.devices), step):
            labels.extend(
                (
                    f'{{node="{escape_label(d.node)}",gpu="{escape_label(d.device_id)}",'
                    f'product="{escape_label(d.product)}",'
                    f'sharing="{MIG if isinstance(d, MigSlice) else d.sharing.value}"}}'
                ).encode()
                for d in a.devices[lo : lo + step]
            )
            yield b""
        used, used_reps = a.used.copy(), a.used_replicas.copy()
        columns = (a.capacity, used, a.replicas, used_reps)
        blocks: list[list[bytes]] = []
        for (name, _), values in zip(FAMILIES, columns):
            prefix, out = name.encode(), list[bytes]()
            for lo in range(0, len(labels), step):
                out.extend(
                    b"%s%s %d\n" % (prefix, lab, v)
                    for lab, v in zip(labels[lo : lo + step], values[lo : lo + step].tolist())
                )
                yield b""
            blocks.append(out)
        self._labels, self._used, self._used_replicas = labels, used, used_reps
        self._static, self._lines = (blocks[0], blocks[2]), (blocks[1], blocks[3])
        self._arrays = a

    def _refresh(self, a: DeviceArrays) -> Iterator[bytes]:
        """Write again the lines of the devices whose allocation changed since the last scrape,
        `step` lines at a time with a pause (an empty piece) in between: under a load test's
        churn thousands of devices change between two scrapes, and writing them in one go held
        the loop for 23 ms of CPU after 12,000 pods left a 5,000-node cluster. Each step reads
        the values it writes and only then marks them seen, so a scrape that starts meanwhile
        (two Prometheus servers) writes the devices this one has not reached yet, and the last
        writer of a line always wrote the latest value. The arrays are taken once: a relabel
        meanwhile replaces them, and these become garbage."""
        seen_used, seen_reps = self._used, self._used_replicas
        changed = np.flatnonzero((a.used != seen_used) | (a.used_replicas != seen_reps))
        mem, rep = self._lines
        labels = self._labels
        name_mem, name_rep = FAMILIES[1][0].encode(), FAMILIES[3][0].encode()
        step = max(1, self.step // 2)  # two lines per device
        for lo in range(0, len(changed), step):
            rows = changed[lo : lo + step]
            used, reps = a.used[rows], a.used_replicas[rows]
            for i, u, r in zip(rows.tolist(), used.tolist(), reps.tolist()):
                mem[i] = b"%s%s %d\n" % (name_mem, labels[i], u)
                rep[i] = b"%s%s %d\n" % (name_rep, labels[i], r)
            seen_used[rows] = used
            seen_reps[rows] = reps
            yield b""
