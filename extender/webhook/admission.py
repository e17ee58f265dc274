"""The admission decision for a pod (pure): AdmissionReview in, AdmissionReview out.

For pods with vramsched's schedulerName, at CREATE:

* refuse a pod the extender's filter would refuse anyway (an invalid vramsched.io/model-memory,
  several GPU resources, ...) with the filter's own message, and invalid vramsched.io/engine
  or vramsched.io/engine-args values;
* when the pod names its model (vramsched.io/model, or the engine's own --model flag) and
  declares no model-memory, fill it from the estimator and say so in a warning;
* warn when the declared memory is below what the pod's own engine settings need at the
  least (it would run out of memory), when no GPU in the cluster is big enough, and when the
  model cannot be sized;
* point VRAMSCHED_GPU_MEMORY_FRACTION at the bind-time fraction annotation (downward API) in
  every GPU container of a pod that declares its memory, and with vramsched.io/engine-args:
  inject, append the engine's flag to the container's args.

Other pods and other operations are allowed untouched: the webhook configuration cannot
select on spec.schedulerName on every Kubernetes version, so this check is the scope.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from extender.demand import MAX_MODEL_MEMORY, MODEL_MEMORY, DemandError, pod_demand
from extender.quantity import format_bytes
from extender.sizing import catalogue
from extender.sizing.engine_args import (
    ENGINE_ANNOTATION_VALUES,
    Invocation,
    flag_names,
    parse_container,
)
from extender.sizing.engines import ENGINE_ENV, FLAGS, EngineSettings
from extender.sizing.errors import SizingError
from extender.sizing.estimate import SMALL_GPU, Estimate, Model, estimate, format_quantity
from extender.sizing.handoff import (
    ENGINE_ANNOTATION,
    ENGINE_ARGS_ANNOTATION,
    FRACTION_ENV,
    FRACTION_FIELD_PATH,
    MODEL_ANNOTATION,
    engine_hint,
    gpu_containers,
    pod_engine,
)

__all__ = ["Decision", "decide", "review", "ReviewError", "LargestDevice"]

#: The largest device memory of the cluster (None: not known, e.g. before the first sync).
LargestDevice = Callable[[], int | None]


class ReviewError(ValueError):
    """A request that is not an AdmissionReview (answered with HTTP 400)."""


@dataclass
class Decision:
    allowed: bool = True
    message: str = ""
    patch: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _named(pod: Mapping[str, Any], namespace: str) -> dict[str, Any]:
    """A copy with the name and namespace the API server will give it, for messages:
    pods from a ReplicaSet arrive with generateName only."""
    out = copy.deepcopy(dict(pod))
    meta = dict(out.get("metadata") or {})
    if not meta.get("name"):
        meta["name"] = f"{meta.get('generateName') or 'pod-'}*"
    meta.setdefault("namespace", namespace or "default")
    if not meta.get("namespace"):
        meta["namespace"] = namespace or "default"
    out["metadata"] = meta
    return out


def _annotations(pod: Mapping[str, Any]) -> dict[str, Any]:
    ann = (pod.get("metadata") or {}).get("annotations")
    return dict(ann) if isinstance(ann, Mapping) else {}


def _validate_annotations(ann: Mapping[str, Any]) -> str | None:
    engine = ann.get(ENGINE_ANNOTATION)
    if engine is not None and str(engine).strip().lower() not in ENGINE_ANNOTATION_VALUES:
        return f"annotation {ENGINE_ANNOTATION}={str(engine)[:40]!r} is invalid: expected one of {', '.join(ENGINE_ANNOTATION_VALUES)}"
    args = ann.get(ENGINE_ARGS_ANNOTATION)
    if args is not None and str(args).strip().lower() not in ("inject", "none", ""):
        return f"annotation {ENGINE_ARGS_ANNOTATION}={str(args)[:40]!r} is invalid: expected inject or none"
    return None


def _settings(invocation: Invocation | None, ann: Mapping[str, Any]) -> EngineSettings:
    if invocation is not None:
        return invocation.settings
    engine = str(ann.get(ENGINE_ANNOTATION) or "vllm").strip().lower()
    return EngineSettings(engine=engine if engine in ENGINE_ANNOTATION_VALUES else "vllm")


def _summary(e: Estimate) -> str:
    seqs = f"{e.sequences} sequence{'s' if e.sequences != 1 else ''}"
    return (
        f"{e.model.name} on {e.settings.engine}, context {e.context} x {seqs}: "
        f"weights {format_bytes(e.weights_per_gpu)} + KV {format_bytes(e.kv.per_gpu_bytes)} + "
        f"overhead {format_bytes(e.overhead.total)} per GPU"
    )


def _size(
    d: Decision,
    pod: dict[str, Any],
    ann: dict[str, Any],
    invocation: Invocation | None,
    gpus: int,
    largest: int | None,
) -> None:
    """Fill or check vramsched.io/model-memory from the estimate, adding warnings."""
    settings = _settings(invocation, ann)
    model = str(ann.get(MODEL_ANNOTATION) or settings.model or "").strip()
    if not model:
        return
    if not catalogue.is_known(model):
        try:
            catalogue.lookup(model)
        except SizingError as exc:
            d.warnings.append(
                f"vramsched: cannot size the pod: {exc}; set {MODEL_ANNOTATION} to a catalogue name or {MODEL_MEMORY} by hand"
            )
        return
    entry = catalogue.lookup(model)
    # Pipeline stages each hold some of the layers (estimated whole on every GPU, a model split
    # over GPUs too small for it would get an annotation no GPU meets); a draft model or LoRA
    # slots load more than the estimate counts (too small, the pod would run past its books).
    unestimated = [f"pipeline-parallel-size {settings.pp}"] if settings.pp > 1 else []
    unestimated += invocation.unestimated if invocation is not None else ()
    if unestimated:
        if ann.get(MODEL_MEMORY) is None:
            d.warnings.append(
                f"vramsched: {entry.name} runs with {', '.join(unestimated)}, which vramsched "
                f"does not estimate: {MODEL_MEMORY} is left unset and the pod holds whole GPUs; "
                "set it by hand to share them"
            )
        return
    resolved = _catalogue_model(entry)
    names = flag_names(settings.engine) if invocation is not None else None
    try:
        conservative = estimate(resolved, settings, list_devices=False, names=names)
        least = estimate(resolved, settings, gpu_memory=SMALL_GPU, list_devices=False, names=names)
    except SizingError as exc:
        d.warnings.append(f"vramsched: cannot size {entry.name}: {exc}")
        return
    if settings.tp > gpus:
        d.warnings.append(
            f"vramsched: {entry.name} runs with tensor-parallel-size {settings.tp} but the pod requests {gpus} GPU(s)"
        )
    declared = ann.get(MODEL_MEMORY)
    pod_total = conservative.reservation_per_gpu * gpus
    if declared is None:
        why_not = _why_not_filled(entry.name, settings, invocation, ann, pod_total, conservative)
        if why_not is not None:
            d.warnings.append(why_not)
            return
        value = format_quantity(pod_total)
        if isinstance((pod.get("metadata") or {}).get("annotations"), Mapping):  # even empty
            d.patch.append(
                {
                    "op": "add",
                    "path": f"/metadata/annotations/{_escape(MODEL_MEMORY)}",
                    "value": value,
                }
            )
        else:
            d.patch.append(
                {"op": "add", "path": "/metadata/annotations", "value": {MODEL_MEMORY: value}}
            )
        ann[MODEL_MEMORY] = value
        d.warnings.append(
            f"vramsched: set {MODEL_MEMORY}={value} from the estimate ({_summary(conservative)})"
        )
    else:
        if _unwired(invocation, ann):
            d.warnings.append(
                f"vramsched: {settings.engine} is not given its share of the GPU "
                f"({FLAGS[settings.engine]}): it runs at its default and may take more than "
                f"{MODEL_MEMORY}={declared}; {_handoff(settings.engine)}"
            )
        per_gpu = pod_demand(pod).bytes_per_gpu or 0
        if per_gpu < least.total_per_gpu:
            d.warnings.append(
                f"vramsched: {MODEL_MEMORY}={declared} gives {format_bytes(per_gpu)} per GPU, below the "
                f"{format_bytes(least.total_per_gpu)} {entry.name} needs at the least ({settings.engine}, context "
                f"{least.context} x {least.sequences}): the pod would run out of GPU memory"
            )
    if largest is not None and conservative.reservation_per_gpu > largest:
        d.warnings.append(
            f"vramsched: {entry.name} needs {format_bytes(conservative.reservation_per_gpu)} per GPU; "
            f"the largest GPU in the cluster has {format_bytes(largest)}: it fits no GPU"
        )


def _inject_asked(ann: Mapping[str, Any]) -> bool:
    """The pod asks the webhook to append the engine's memory flag (`engine-args: inject`)."""
    return str(ann.get(ENGINE_ARGS_ANNOTATION) or "").strip().lower() == "inject"


