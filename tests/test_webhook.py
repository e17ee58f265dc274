"""The admission webhook's decisions, its AdmissionReview wire form, its TLS listener and certs."""

from __future__ import annotations

import base64
import datetime as dt
import json
import ssl
from typing import Any

import aiohttp
import builders
import pytest
from aiohttp import web
from builders import apply_json_patch

from extender.demand import DemandError, pod_demand
from extender.ledger import check_invariant
from extender.sizing.engine_args import parse_container
from extender.sizing.engines import FLAGS
from extender.webhook.admission import ReviewError, decide, review
from extender.webhook.certs import cert_covers, make_serving_cert, service_hosts
from extender.webhook.launch import largest_device
from extender.webhook.server import create_webhook_app, ssl_context

GIB = 1 << 30
FIELD = "metadata.annotations['vramsched.io/gpu-memory-fraction']"
FRACTION = "VRAMSCHED_GPU_MEMORY_FRACTION"


def pod(
    annotations: dict[str, str] | None = None,
    *,
    args: list[str] | None = None,
    command: list[str] | None = None,
    gpus: str = "1",
    scheduler: str = "vramsched",
    name: str = "p",
    env: list[dict[str, Any]] | None = None,
    handoff: bool = True,
) -> dict[str, Any]:
    """A pod of one engine container; `handoff`: its engine reads its memory flag from the
    fraction vramsched hands it, as a pod the webhook sizes must (appended to `args`)."""
    container: dict[str, Any] = {
        "name": "engine",
        "image": "vllm/vllm-openai:v0.10.1",
        "resources": {"limits": {"nvidia.com/gpu": gpus}},
    }
    if args is not None:
        container["args"] = args
    if command is not None:
        container["command"] = command
    if env is not None:
        container["env"] = env
    found = parse_container(container)
    if handoff and args is not None and found is not None and not found.shell:
        container["args"] = [*args, f"{FLAGS[found.engine]}=$({FRACTION})"]
    meta: dict[str, Any] = {"name": name, "namespace": "default"}
    if annotations is not None:
        meta["annotations"] = annotations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"schedulerName": scheduler, "containers": [container]},
    }


# ----- decisions ----------------------------------------------------------------------------------


def test_pods_of_other_schedulers_are_untouched() -> None:
    d = decide(pod({"vramsched.io/model-memory": "lots"}, scheduler="default-scheduler"))
    assert d.allowed and not d.patch and not d.warnings


def test_invalid_model_memory_is_refused_with_the_filter_message() -> None:
    bad = pod({"vramsched.io/model-memory": "16GB"})
    with pytest.raises(DemandError) as filter_error:
        pod_demand(bad)
    d = decide(bad)
    assert not d.allowed
    assert d.message == str(filter_error.value)
    assert "vramsched.io/model-memory='16GB' is invalid" in d.message


def test_generate_name_pods_are_named_in_the_message() -> None:
    p = pod({"vramsched.io/model-memory": "-1Gi"})
    p["metadata"] = {"generateName": "qwen-7d9f-", "annotations": p["metadata"]["annotations"]}
    d = decide(p, namespace="team")
    assert not d.allowed and d.message.startswith("pod team/qwen-7d9f-*: ")


@pytest.mark.parametrize(
    ("key", "value"), [("vramsched.io/engine", "llama.cpp"), ("vramsched.io/engine-args", "yes")]
)
def test_invalid_engine_annotations_are_refused(key: str, value: str) -> None:
    d = decide(pod({"vramsched.io/model-memory": "16Gi", key: value}))
    assert not d.allowed and key in d.message


