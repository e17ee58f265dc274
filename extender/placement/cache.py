"""Caches kept with the ledger's device arrays, per demand shape: dropped with the arrays when
the inventory changes (a rebuild makes new arrays), and bounded so odd demands cannot grow them."""

from __future__ import annotations

from extender.ledger import DeviceArrays

SHAPES_KEPT = 256


#: demand shapes whose scores are kept (10 KB each at 5,000 nodes): the load test's pod mix has
#: ~480, and emptying the cache every 256 new shapes threw away the frequent ones too
SCORE_SHAPES_KEPT = 1024


def shape_cache(a: DeviceArrays, name: str, limit: int | None = None) -> dict:
    """A per-demand-shape cache kept with the arrays (dropped with them on a rebuild), emptied on
    the access after it reaches `limit` (SHAPES_KEPT) entries, so odd demands cannot
    grow it."""
    cache = a.derived.setdefault(name, {})
    if len(cache) >= (limit or SHAPES_KEPT):
        cache.clear()
    return cache
