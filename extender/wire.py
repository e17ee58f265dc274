"""The kube-scheduler extender wire types (k8s.io/kube-scheduler/extender/v1), keys exact.

The Go structs have no json tags, so the JSON keys are the Go field names in PascalCase.
Embedded Kubernetes objects (Pod, Node) stay plain dicts: the core reads the few fields it
needs, and validating a whole PodSpec on every call would cost more than the decision.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, RootModel

__all__ = [
    "VERBS",
    "MIN_PRIORITY",
    "MAX_PRIORITY",
    "NodeList",
    "ExtenderArgs",
    "ExtenderFilterResult",
    "HostPriority",
    "HostPriorityList",
    "ExtenderBindingArgs",
    "ExtenderBindingResult",
    "MetaPod",
    "MetaVictims",
    "Victims",
    "ExtenderPreemptionArgs",
    "ExtenderPreemptionResult",
]

VERBS = ("filter", "prioritize", "bind", "preempt")
MIN_PRIORITY = 0
MAX_PRIORITY = 10

_IN = ConfigDict(extra="ignore", strict=True)
_OUT = ConfigDict(extra="forbid")
Name = Annotated[str, Field(max_length=253)]


class NodeList(BaseModel):
    """v1.NodeList; only `items` matters to us, the rest is passed through untouched."""

    model_config = ConfigDict(extra="allow", strict=True)
    items: list[dict[str, Any]] = Field(default_factory=list)


class ExtenderArgs(BaseModel):
    """Body of filter and prioritize. `Nodes` when nodeCacheCapable=false, else `NodeNames`."""

    model_config = _IN
    Pod: dict[str, Any]
    Nodes: NodeList | None = None
    NodeNames: list[Name] | None = None


class ExtenderFilterResult(BaseModel):
    model_config = _OUT
    Nodes: NodeList | None = None
    NodeNames: list[str] | None = None
    FailedNodes: dict[str, str] = Field(default_factory=dict)
    FailedAndUnresolvableNodes: dict[str, str] = Field(default_factory=dict)
    Error: str = ""


class HostPriority(BaseModel):
    model_config = _OUT
    Host: str
    Score: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)]


class HostPriorityList(RootModel[list[HostPriority]]):
    """Prioritize answers with a bare JSON array, not an object."""


class ExtenderBindingArgs(BaseModel):
    model_config = _IN
    PodName: Name
    PodNamespace: Name
    PodUID: Annotated[str, Field(max_length=128)] = ""
    Node: Name


class ExtenderBindingResult(BaseModel):
    model_config = _OUT
    Error: str = ""


class MetaPod(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    UID: str


class MetaVictims(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    Pods: list[MetaPod] = Field(default_factory=list)
    NumPDBViolations: int = 0


class Victims(BaseModel):
    """Full-pod victims, sent when nodeCacheCapable=false."""

    model_config = ConfigDict(extra="ignore", strict=True)
    Pods: list[dict[str, Any]] = Field(default_factory=list)
    NumPDBViolations: int = 0


class ExtenderPreemptionArgs(BaseModel):
    model_config = _IN
    Pod: dict[str, Any]
    NodeNameToVictims: dict[str, Victims] | None = None
    NodeNameToMetaVictims: dict[str, MetaVictims] | None = None


class ExtenderPreemptionResult(BaseModel):
    """Always the Meta form, whatever nodeCacheCapable is."""

    model_config = _OUT
    NodeNameToMetaVictims: dict[str, MetaVictims] = Field(default_factory=dict)