def test_named_model_gets_its_annotation_and_the_fraction_env() -> None:
    p = pod(
        {"vramsched.io/model": "Qwen/Qwen2.5-7B-Instruct"},
        command=["vllm", "serve"],
        args=["Qwen/Qwen2.5-7B-Instruct", "--max-model-len", "8192", "--max-num-seqs", "4"],
    )
    d = decide(p)
    assert d.allowed
    out = apply_json_patch(p, d.patch)
    memory = out["metadata"]["annotations"]["vramsched.io/model-memory"]
    assert memory.endswith("Gi") and 15 < float(memory[:-2]) < 25
    assert any(
        "set vramsched.io/model-memory=" in w and "Qwen/Qwen2.5-7B-Instruct" in w
        for w in d.warnings
    )
    assert out["spec"]["containers"][0]["env"] == [
        {"name": "VRAMSCHED_GPU_MEMORY_FRACTION", "valueFrom": {"fieldRef": {"fieldPath": FIELD}}},
        # vLLM 0.21 and later: CUDA graphs outside the fraction, as the estimate counts them
        {"name": "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "value": "0"},
    ]
    # The filled pod is one the filter accepts.
    assert pod_demand(out).bytes_per_gpu == int(float(memory[:-2]) * GIB)


def _env_of(p: dict[str, Any], d: Any) -> dict[str, Any]:
    out = apply_json_patch(p, d.patch)
    return {
        e["name"]: e.get("value", e.get("valueFrom"))
        for e in out["spec"]["containers"][0].get("env", [])
    }


def test_vllm_at_the_handed_share_keeps_cuda_graphs_outside_it() -> None:
    """From v0.21 vLLM takes its estimate of the CUDA graph pool out of the
    --gpu-memory-utilization budget; the fraction vramsched hands it counts the pool outside,
    as vLLM did before. Left at vLLM's default, the KV cache came out short by that pool (a
    pod sized for one full-length sequence would not start). The webhook sets the variable
    that keeps the graphs outside, only where vLLM takes vramsched's fraction."""
    graphs = "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"
    args = ["Qwen/Qwen2.5-7B-Instruct", "--max-model-len", "8192", "--max-num-seqs", "4"]
    declared = {"vramsched.io/model-memory": "24Gi"}
    # wired by the pod itself, or by the webhook on `inject`
    for p in (
        pod(declared, command=["vllm", "serve"], args=args),
        pod(
            {**declared, "vramsched.io/engine-args": "inject"},
            command=["vllm", "serve"],
            args=args,
            handoff=False,
        ),
    ):
        assert _env_of(p, decide(p))[graphs] == "0"
    # the container's own value stands
    p = pod(declared, command=["vllm", "serve"], args=args, env=[{"name": graphs, "value": "1"}])
    env = _env_of(p, decide(p))
    assert env[graphs] == "1" and "VRAMSCHED_GPU_MEMORY_FRACTION" in env
    # not where vLLM runs at its own share (written out, or its default), nor for other engines
    for p in (
        pod(
            declared,
            command=["vllm", "serve"],
            args=[*args, "--gpu-memory-utilization", "0.3"],
            handoff=False,
        ),
        pod(declared, command=["vllm", "serve"], args=args, handoff=False),
        pod(
            declared,
            command=["text-generation-launcher"],
            args=["--model-id", "Qwen/Qwen2.5-7B-Instruct"],
        ),
    ):
        assert graphs not in _env_of(p, decide(p))


def test_model_from_engine_args_without_annotations_and_two_gpus() -> None:
    p = pod(
        None,
        command=["vllm", "serve"],
        args=["Qwen/Qwen2.5-7B-Instruct", "--max-model-len", "8192", "-tp", "2"],
        gpus="2",
    )
    d = decide(p)
    out = apply_json_patch(p, d.patch)
    total = out["metadata"]["annotations"]["vramsched.io/model-memory"]
    per_gpu = pod_demand(out).bytes_per_gpu
    assert per_gpu is not None and per_gpu * 2 == int(float(total[:-2]) * GIB)


def test_an_empty_annotation_map_gets_a_key_added_not_the_map_replaced() -> None:
    """Found by tests/test_webhook_fuzz.py: an empty map was replaced by a whole new one."""
    p = pod({}, command=["vllm", "serve"], args=["Qwen/Qwen2.5-7B-Instruct"])
    d = decide(p)
    (added,) = [op for op in d.patch if op["path"].startswith("/metadata")]
    assert added["path"] == "/metadata/annotations/vramsched.io~1model-memory"
    assert list(apply_json_patch(p, d.patch)["metadata"]["annotations"]) == [
        "vramsched.io/model-memory"
    ]


def test_declared_memory_below_the_estimate_warns() -> None:
    p = pod(
        {"vramsched.io/model-memory": "8Gi"},
        command=["vllm", "serve"],
        args=["Qwen/Qwen2.5-7B-Instruct"],
    )
    d = decide(p)
    assert d.allowed
    assert any("would run out of GPU memory" in w for w in d.warnings)
    assert "vramsched.io/model-memory" not in json.dumps(
        [op for op in d.patch if op["path"].startswith("/metadata")]
    )


def test_declared_memory_large_enough_does_not_warn() -> None:
    p = pod(
        {"vramsched.io/model-memory": "40Gi"},
        command=["vllm", "serve"],
        args=["Qwen/Qwen2.5-7B-Instruct", "--max-model-len", "8192"],
    )
    assert decide(p).warnings == []


def test_unknown_model_warns_with_close_names_and_leaves_the_pod_alone() -> None:
    p = pod(None, command=["vllm", "serve"], args=["Qwen/Qwen2.5-7B-Instrct"])
    d = decide(p)
    assert d.allowed and d.patch == []
    (w,) = d.warnings
    assert "did you mean Qwen/Qwen2.5-7B-Instruct" in w


def test_context_too_long_warns() -> None:
    p = pod(
        None,
        command=["vllm", "serve"],
        args=["meta-llama/Meta-Llama-3-8B-Instruct", "--max-model-len", "65536"],
    )
    (w,) = decide(p).warnings
    assert "longer than the 8192 tokens" in w


@pytest.mark.parametrize(
    ("context", "memory"), [("32k", "26Gi"), ("32768", "26Gi"), ("auto", "38Gi"), ("-1", "38Gi")]
)
def test_vllm_human_readable_context_is_sized_as_vllm_reads_it(context: str, memory: str) -> None:
    """`--max-model-len 32k` (32,000 tokens to vLLM) was read as no flag: the pod was sized
    for Llama-3.1-8B's whole 131,072 tokens, 38Gi instead of 26Gi. `auto` lets vLLM fit the
    context to its memory, at most the model's own."""
    model = "meta-llama/Llama-3.1-8B-Instruct"
    p = pod(None, command=["vllm", "serve"], args=[model, "--max-model-len", context])
    patched = apply_json_patch(p, decide(p).patch)
    assert patched["metadata"]["annotations"]["vramsched.io/model-memory"] == memory


def test_vllm_kv_cache_memory_bytes_sizes_the_pod_and_too_little_warns() -> None:
    model = "meta-llama/Llama-3.1-8B-Instruct"
    args = [model, "--max-model-len", "32k", "--kv-cache-memory-bytes=8G"]
    p = pod(None, command=["vllm", "serve"], args=args)
    patched = apply_json_patch(p, decide(p).patch)
    assert patched["metadata"]["annotations"]["vramsched.io/model-memory"] == "30Gi"
    d = decide(
        pod(None, command=["vllm", "serve"], args=[*args[:-1], "--kv-cache-memory-bytes", "1G"])
    )
    (w,) = d.warnings
    assert "kv-cache-memory-bytes 1,073,741,824 holds less than one sequence of 32000" in w
    assert d.allowed and not d.patch


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--gpu-memory-utilization", "0.9"], None, "is given --gpu-memory-utilization 0.9 in"),
        (["--gpu-memory-utilization=0.5"], None, "is given --gpu-memory-utilization 0.5 in"),
        (["--gpu-memory-utilization=$(VRAMSCHED_GPU_MEMORY_FRACTION)"], None, None),
        # no flag at all: vLLM runs at its default, 0.9 of the GPU
        ([], [{"name": "VLLM_FRACTION", "value": "0.9"}], "would run at vllm's default"),
        ([], None, "would run at vllm's default --gpu-memory-utilization"),
    ],
)
def test_a_pod_is_filled_only_when_its_engine_takes_the_share_handed_to_it(
    args: list[str], env: list[dict[str, str]] | None, says: str | None
) -> None:
    """vLLM given `--gpu-memory-utilization 0.9`, or no flag (its default is 0.9), takes 90% of
    whichever GPU it gets: filled with the estimate (23.75Gi), the pod was booked for a quarter
    of an 80 GiB GPU it fills. Unset, it holds whole GPUs; a pod whose engine reads the
    fraction vramsched hands it is filled as before."""
    model = ["--model", "Qwen/Qwen2.5-7B-Instruct"]
    p = pod(None, args=[*model, *args], env=env, handoff=False)
    d = decide(p)
    annotations = apply_json_patch(p, d.patch)["metadata"].get("annotations") or {}
    if says is None:
        assert annotations["vramsched.io/model-memory"] == "23.75Gi", d.warnings
    else:
        assert "vramsched.io/model-memory" not in annotations
        (w,) = d.warnings
        assert says in w and "the pod holds whole GPUs" in w