def _handoff(engine: str) -> str:
    """The two ways to give `engine` the share vramsched hands it."""
    return f"set {ENGINE_ARGS_ANNOTATION}: inject or pass {FLAGS[engine]}=$({FRACTION_ENV})"


def _takes_share(own: Invocation, inject_args: bool) -> bool:
    """The container's engine will run at the fraction vramsched hands it: its memory flag
    reads a variable, or the webhook appends the flag (asked, and not into a shell script; a
    flag of its own is either written out or read from a variable)."""
    return own.fixed_fraction is None and (
        own.fraction_from_variable or (inject_args and not own.shell)
    )


def _unwired(invocation: Invocation | None, ann: Mapping[str, Any]) -> bool:
    """A recognised engine that will run at its own default share of the GPU: no memory flag
    written out, and not at the share vramsched hands it (`_takes_share`)."""
    return (
        invocation is not None
        and invocation.fixed_fraction is None
        and not _takes_share(invocation, _inject_asked(ann))
    )


def _why_not_filled(
    name: str,
    settings: EngineSettings,
    invocation: Invocation | None,
    ann: Mapping[str, Any],
    pod_total: int,
    conservative: Estimate,
) -> str | None:
    """Why the estimate must not become the pod's model-memory, or None. Unset, the pod holds
    whole GPUs, which covers whatever the engine takes; set, the engine must stay inside it."""
    flag = FLAGS[settings.engine]
    estimate_text = f"the estimate ({format_bytes(pod_total)})"
    whole = f"{MODEL_MEMORY} is left unset and the pod holds whole GPUs"
    fixed = invocation.fixed_fraction if invocation is not None else None
    if fixed is not None:
        return (
            f"vramsched: {name} is given {flag} {fixed} in the pod, so {settings.engine} takes "
            f"that share of whichever GPU the pod lands on, not {estimate_text}; {whole}. To "
            f"share GPUs, drop the flag and set {ENGINE_ARGS_ANNOTATION}: inject"
        )
    if _unwired(invocation, ann):
        # vLLM's default is 0.9 (0.92 from v0.20), TGI's 1.0: booked by the estimate, the
        # engine would take the memory of the pods beside it
        return (
            f"vramsched: {name} would run at {settings.engine}'s default {flag}, a share of "
            f"the whole GPU, not {estimate_text}; {whole}. To share GPUs, "
            f"{_handoff(settings.engine)}"
        )
    if pod_total > MAX_MODEL_MEMORY:
        # the filter refuses more than this: set, the pod would wait on an annotation the
        # user never wrote
        return (
            f"vramsched: cannot size {name}: the estimate, {format_bytes(pod_total)} "
            f"({_summary(conservative)}), is more than the {format_bytes(MAX_MODEL_MEMORY)} "
            f"{MODEL_MEMORY} takes; lower the engine's context or sequences"
        )
    return None


