"""What makes an extender answer unusable by kube-scheduler: the load test's failure rules.

Kept apart from the locustfile (which imports locust and gevent) so that tests can check
the rules themselves. Every check is a C-level set or map operation: the client shares
the machine with the server and must stay cheap.
"""

from __future__ import annotations

import random
from operator import itemgetter

__all__ = ["RACE_MARK", "check_filter", "check_prioritize"]

RACE_MARK = "does not fit on"  # a bind Error when another pod took the devices since filter
_HOST, _SCORE = itemgetter("Host"), itemgetter("Score")
_FILTER_KEYS = frozenset({"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"})


def check_filter(out: object, sent: frozenset[str], n_sent: int) -> str | None:
    """Why kube-scheduler could not use this filter answer, or None."""
    if not isinstance(out, dict) or set(out) != _FILTER_KEYS:
        return f"filter answer keys {sorted(out) if isinstance(out, dict) else type(out).__name__}"
    if out["Error"] != "":
        return f"filter Error for a well-formed pod: {str(out['Error'])[:200]}"
    feasible, failed, unres = out["NodeNames"], out["FailedNodes"], out["FailedAndUnresolvableNodes"]
    if not isinstance(feasible, list) or not isinstance(failed, dict) or not isinstance(unres, dict):
        return "filter answer NodeNames/FailedNodes/FailedAndUnresolvableNodes of the wrong type"
    if out["Nodes"] is not None:
        return "filter answer has Nodes with nodeCacheCapable"
    try:
        passed = set(feasible)  # every check below is a C-level set operation: the client must stay cheap
    except TypeError:
        return "filter answer NodeNames holds a non-string"
    if not passed <= sent:
        return "filter answer claims a node that was not sent"
    explained = failed.keys() | unres.keys()
    if len(passed) != len(feasible) or not explained.isdisjoint(passed):
        return "filter answer lists a node twice"
    if not explained <= sent or len(feasible) + len(explained) != n_sent:
        return f"filter answer accounts for {len(feasible) + len(explained)} of {n_sent} nodes"
    for reasons in (failed.values(), unres.values()):
        if reasons and (set(map(type, reasons)) != {str} or min(map(len, reasons)) == 0):
            return "filter answer has an empty or non-string reason"
    return None


def check_prioritize(
    out: object, feasible: list[str], rng: random.Random, feasible_set: frozenset[str] | set[str] | None = None
) -> tuple[str | None, str | None]:
    """(why the answer is unusable or None, the best host). `feasible_set`: `set(feasible)` if at hand."""
    if not isinstance(out, list):
        return f"prioritize answer is a {type(out).__name__}, not a bare array", None
    if not out:
        return None, rng.choice(feasible)  # no opinion: any survivor
    try:
        hosts = list(map(_HOST, out))
        scores = list(map(_SCORE, out))
        if set(map(type, scores)) != {int} or min(scores) < 0 or max(scores) > 10:
            return "prioritize score out of range 0..10 or not an integer", None
        # the same list in the same order (what vramsched answers) is trivially within what was
        # sent: one pass of string comparisons instead of hashing thousands of fresh strings
        if hosts != feasible and not set(hosts) <= (set(feasible) if feasible_set is None else feasible_set):
            return "prioritize scored a node that was not sent", None
    except (KeyError, TypeError) as exc:
        return f"malformed prioritize entry: {exc!r}", None
    top = max(scores)
    start = rng.randrange(len(scores))  # a random one among the best (in-tree scores would decide)
    try:
        i = scores.index(top, start)
    except ValueError:
        i = scores.index(top)
    return None, hosts[i]