def test_inject_wires_the_engine_unless_it_runs_in_a_shell() -> None:
    model = ["--model", "Qwen/Qwen2.5-7B-Instruct"]
    inject = {"vramsched.io/engine-args": "inject"}
    d = decide(pod(inject, args=model, handoff=False))
    assert any("set vramsched.io/model-memory=23.75Gi" in w for w in d.warnings)
    script = ["sh", "-c"]
    shell = pod(inject, command=script, args=["vllm serve Qwen/Qwen2.5-7B-Instruct"], handoff=False)
    (w,) = decide(shell).warnings
    assert "would run at vllm's default" in w
    # a container vramsched recognises no engine in reads the fraction from its environment
    custom = pod({"vramsched.io/model": "qwen2.5-7b"}, args=["serve"], handoff=False)
    custom["spec"]["containers"][0]["image"] = "example.com/my-server:1"
    assert any("set vramsched.io/model-memory=" in w for w in decide(custom).warnings)


def test_a_declared_pod_whose_engine_runs_at_its_default_is_warned() -> None:
    declared = {"vramsched.io/model-memory": "30Gi"}
    d = decide(pod(declared, args=["--model", "Qwen/Qwen2.5-7B-Instruct"], handoff=False))
    (w,) = d.warnings
    assert "vllm is not given its share of the GPU (--gpu-memory-utilization)" in w
    assert not decide(pod(declared, args=["--model", "Qwen/Qwen2.5-7B-Instruct"])).warnings


