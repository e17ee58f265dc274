"""Fit, filter, score, choose and preempt: the greedy placement core shared by every adapter.

All per-node work is done on the ledger's device arrays with numpy, so one filter or
prioritize call over thousands of candidate nodes is a handful of vector operations;
Python only loops over the nodes it must explain.

- `fit`: one demand against the devices (sizes, products, free VRAM and replicas, the device
  plugin's node-level bound);
- `filter`: which candidate nodes can take the pod now, and `reasons` for the others
  (`outcome` holds the answer);
- `score`: prioritize's best-fit bands, kept per demand shape and patched where nodes changed;
- `choose`: the devices a bind takes on one node;
- `preempt`: the fewest victims that make room, for kube-scheduler's preempt verb and for
  vramsched's own preemption by VRAM (`plan_preemption`); `nominated`: the room kept for the
  pods kube-scheduler nominated to a node after preempting for them;
- `views` and `cache`: the per-resource and per-node views of the arrays, and what is derived
  from them and kept with them.

Imports run one way: outcome, cache, views, fit, reasons, filter, choose, score (preempt needs
fit and choose; nominated, filter and choose); callers import from this package, which re-exports the
public names.
"""

from extender.placement.choose import books_demand, choose_devices, plugin_allows
from extender.placement.filter import filter_nodes
from extender.placement.fit import device_need
from extender.placement.nominated import held_for_nominated
from extender.placement.outcome import FilterOutcome, SharedReasons
from extender.placement.preempt import HostRoom, PreemptionPlan, plan_preemption, preempt_victims
from extender.placement.reasons import ReasonKind
from extender.placement.score import MAX_SCORE, score_nodes, score_rows
from extender.placement.views import row_counts, warm

__all__ = [
    "FilterOutcome",
    "SharedReasons",
    "ReasonKind",
    "filter_nodes",
    "score_nodes",
    "choose_devices",
    "books_demand",
    "plugin_allows",
    "preempt_victims",
    "plan_preemption",
    "PreemptionPlan",
    "HostRoom",
    "held_for_nominated",
    "MAX_SCORE",
    "device_need",
    "score_rows",
    "row_counts",
    "warm",
]
