"""What makes an extender answer unusable by kube-scheduler: the load test's failure rules.

Kept apart from the locustfile (which imports locust and gevent) so that tests can check
the rules themselves. The client shares the machine with the server and must stay cheap:
answers are decoded by msgspec straight into typed records, so the per-host type and range
checks, the exact set of keys and whether a node was sent at all run in C while parsing; what
is left is a few C-level set and list operations. msgspec's error names the offending element
(`$[17].Score`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from operator import attrgetter
from typing import Annotated, Literal

import msgspec

__all__ = ["RACE_MARK", "Checks", "check_bind"]

RACE_MARK = "does not fit on"  # a bind Error when another pod took the devices since filter

Reason = Annotated[str, msgspec.Meta(min_length=1)]


class _Bind(msgspec.Struct, gc=False):
    Error: str


_BIND = msgspec.json.Decoder(_Bind)
_HOST, _SCORE = attrgetter("Host"), attrgetter("Score")


class Checks:
    """The filter and prioritize rules for one list of sent node names.

    Node names are decoded as a `Literal` of the sent names: msgspec looks each one up in a table
    built once and hands back the sent `str` object itself, so a name that was not sent fails
    while parsing, and no answer allocates (and hashes) thousands of fresh strings. On a
    5,000-node answer that is about a third of the client's checking CPU.
    """

    def __init__(self, sent: Sequence[str]) -> None:
        self.n_sent = len(sent)
        node = Literal[tuple(sent)] if sent else str  # type: ignore[valid-type]

        # defstruct, not a class body: the field types name this call's `node` (annotations are strings here)
        filter_answer = (
            msgspec.defstruct(  # ExtenderFilterResult with nodeCacheCapable: these keys, Nodes null
                "FilterAnswer",
                [
                    ("Nodes", None),
                    ("NodeNames", list[node]),
                    ("FailedNodes", dict[node, Reason]),
                    ("FailedAndUnresolvableNodes", dict[node, Reason]),
                    ("Error", str),
                ],
                forbid_unknown_fields=True,
                gc=False,
            )
        )
        # HostPriority: kube-scheduler reads an int64 Score; vramsched promises 0..10
        host = msgspec.defstruct(
            "Host", [("Host", node), ("Score", Annotated[int, msgspec.Meta(ge=0, le=10)])], gc=False
        )
        self._filter = msgspec.json.Decoder(filter_answer)
        self._hosts = msgspec.json.Decoder(list[host])

    def filter(self, raw: bytes) -> tuple[str | None, list[str] | None]:
        """(why kube-scheduler could not use this filter answer or None, the feasible nodes)."""
        try:
            out = self._filter.decode(raw)
        except msgspec.DecodeError as exc:  # ValidationError included
            if str(exc).startswith("Invalid enum value"):
                return f"filter answer claims a node that was not sent: {exc}", None
            return f"malformed filter answer: {exc}", None
        if out.Error != "":
            return f"filter Error for a well-formed pod: {out.Error[:200]}", None
        feasible = out.NodeNames
        passed = set(feasible)
        failed, unresolvable = out.FailedNodes, out.FailedAndUnresolvableNodes
        explained = failed.keys() | unresolvable.keys() if failed else unresolvable.keys()
        if len(passed) != len(feasible) or not explained.isdisjoint(passed):
            return "filter answer lists a node twice", None
        # Reasons are all or nothing, and nothing only when some node passes: kube-scheduler
        # reads them only when none does (vramsched's default; `--explain-all` sends them always).
        if (explained or not feasible) and len(feasible) + len(explained) != self.n_sent:
            return (
                f"filter answer accounts for {len(feasible) + len(explained)} of {self.n_sent} nodes",
                None,
            )
        return None, feasible

    def prioritize(
        self,
        raw: bytes,
        feasible: list[str],
        rng: random.Random,
        feasible_set: frozenset[str] | set[str] | None = None,
    ) -> tuple[str | None, str | None]:
        """(why the answer is unusable or None, the best host). `feasible_set`: `set(feasible)` if at hand."""
        try:
            out = self._hosts.decode(raw)
        except msgspec.DecodeError as exc:
            if str(exc).startswith("Invalid enum value"):
                return f"prioritize scored a node that was not sent: {exc}", None
            return f"malformed prioritize answer: {exc}", None
        if not out:
            return None, rng.choice(feasible)  # no opinion: any survivor
        hosts = list(map(_HOST, out))
        # the same list in the same order (what vramsched answers) is trivially within what was
        # sent: one pass of identity comparisons (decoded names are the sent objects)
        if hosts != feasible and not set(hosts) <= (
            set(feasible) if feasible_set is None else feasible_set
        ):
            return "prioritize scored a node that was not sent", None
        scores = list(map(_SCORE, out))
        top = max(scores)
        start = rng.randrange(
            len(scores)
        )  # a random one among the best (in-tree scores would decide)
        try:
            i = scores.index(top, start)
        except ValueError:
            i = scores.index(top)
        return None, hosts[i]


def check_bind(raw: bytes) -> tuple[str | None, bool]:
    """(why the bind answer is unusable or None, whether the bind lost a race)."""
    try:
        error = _BIND.decode(raw).Error
    except msgspec.DecodeError as exc:
        return f"malformed bind answer: {exc}", False
    if error and RACE_MARK not in error:
        return f"bind refused: {error[:200]}", False
    return None, bool(error)