def test_tgi_takes_its_fraction_from_the_environment_too() -> None:
    p = pod(
        None,
        command=["text-generation-launcher"],
        args=["--model-id", "Qwen/Qwen2.5-7B-Instruct"],
        env=[{"name": "CUDA_MEMORY_FRACTION", "value": "0.8"}],
        handoff=False,
    )
    (w,) = decide(p).warnings
    assert "is given --cuda-memory-fraction 0.8 in the pod" in w
    engine = p["spec"]["containers"][0]
    declared = pod(
        {"vramsched.io/model-memory": "40Gi"}, args=engine["args"], env=engine["env"], handoff=False
    )
    declared["spec"]["containers"][0]["command"] = ["text-generation-launcher"]
    assert not decide(declared).warnings  # declared by hand: the user's numbers stand


@pytest.mark.parametrize(
    ("command", "args"),
    [
        (["vllm", "serve"], ["meta-llama/Llama-3.3-70B-Instruct", "-pp", "2"]),
        (["vllm", "serve"], ["meta-llama/Llama-3.3-70B-Instruct", "--pipeline-parallel-size=2"]),
        (
            ["python3", "-m", "sglang.launch_server"],
            ["--model-path", "meta-llama/Llama-3.3-70B-Instruct", "--pp-size", "2"],
        ),
    ],
)
def test_pipeline_parallel_pods_are_not_estimated(command: list[str], args: list[str]) -> None:
    """Read as one GPU each holding the whole 70B model, a pod split over two 80 GiB GPUs in
    pipeline stages got an annotation no GPU meets, and waited for ever."""
    d = decide(pod(None, command=command, args=args, gpus="2"))
    (w,) = d.warnings
    assert "runs with pipeline-parallel-size 2, which vramsched does not estimate" in w
    assert d.allowed and not d.patch
    declared = pod({"vramsched.io/model-memory": "120Gi"}, command=command, args=args, gpus="2")
    d = decide(declared)
    assert not d.warnings and d.allowed


