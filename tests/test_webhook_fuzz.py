"""Property: whatever a user writes into a pod (engine command lines and flags, TGI's environment,
vramsched's annotations, GPU requests), the admission webhook answers it: it allows the pod,
with a JSON patch that applies to the pod as sent and only adds, or it refuses it with a message.
It never raises, so no pod creation falls back on the webhook's failure policy.

The pods are typed as the API server sends them (lists of strings, maps of strings), since the
API server decodes and validates a pod before any mutating webhook sees it; the values are
adversarial. A `--dtype fp8` on a 16-bit model once ended in an UnboundLocalError here."""

from __future__ import annotations

import base64
import json
from typing import Any

from builders import apply_json_patch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extender.demand import ALLOWED_PRODUCTS, MODEL_MEMORY, pod_demand
from extender.sizing import catalogue
from extender.sizing.engine_args import _FLAGS
from extender.sizing.handoff import (
    ENGINE_ANNOTATION,
    ENGINE_ARGS_ANNOTATION,
    FRACTION_ENV,
    MODEL_ANNOTATION,
)
from extender.webhook.admission import review

MODELS = [e.name for e in catalogue.entries()]
FLAGS = sorted({f for names in _FLAGS.values() for f in names} | {"--enforce-eager"})
VALUES = st.one_of(
    st.sampled_from(
        ["0", "1", "2", "3", "8", "-1", "4096", "131072", "99999999999999999999", "1e9", "nan"]
        + ["auto", "bf16", "bfloat16", "half", "fp8", "int8", "awq", "gptq", "awq_marlin"]
        + ["fp8_e5m2", "bitsandbytes-nf4", "$(MODEL)", "$HOME", "", " ", "=", "--"]
    ),
    st.sampled_from(MODELS),
    st.text(max_size=12),
)


def mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Three draws in four from `good`: a pod refused early never reaches the sizing."""
    return st.one_of(good, good, good, bad)


#: per engine field, values an engine takes and values it does not
FIELD_VALUES = {
    "model": st.sampled_from(MODELS),
    "dtype": st.sampled_from(["auto", "bf16", "bfloat16", "half", "fp16", "fp8", "int8", "fp4"]),
    "quantization": st.sampled_from(["awq", "gptq", "fp8", "awq_marlin", "none", "int3"]),
    "kv_cache_dtype": st.sampled_from(["auto", "fp8", "fp8_e5m2", "int2"]),
}
NUMBERS = st.sampled_from(
    ["1", "2", "4", "8", "3", "0", "-1", "8192", "131072", "100000", "10" * 12, "9" * 400]
    + ["32k", "32K", "1.5K", "0.001k", "auto", "9" * 400 + "k", "2T"]
)
PAIRS = st.sampled_from(sorted({(f, fld) for names in _FLAGS.values() for f, fld in names.items()}))


@st.composite
def flag_tokens(draw: st.DrawFn) -> list[str]:
    """An engine flag with a value for its field (or any value), as two words or `--f=v`."""
    flag, field = draw(PAIRS)
    value = draw(mostly(FIELD_VALUES.get(field, NUMBERS), VALUES))
    return [f"{flag}={value}"] if draw(st.booleans()) else [flag, value]


TOKENS = st.lists(
    mostly(flag_tokens(), st.lists(st.one_of(st.sampled_from(FLAGS), VALUES), max_size=2)),
    max_size=6,
).map(lambda groups: [t for g in groups for t in g])
COMMANDS = st.sampled_from(
    [
        None,
        ["vllm", "serve"],
        ["/usr/local/bin/vllm", "serve"],
        ["python3", "-m", "vllm.entrypoints.openai.api_server"],
        ["text-generation-launcher"],
        ["python3", "-m", "sglang.launch_server"],
        ["sh", "-c"],
        ["bash", "-c"],
        ["sleep"],
    ]
)
IMAGES = st.sampled_from(
    [
        "vllm/vllm-openai:v0.10.1",
        "ghcr.io/huggingface/text-generation-inference:3.3",
        "lmsysorg/sglang:latest",
        "busybox",
        "",
    ]
)
QUANTITIES = st.one_of(
    st.sampled_from(["1", "2", "8", "0", "-1", "1.5", "16Gi", "1e3", "99999999999999999999"]),
    st.text(max_size=6),
)
RESOURCES = st.sampled_from(
    ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb", "cpu", "memory"]
)
GOOD_GPUS = st.sampled_from(["1", "2", "4", "8"]).map(lambda n: {"nvidia.com/gpu": n})


ANNOTATION_VALUES = {
    MODEL_MEMORY: mostly(
        st.sampled_from(["16Gi", "20000Mi", "40Gi", "80Gi", "1Gi"]),
        st.one_of(st.sampled_from(["0", "-1Gi", "1Ei", "16Gx", "1e400", "nan"]), st.text()),
    ),
    MODEL_ANNOTATION: mostly(st.sampled_from(MODELS), st.text(max_size=20)),
    ENGINE_ANNOTATION: mostly(st.sampled_from(["vllm", "TGI", "sglang", " vllm "]), st.text()),
    ENGINE_ARGS_ANNOTATION: mostly(st.sampled_from(["inject", "none", "", "Inject"]), st.text()),
    ALLOWED_PRODUCTS: mostly(
        st.sampled_from(["NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB,NVIDIA-L4"]),
        st.one_of(st.sampled_from([",", ""]), st.text(max_size=10)),
    ),
}
TGI_ENV = st.sampled_from(
    ["MODEL_ID", "MAX_TOTAL_TOKENS", "NUM_SHARD", "QUANTIZE", "DTYPE", FRACTION_ENV, "OTHER"]
)


@st.composite
def containers(draw: st.DrawFn) -> dict[str, Any]:
    c: dict[str, Any] = {"name": draw(st.text(min_size=1, max_size=8)), "image": draw(IMAGES)}
    command = draw(COMMANDS)
    tokens = draw(TOKENS)
    if command is not None:
        if command[-1] == "-c":  # a shell script: the engine's line as one string
            line = draw(st.sampled_from(["vllm serve", "python -m sglang.launch_server"]))
            c["command"] = [*command, " ".join([line, *tokens])]
        else:
            c["command"] = list(command)
    if command is None or command[-1] != "-c":
        if draw(st.booleans()):
            c["args"] = tokens
    if draw(st.booleans()):
        c["env"] = draw(
            st.lists(st.builds(lambda n, v: {"name": n, "value": v}, TGI_ENV, VALUES), max_size=3)
        )
    limits = draw(mostly(GOOD_GPUS, st.dictionaries(RESOURCES, QUANTITIES, max_size=2)))
    if limits:
        c["resources"] = {"limits": limits}
    return c


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    meta: dict[str, Any] = {"generateName": "engine-"}
    annotations = draw(
        st.fixed_dictionaries({}, optional={k: v for k, v in ANNOTATION_VALUES.items()})
    )
    if annotations or draw(st.booleans()):
        meta["annotations"] = annotations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "schedulerName": "vramsched",
            "containers": draw(st.lists(containers(), min_size=1, max_size=3)),
        },
    }


ENGINE_LINES = {
    "vllm": (["vllm", "serve"], "vllm/vllm-openai:v0.10.1"),
    "tgi": (["text-generation-launcher"], "ghcr.io/huggingface/text-generation-inference:3.3"),
    "sglang": (["python3", "-m", "sglang.launch_server"], "lmsysorg/sglang:latest"),
}


@st.composite
def engine_pods(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed engine pod of a catalogue model with a few of its engine's flags, valid or
    not: the pods that reach the sizing, where most of the webhook's work is."""
    engine = draw(st.sampled_from(sorted(ENGINE_LINES)))
    command, image = ENGINE_LINES[engine]
    args: list[str] = []
    for flag, field in draw(st.lists(st.sampled_from(sorted(_FLAGS[engine].items())), max_size=4)):
        value = draw(mostly(FIELD_VALUES.get(field, NUMBERS), VALUES))
        args += [f"{flag}={value}"] if draw(st.booleans()) else [flag, value]
    container = {
        "name": "engine",
        "image": image,
        "command": command,
        "args": args,
        "resources": {"limits": draw(GOOD_GPUS)},
    }
    annotations = {MODEL_ANNOTATION: draw(st.sampled_from(MODELS))}
    if draw(st.booleans()):
        annotations[MODEL_MEMORY] = draw(ANNOTATION_VALUES[MODEL_MEMORY])
    if draw(st.booleans()):
        annotations[ENGINE_ARGS_ANNOTATION] = "inject"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "engine-", "annotations": annotations},
        "spec": {"schedulerName": "vramsched", "containers": [container]},
    }


def admission_review(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": "CREATE",
            "namespace": "default",
            "object": pod,
        },
    }


@settings(
    max_examples=1000,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(pod=st.one_of(pods(), engine_pods()), largest=st.sampled_from([None, 16 << 30, 80 << 30]))
def test_every_pod_gets_an_answer_whose_patch_applies(
    pod: dict[str, Any], largest: int | None
) -> None:
    answer = review(admission_review(pod), largest_device=lambda: largest)
    json.dumps(answer)  # the wire form is JSON
    response = answer["response"]
    assert response["uid"] == "u-1" and isinstance(response["allowed"], bool)
    if not response["allowed"]:
        message = response["status"]["message"]
        assert message and "\n" not in message
        assert "patch" not in response
        return
    assert all(isinstance(w, str) and w for w in response.get("warnings", []))
    if "patch" in response:
        assert response["patchType"] == "JSONPatch"
        ops = json.loads(base64.b64decode(response["patch"]))
        assert ops and all(op["op"] == "add" for op in ops)
        patched = apply_json_patch(pod, ops)  # only adds, and never over a member already there
        # What the webhook set, the scheduler's filter reads (a DemandError fails the test).
        pod_demand({**patched, "metadata": {**patched["metadata"], "name": "engine-1"}})
        for before, after in zip(pod["spec"]["containers"], patched["spec"]["containers"]):
            had = [e.get("name") for e in before.get("env", [])].count(FRACTION_ENV)
            has = [e.get("name") for e in after.get("env", [])].count(FRACTION_ENV)
            assert has == had or (had == 0 and has == 1)  # added once, and only where missing
