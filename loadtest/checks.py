"""What makes an extender answer unusable by kube-scheduler: the load test's failure rules.

Kept apart from the locustfile (which imports locust and gevent) so that tests can check
the rules themselves. The client shares the machine with the server and must stay cheap:
answers are decoded by msgspec straight into typed records, so the per-host type and range
checks (and the exact set of keys) run in C while parsing; what is left is a few C-level set
and list operations. msgspec's error names the offending element (`$[17].Score`).
"""

from __future__ import annotations

import random
from operator import attrgetter
from typing import Annotated

import msgspec

__all__ = ["RACE_MARK", "check_bind", "check_filter", "check_prioritize"]

RACE_MARK = "does not fit on"  # a bind Error when another pod took the devices since filter

Reason = Annotated[str, msgspec.Meta(min_length=1)]


class _Filter(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """ExtenderFilterResult with nodeCacheCapable: every key present, no other, Nodes null."""

    Nodes: None
    NodeNames: list[str]
    FailedNodes: dict[str, Reason]
    FailedAndUnresolvableNodes: dict[str, Reason]
    Error: str


class _Host(msgspec.Struct, gc=False):
    """HostPriority: kube-scheduler reads an int64 Score; vramsched promises 0..10."""

    Host: str
    Score: Annotated[int, msgspec.Meta(ge=0, le=10)]


class _Bind(msgspec.Struct, gc=False):
    Error: str


_FILTER = msgspec.json.Decoder(_Filter)
_HOSTS = msgspec.json.Decoder(list[_Host])
_BIND = msgspec.json.Decoder(_Bind)
_HOST, _SCORE = attrgetter("Host"), attrgetter("Score")


def check_filter(raw: bytes, sent: frozenset[str], n_sent: int) -> tuple[str | None, list[str] | None]:
    """(why kube-scheduler could not use this filter answer or None, the feasible nodes)."""
    try:
        out = _FILTER.decode(raw)
    except msgspec.DecodeError as exc:  # ValidationError included
        return f"malformed filter answer: {exc}", None
    if out.Error != "":
        return f"filter Error for a well-formed pod: {out.Error[:200]}", None
    feasible = out.NodeNames
    passed = set(feasible)
    if not passed <= sent:
        return "filter answer claims a node that was not sent", None
    explained = out.FailedNodes.keys() | out.FailedAndUnresolvableNodes.keys()
    if len(passed) != len(feasible) or not explained.isdisjoint(passed):
        return "filter answer lists a node twice", None
    if not explained <= sent or len(feasible) + len(explained) != n_sent:
        return f"filter answer accounts for {len(feasible) + len(explained)} of {n_sent} nodes", None
    return None, feasible


def check_prioritize(
    raw: bytes, feasible: list[str], rng: random.Random, feasible_set: frozenset[str] | set[str] | None = None
) -> tuple[str | None, str | None]:
    """(why the answer is unusable or None, the best host). `feasible_set`: `set(feasible)` if at hand."""
    try:
        out = _HOSTS.decode(raw)
    except msgspec.DecodeError as exc:
        return f"malformed prioritize answer: {exc}", None
    if not out:
        return None, rng.choice(feasible)  # no opinion: any survivor
    hosts = list(map(_HOST, out))
    # the same list in the same order (what vramsched answers) is trivially within what was
    # sent: one pass of string comparisons instead of hashing thousands of fresh strings
    if hosts != feasible and not set(hosts) <= (set(feasible) if feasible_set is None else feasible_set):
        return "prioritize scored a node that was not sent", None
    scores = list(map(_SCORE, out))
    top = max(scores)
    start = rng.randrange(len(scores))  # a random one among the best (in-tree scores would decide)
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