@pytest.mark.parametrize("config", ["[" * 100_000, "{", "null", '{"method": "ngram", "model": 7}'])
def test_an_odd_speculative_config_is_left_unsized_without_a_crash(config: str) -> None:
    """A 100,000-deep JSON array ended the review in a RecursionError (json.loads)."""
    args = ["Qwen/Qwen2.5-7B-Instruct", "--speculative-config", config]
    d = decide(pod(None, command=["vllm", "serve"], args=args))
    assert d.allowed and not d.patch and "(speculative decoding)" in d.warnings[0]


def test_speculative_decoding_without_a_draft_model_is_sized() -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    args = ["Qwen/Qwen2.5-7B-Instruct", f"--speculative-config={spec}"]
    d = decide(pod(None, command=["vllm", "serve"], args=args))
    assert d.patch and "set vramsched.io/model-memory=23.75Gi" in d.warnings[0]


@pytest.mark.parametrize(
    ("command", "args", "env", "says"),
    [
        (
            ["vllm", "serve"],
            ["Qwen/Qwen2.5-7B-Instruct", "--speculative-config", '{"model": "Qwen/Qwen2.5-0.5B"}'],
            None,
            "--speculative-config (speculative decoding)",
        ),
        (
            ["vllm", "serve"],
            ["Qwen/Qwen2.5-7B-Instruct", "--enable-lora", "--max-lora-rank", "64"],
            None,
            "--enable-lora (LoRA adapters)",
        ),
        (
            ["vllm", "serve"],
            ["Qwen/Qwen2.5-7B-Instruct", "--config", "/etc/vllm/serve.yaml"],
            None,
            "--config (settings in a file)",
        ),
        (
            ["vllm", "serve"],
            ["Qwen/Qwen2.5-7B-Instruct", "--num-gpu-blocks-override=40000"],
            None,
            "--num-gpu-blocks-override (a fixed KV cache size)",
        ),
        (
            ["vllm", "serve"],
            ["Qwen/Qwen2.5-7B-Instruct", "--max-cudagraph-capture-size", "1024"],
            None,
            "--max-cudagraph-capture-size (CUDA graphs up to 1024 tokens; the estimate counts up to "
            "512)",
        ),
        (
            ["python3", "-m", "sglang.launch_server"],
            ["--model-path", "Qwen/Qwen2.5-7B-Instruct", "--speculative-algorithm=EAGLE"],
            None,
            "--speculative-algorithm (speculative decoding)",
        ),
        (
            ["text-generation-launcher"],
            ["--model-id", "Qwen/Qwen2.5-7B-Instruct"],
            [{"name": "LORA_ADAPTERS", "value": "org/adapter"}],
            "--lora-adapters (LoRA adapters)",
        ),
    ],
)
def test_what_loads_more_than_the_estimate_counts_is_not_sized(
    command: list[str], args: list[str], env: list[dict[str, str]] | None, says: str
) -> None:
    """A draft model, LoRA slots, a KV cache of a fixed number of blocks (which vLLM allocates
    whatever its memory fraction says) or CUDA graphs larger than vLLM's default take GPU memory
    the estimate leaves out: filled with it, the pod would use more than its books."""
    d = decide(pod(None, command=command, args=args, env=env))
    (w,) = d.warnings
    assert f"runs with {says}, which vramsched does not estimate" in w
    assert d.allowed and not d.patch