def _catalogue_model(entry: catalogue.Entry) -> Model:
    """The catalogue entry as an estimate input; the webhook never reads a path it is given."""
    return Model(
        entry.name,
        entry.architecture,
        entry.checkpoint_bytes,
        "vramsched catalogue",
        entry.lm_head_stored,
    )


def _inject(
    d: Decision, pod: Mapping[str, Any], ann: Mapping[str, Any], invocation: Invocation | None
) -> None:
    """The downward-API env var in every GPU container, what its engine needs beside the flag
    to take what the estimate counts (`ENGINE_ENV`), and the engine flag when asked."""
    inject_args = _inject_asked(ann)
    engine = invocation.engine if invocation is not None else None
    hint = engine_hint(pod)
    for i, c in gpu_containers(pod):
        env = c.get("env") if isinstance(c.get("env"), list) else None
        names = {e.get("name") for e in env or [] if isinstance(e, Mapping)}
        adds: list[dict[str, Any]] = []
        if FRACTION_ENV not in names:
            adds.append(
                {
                    "name": FRACTION_ENV,
                    "valueFrom": {"fieldRef": {"fieldPath": FRACTION_FIELD_PATH}},
                }
            )
        own = parse_container(c, hint)
        if own is not None and _takes_share(own, inject_args):
            for key, value in ENGINE_ENV.get(own.engine, {}).items():
                if key not in names:  # the container's own setting stands
                    adds.append({"name": key, "value": value})
        if adds and env is None:
            d.patch.append({"op": "add", "path": f"/spec/containers/{i}/env", "value": adds})
        else:
            for var in adds:
                d.patch.append({"op": "add", "path": f"/spec/containers/{i}/env/-", "value": var})
        if not inject_args:
            continue
        name = c.get("name", i)
        if engine is None:
            d.warnings.append(
                f"vramsched: container {name}: no vLLM, TGI or SGLang command recognised; set {ENGINE_ANNOTATION}"
            )
            continue
        flag = FLAGS[engine]
        tokens = [str(t) for t in (c.get("command") or []) + (c.get("args") or [])]
        if any(t == flag or t.startswith(flag + "=") for t in tokens) or flag in " ".join(tokens):
            d.warnings.append(f"vramsched: container {name} already sets {flag}; not injected")
            continue
        if invocation is not None and invocation.shell:
            d.warnings.append(
                f"vramsched: container {name} runs {engine} in a shell; add {flag}=${FRACTION_ENV} to its script"
            )
            continue
        value = f"{flag}=$({FRACTION_ENV})"
        if isinstance(c.get("args"), list):
            d.patch.append({"op": "add", "path": f"/spec/containers/{i}/args/-", "value": value})
        elif c.get("command"):
            d.patch.append({"op": "add", "path": f"/spec/containers/{i}/args", "value": [value]})
        else:
            d.warnings.append(
                f"vramsched: container {name} has no command or args to append {flag} to"
            )


