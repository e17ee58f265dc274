"""The pending pods of the load test: a realistic mix of LLM serving and fine-tuning pods.

Model memory 2-80 GiB over 1-8 GPUs, some restricted to GPU products, some asking for MIG
slices, a few that fit nowhere (they are part of real load: kube-scheduler retries them, and
filter must answer fast for them too). Shared by the locustfile and the hot-path benchmark.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from extender.demand import ALLOWED_PRODUCTS, MODEL_MEMORY

SCHEDULER_NAME = "vramsched"


@dataclass(frozen=True)
class PodKind:
    """One family of pods: `gpus` choices, model memory range in GiB (None: whole devices)."""

    stem: str
    weight: float
    resource: str = "nvidia.com/gpu"
    gpus: tuple[int, ...] = (1,)
    gib: tuple[int, int] | None = (2, 10)
    products: str | None = None


POD_KINDS: tuple[PodKind, ...] = (
    PodKind("embed", 0.14, gib=(2, 6)),
    PodKind("llm-7b", 0.18, gib=(6, 18)),
    PodKind("llm-14b-32b", 0.16, gib=(18, 40)),
    PodKind("llm-70b-int4", 0.08, gib=(40, 80)),
    PodKind("llm-70b-tp", 0.10, gpus=(2, 4), gib=(40, 80)),
    PodKind("finetune", 0.05, gpus=(4, 8), gib=(32, 80)),
    PodKind(
        "llm-hopper", 0.06, gpus=(1, 2), gib=(20, 80), products="NVIDIA-H100-80GB-HBM3,NVIDIA-H200"
    ),
    PodKind("mig-small", 0.10, resource="nvidia.com/mig-1g.10gb", gib=(2, 9)),
    PodKind("mig-notebook", 0.03, resource="nvidia.com/mig-1g.10gb", gib=None),
    PodKind("mig-medium", 0.03, resource="nvidia.com/mig-3g.40gb", gib=(16, 38)),
    PodKind("whole-gpu", 0.03, gib=None),
    # fits nowhere: no node has a 7g.80gb slice / no B200 in this fleet
    PodKind("mig-7g", 0.02, resource="nvidia.com/mig-7g.80gb", gib=(60, 78)),
    PodKind("llm-b200", 0.02, gib=(40, 80), products="NVIDIA-B200"),
)


def pod_kind(rng: random.Random) -> PodKind:
    return rng.choices(POD_KINDS, weights=[k.weight for k in POD_KINDS])[0]


def make_pod(
    rng: random.Random, name: str, namespace: str = "loadtest", uid: str | None = None
) -> dict[str, Any]:
    """A pending pod (no nodeName) of a random kind, as kube-scheduler sends it to the extender."""
    kind = pod_kind(rng)
    count = rng.choice(kind.gpus)
    annotations: dict[str, str] = {}
    if kind.gib is not None:
        annotations[MODEL_MEMORY] = f"{rng.randint(*kind.gib)}Gi"
    if kind.products:
        annotations[ALLOWED_PRODUCTS] = kind.products
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"{rng.getrandbits(64):016x}-{name}",
            "labels": {"app": kind.stem},
            "annotations": annotations,
        },
        "spec": {
            "schedulerName": SCHEDULER_NAME,
            "priority": 0,
            "containers": [
                {
                    "name": "server",
                    "image": "vllm/vllm-openai:v0.6.4",
                    "resources": {
                        "requests": {"cpu": "4", "memory": "32Gi", kind.resource: str(count)},
                        "limits": {kind.resource: str(count)},
                    },
                }
            ],
        },
        "status": {"phase": "Pending"},
    }