@pytest.mark.parametrize("seqs", ["9" * 400, "2147483648"])
def test_a_count_beyond_int32_warns_and_sets_nothing(seqs: str) -> None:
    """A 400-digit `--max-num-seqs` ended in an OverflowError inside the review (the API server
    then applies the failure policy); a 20-digit one set `1.75566e+20Gi`, no quantity at all."""
    p = pod(
        None, command=["vllm", "serve"], args=["Qwen/Qwen2.5-7B-Instruct", "--max-num-seqs", seqs]
    )
    d = decide(p)
    (w,) = d.warnings
    assert "cannot size Qwen/Qwen2.5-7B-Instruct: max-num-seqs" in w
    assert "is not between 1 and 2,147,483,647" in w
    assert d.allowed and not d.patch


@pytest.mark.parametrize(
    ("command", "image", "args", "env", "says"),
    [
        (
            ["text-generation-launcher"],
            "ghcr.io/huggingface/text-generation-inference:3.3",
            ["--model-id", "meta-llama/Meta-Llama-3-8B-Instruct"],
            [{"name": "MAX_TOTAL_TOKENS", "value": "65536"}],
            "max-total-tokens 65536 is longer than the 8192 tokens",
        ),
        (
            ["python3", "-m", "sglang.launch_server"],
            "lmsysorg/sglang:latest",
            ["--model-path", "meta-llama/Meta-Llama-3-8B-Instruct", "--tp-size", "3"],
            None,
            "tp-size 3 does not divide the 32 attention heads",
        ),
        (
            ["python3", "-m", "sglang.launch_server"],
            "lmsysorg/sglang:latest",
            ["--model-path", "Qwen/Qwen2.5-7B-Instruct", "--max-running-requests", "0"],
            None,
            "max-running-requests 0 is not between 1 and",
        ),
    ],
)
def test_a_warning_names_the_engines_own_flag(
    command: list[str], image: str, args: list[str], env: Any, says: str
) -> None:
    """It named vLLM's flag (`max-model-len`) for a TGI pod that set MAX_TOTAL_TOKENS."""
    p = pod(None, command=command, args=args, env=env)
    p["spec"]["containers"][0]["image"] = image
    (w,) = decide(p).warnings
    assert says in w, w


def test_sglang_with_chunked_prefill_off_is_sized() -> None:
    """`--chunked-prefill-size -1` was read as a count below 1: "cannot size", nothing set."""
    p = pod(
        None,
        command=["python3", "-m", "sglang.launch_server"],
        args=["--model-path", "Qwen/Qwen2.5-7B-Instruct", "--chunked-prefill-size", "-1"],
    )
    p["spec"]["containers"][0]["image"] = "lmsysorg/sglang:latest"
    d = decide(p)
    (w,) = d.warnings
    assert w.startswith("vramsched: set vramsched.io/model-memory=42Gi from the estimate")
    assert d.patch[0]["value"] == {"vramsched.io/model-memory": "42Gi"}