def decide(
    pod: Mapping[str, Any],
    *,
    namespace: str = "",
    scheduler_name: str = "vramsched",
    largest_device: LargestDevice | None = None,
) -> Decision:
    """What to do with a pod being created."""
    d = Decision()
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if not isinstance(spec, Mapping) or spec.get("schedulerName") != scheduler_name:
        return d
    named = _named(pod, namespace)
    ann = _annotations(named)
    problem = _validate_annotations(ann)
    if problem is None:
        try:
            demand = pod_demand(named)
        except DemandError as exc:
            problem = str(exc)
    if problem is not None:
        return Decision(False, problem)
    invocation = pod_engine(named)
    if demand.gpu_count:
        _size(
            d,
            named,
            ann,
            invocation,
            demand.gpu_count,
            largest_device() if largest_device else None,
        )
    if demand.gpu_count and ann.get(MODEL_MEMORY) is not None:
        _inject(d, named, ann, invocation)
    return d


def review(
    body: Any,
    *,
    scheduler_name: str = "vramsched",
    largest_device: LargestDevice | None = None,
) -> dict[str, Any]:
    """An AdmissionReview answer for an AdmissionReview request (v1 or v1beta1)."""
    if not isinstance(body, Mapping) or body.get("kind") != "AdmissionReview":
        raise ReviewError("body is not an AdmissionReview")
    request = body.get("request")
    if not isinstance(request, Mapping) or not request.get("uid"):
        raise ReviewError("AdmissionReview has no request.uid")
    api_version = str(body.get("apiVersion") or "admission.k8s.io/v1")
    response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
    kind = (
        (request.get("kind") or {}).get("kind")
        if isinstance(request.get("kind"), Mapping)
        else None
    )
    pod = request.get("object")
    if kind == "Pod" and request.get("operation") == "CREATE" and isinstance(pod, Mapping):
        d = decide(
            pod,
            namespace=str(request.get("namespace") or ""),
            scheduler_name=scheduler_name,
            largest_device=largest_device,
        )
        response["allowed"] = d.allowed
        if not d.allowed:
            response["status"] = {"code": 400, "reason": "BadRequest", "message": d.message}
        if d.patch:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(orjson.dumps(d.patch)).decode()
        if d.warnings:
            response["warnings"] = d.warnings
    return {"apiVersion": api_version, "kind": "AdmissionReview", "response": response}
