"""How much of each GPU model's free memory the pods limited to some models will need.

Some pods run only on certain GPU models (`Demand.allowed_products`: a node affinity on
`nvidia.com/gpu.product`, the trace's `gpu_spec`). FGD's measure cannot protect them: it counts a
node's free memory as stranded for every pod type that cannot use its model, so a rarely allowed
model looks like the most fragmented place, and filling it with pods that could have gone anywhere
looks like *less* fragmentation. The pods that can run only there then find it full.

The *pressure* on a model is what the workload's limited pods will ask of it against what it has:
the share of the workload's GPU memory asked by pods limited to a set of models, spread over the
set's models in proportion to their free memory, times all free GPU memory, divided by the model's
free memory. At 1 the limited pods, arriving in the workload's proportions until the cluster is
full, would need all of it. The planner's one-pod rule (`greedy.fgd_packed`) keeps a pod that has a
choice off the models pressed well above its least pressed one and breaks its ties toward the
least pressed (`PRESSURE_SLACK`, `PRESSURE_TIE`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from extender.ledger import DeviceArrays

__all__ = ["ProductPressure"]


class ProductPressure:
    """Pressure per product id of `arrays`, from the limited pod sets' device masks and shares.

    `limited` holds, per set of allowed models, the devices those pods may use and the share of
    the workload's GPU memory they ask (summing to at most 1 with the unlimited pods' share)."""

    def __init__(self, arrays: DeviceArrays, limited: Sequence[tuple[np.ndarray, float]]) -> None:
        self.a = arrays
        self.limited = [(mask, share) for mask, share in limited if share > 0 and mask.any()]
        self.n_products = int(arrays.product_id.max()) + 1 if len(arrays.product_id) else 0

    @property
    def active(self) -> bool:
        """False when no pod of the workload is limited to some models: every pressure is 0."""
        return bool(self.limited)

    def per_product(self) -> np.ndarray:
        """(products,) float: the pressure on each product id now (inf where nothing is free)."""
        a = self.a
        free = np.maximum(a.free, 0).astype(np.float64)
        P = self.n_products
        by_product = np.bincount(a.product_id, free, P)
        asked = np.zeros(P, np.float64)
        for mask, share in self.limited:
            here = np.bincount(a.product_id[mask], free[mask], P)
            total = here.sum()
            if total > 0:
                asked += share * here / total
        with np.errstate(divide="ignore", invalid="ignore"):
            out: np.ndarray = np.where(by_product > 0, asked * free.sum() / by_product, np.inf)
        return out