def test_an_estimate_beyond_what_the_filter_reads_is_not_set() -> None:
    """100,000 sequences of 128k tokens is 1.6 PiB per GPU; the filter refuses a model-memory
    over 64 TiB, so setting it left the pod pending on an annotation the user never wrote."""
    p = pod(
        None,
        command=["vllm", "serve"],
        args=["meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "100000"],
    )
    d = decide(p)
    assert d.allowed and not d.patch
    (w,) = d.warnings
    assert "cannot size meta-llama/Llama-3.1-8B-Instruct: the estimate, " in w
    assert "is more than the 64Ti vramsched.io/model-memory takes" in w


def test_model_that_fits_no_gpu_in_the_cluster_warns() -> None:
    p = pod(
        None,
        command=["vllm", "serve"],
        args=["meta-llama/Llama-3.1-70B-Instruct", "--max-model-len", "8192"],
    )
    d = decide(p, largest_device=lambda: 80 * GIB)
    assert any("fits no GPU" in w for w in d.warnings)


def test_largest_device_follows_nodes_added_relabelled_and_removed() -> None:
    c = builders.cluster(builders.gpu_node("a", count=2, memory_mib=24 * 1024))
    largest = largest_device(c)
    assert largest() == 24 * GIB
    assert largest() == 24 * GIB  # kept: the same arrays, the same answer
    c.upsert_node(builders.gpu_node("b", count=8, memory_mib=80 * 1024))
    assert largest() == 80 * GIB
    c.upsert_node(builders.gpu_node("b", count=8, memory_mib=40 * 1024))  # relabelled smaller
    assert largest() == 40 * GIB
    c.delete_node("b")
    assert largest() == 24 * GIB
    c.delete_node("a")
    assert largest() is None
    assert check_invariant(c.ledger) == []


def test_largest_device_reads_the_arrays_not_every_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-admission cost: no Python loop over the ledger's nodes, even after a change."""
    c = builders.cluster(*(builders.gpu_node(f"n{i}", count=8) for i in range(3)))
    largest = largest_device(c)

    def no_loop() -> None:
        raise AssertionError("largest_device looped over the ledger's nodes")

    monkeypatch.setattr(c.ledger, "nodes", no_loop)
    assert largest() == 80 * GIB
    c.upsert_node(builders.gpu_node("big", count=1, memory_mib=141 * 1024))
    assert largest() == 141 * GIB


def test_engine_args_inject_appends_the_engine_flag() -> None:
    p = pod(
        {"vramsched.io/model-memory": "20Gi", "vramsched.io/engine-args": "inject"},
        command=["vllm", "serve"],
        args=["m"],
    )
    out = apply_json_patch(p, decide(p).patch)
    assert (
        out["spec"]["containers"][0]["args"][-1]
        == "--gpu-memory-utilization=$(VRAMSCHED_GPU_MEMORY_FRACTION)"
    )
    tgi = pod(
        {"vramsched.io/model-memory": "20Gi", "vramsched.io/engine-args": "inject"},
        command=["text-generation-launcher"],
    )
    out = apply_json_patch(tgi, decide(tgi).patch)
    assert out["spec"]["containers"][0]["args"] == [
        "--cuda-memory-fraction=$(VRAMSCHED_GPU_MEMORY_FRACTION)"
    ]


def test_engine_args_inject_leaves_a_set_flag_and_shell_scripts_alone() -> None:
    ann = {"vramsched.io/model-memory": "20Gi", "vramsched.io/engine-args": "inject"}
    already = pod(ann, command=["vllm", "serve"], args=["m", "--gpu-memory-utilization", "0.3"])
    d = decide(already)
    assert not any(op["path"].endswith("/args/-") for op in d.patch)
    assert any("already sets --gpu-memory-utilization" in w for w in d.warnings)
    shell = pod(
        ann, command=["/bin/sh", "-c"], args=["python3 -m sglang.launch_server --model-path m"]
    )
    d = decide(shell)
    assert any(
        "in a shell" in w and "--mem-fraction-static=$VRAMSCHED_GPU_MEMORY_FRACTION" in w
        for w in d.warnings
    )


def test_existing_env_var_is_kept() -> None:
    own = [{"name": "VRAMSCHED_GPU_MEMORY_FRACTION", "value": "0.5"}]
    d = decide(pod({"vramsched.io/model-memory": "20Gi"}, env=own))
    assert d.patch == []


def test_pods_without_model_memory_or_gpu_get_no_env() -> None:
    assert decide(pod({})).patch == []  # whole devices: no fraction at bind
    assert decide(pod({}, gpus="0")).patch == []


# ----- the wire form -------------------------------------------------------------------------------


def _review(
    obj: dict[str, Any], api: str = "admission.k8s.io/v1", op: str = "CREATE"
) -> dict[str, Any]:
    return {
        "apiVersion": api,
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": op,
            "namespace": "default",
            "object": obj,
        },
    }


def test_review_answers_with_a_base64_json_patch_and_warnings() -> None:
    p = pod({"vramsched.io/model": "qwen2.5-7b"}, args=[])
    answer = review(_review(p))
    r = answer["response"]
    assert answer["apiVersion"] == "admission.k8s.io/v1" and r["uid"] == "u-1" and r["allowed"]
    assert r["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(r["patch"]))
    assert "vramsched.io/model-memory" in apply_json_patch(p, ops)["metadata"]["annotations"]
    assert r["warnings"]


def test_review_denial_and_other_operations() -> None:
    r = review(_review(pod({"vramsched.io/model-memory": "x"}), api="admission.k8s.io/v1beta1"))
    assert r["apiVersion"] == "admission.k8s.io/v1beta1"
    assert r["response"]["allowed"] is False and "is invalid" in r["response"]["status"]["message"]
    assert review(_review(pod({"vramsched.io/model-memory": "x"}), op="UPDATE"))["response"] == {
        "uid": "u-1",
        "allowed": True,
    }


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {"kind": "Pod"},
        {"kind": "AdmissionReview"},
        {"kind": "AdmissionReview", "request": {}},
    ],
)
def test_review_refuses_what_is_not_a_review(body: Any) -> None:
    with pytest.raises(ReviewError):
        review(body)


# ----- certificates and the TLS listener -----------------------------------------------------------


def test_serving_cert_covers_its_hosts_until_renewal_is_due() -> None:
    hosts = service_hosts("vramsched-webhook.vramsched") + ["127.0.0.1"]
    assert hosts[:2] == ["vramsched-webhook", "vramsched-webhook.vramsched"]
    cert = make_serving_cert(hosts)
    assert cert_covers(cert.cert_pem, hosts)
    assert not cert_covers(cert.cert_pem, ["other.vramsched.svc"])
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=800)
    assert not cert_covers(cert.cert_pem, hosts, now=later)
    assert not cert_covers(b"not a certificate", hosts)


async def test_listener_answers_over_tls_with_the_generated_ca(unused_tcp_port: int) -> None:
    cert = make_serving_cert(["127.0.0.1"])
    runner = web.AppRunner(create_webhook_app())
    await runner.setup()
    await web.TCPSite(
        runner, "127.0.0.1", unused_tcp_port, ssl_context=ssl_context(cert=cert)
    ).start()
    client_ctx = ssl.create_default_context(cadata=cert.ca_pem.decode())
    try:
        async with aiohttp.ClientSession() as session:
            url = f"https://127.0.0.1:{unused_tcp_port}"
            async with session.post(
                f"{url}/mutate",
                json=_review(pod({"vramsched.io/model-memory": "x"})),
                ssl=client_ctx,
            ) as resp:
                body = await resp.json()
                assert resp.status == 200 and body["response"]["allowed"] is False
            async with session.post(f"{url}/mutate", data=b"{", ssl=client_ctx) as resp:
                assert resp.status == 400
            async with session.get(f"{url}/healthz", ssl=client_ctx) as resp:
                assert resp.status == 200
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await session.get(f"{url}/healthz", ssl=ssl.create_default_context())
    finally:
        await runner.cleanup()
