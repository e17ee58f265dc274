"""Engines and their flags read from container specs, and the bind-time fraction."""

from __future__ import annotations

from typing import Any

from extender.sizing.engine_args import parse_container
from extender.sizing.handoff import pod_engine, pod_fraction

GIB = 1 << 30


def _gpu(container: dict[str, Any]) -> dict[str, Any]:
    return {**container, "resources": {"limits": {"nvidia.com/gpu": "1"}}}


def test_vllm_serve_positional_model_and_flags() -> None:
    inv = parse_container(
        {
            "image": "vllm/vllm-openai:v0.10.1",
            "command": ["vllm", "serve"],
            "args": [
                "Qwen/Qwen2.5-7B-Instruct",
                "--max-model-len=16384",
                "--max-num-seqs",
                "8",
                "-tp",
                "2",
                "--kv-cache-dtype",
                "fp8",
                "--enforce-eager",
                "--dtype",
                "bfloat16",
            ],
        }
    )
    assert inv is not None
    s = inv.settings
    assert (s.engine, s.model, s.max_model_len, s.max_num_seqs, s.tp) == (
        "vllm",
        "Qwen/Qwen2.5-7B-Instruct",
        16384,
        8,
        2,
    )
    assert (s.kv_cache_dtype, s.enforce_eager, s.dtype) == ("fp8", True, "bf16")
    assert not inv.shell and not inv.fraction_flag_set


def test_vllm_image_entrypoint_with_model_flag_and_existing_fraction() -> None:
    inv = parse_container(
        {
            "image": "vllm/vllm-openai",
            "args": [
                "--model",
                "m",
                "--gpu-memory-utilization",
                "0.5",
                "--quantization",
                "awq_marlin",
            ],
        }
    )
    assert inv is not None and inv.settings.model == "m" and inv.fraction_flag_set
    assert inv.settings.quantization == "awq"


def test_tgi_flags_and_environment() -> None:
    inv = parse_container(
        {
            "image": "ghcr.io/huggingface/text-generation-inference:3.0",
            "args": ["--model-id", "mistralai/Mistral-7B-Instruct-v0.3", "--num-shard", "2"],
            "env": [
                {"name": "MAX_TOTAL_TOKENS", "value": "8192"},
                {"name": "QUANTIZE", "value": "awq"},
            ],
        }
    )
    assert inv is not None
    s = inv.settings
    assert (s.engine, s.model, s.tp, s.max_model_len, s.quantization) == (
        "tgi",
        "mistralai/Mistral-7B-Instruct-v0.3",
        2,
        8192,
        "awq",
    )


def test_sglang_in_a_shell_script() -> None:
    inv = parse_container(
        {
            "image": "lmsysorg/sglang:latest",
            "command": ["/bin/sh", "-c"],
            "args": [
                "python3 -m sglang.launch_server --model-path Qwen/Qwen3-8B --context-length 32768 --tp 2 --port 30000"
            ],
        }
    )
    assert inv is not None and inv.shell
    s = inv.settings
    assert (s.engine, s.model, s.max_model_len, s.tp) == ("sglang", "Qwen/Qwen3-8B", 32768, 2)


def test_kubelet_substitutions_are_unknown_not_errors() -> None:
    inv = parse_container({"command": ["vllm", "serve", "m", "--max-model-len", "$(CTX)"]})
    assert inv is not None and inv.settings.max_model_len is None


def test_unrecognised_container_and_engine_hint() -> None:
    plain = {"image": "python:3.11", "command": ["python", "serve.py"]}
    assert parse_container(plain) is None
    hinted = parse_container({**plain, "args": ["--max-model-len", "4096"]}, "vllm")
    assert hinted is not None and hinted.engine == "vllm" and hinted.settings.max_model_len == 4096


def _pod(container: dict[str, Any], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "annotations": annotations or {}},
        "spec": {"containers": [_gpu(container)]},
    }


def test_pod_engine_reads_gpu_containers_only() -> None:
    sidecar = {"name": "proxy", "image": "vllm/vllm-openai", "args": ["--model", "x"]}
    pod = {
        "metadata": {},
        "spec": {
            "containers": [sidecar, _gpu({"name": "tgi", "args": ["text-generation-launcher"]})]
        },
    }
    found = pod_engine(pod)
    assert found is not None and found.engine == "tgi"


def test_bind_fraction_per_engine() -> None:
    reserved, device = 20 * GIB, 80 * GIB
    vllm = _pod({"command": ["vllm", "serve", "m"]})
    tgi = _pod({"args": ["text-generation-launcher", "--model-id", "m"]})
    other = _pod({"image": "my/app"})
    # vLLM: (20 - 0.75 context - 1 graphs) / 80 = 0.228; TGI and unknown engines: 20 / 80.
    assert pod_fraction(vllm, [(reserved, device)]) == "0.22"
    assert pod_fraction(tgi, [(reserved, device)]) == "0.25"
    assert pod_fraction(other, [(reserved, device)]) == "0.25"
    eager = _pod({"command": ["vllm", "serve", "m", "--enforce-eager"]})
    assert pod_fraction(eager, [(reserved, device)]) == "0.24"
    # The engine annotation wins over an unreadable command.
    hinted = _pod({"image": "my/app"}, {"vramsched.io/engine": "vllm"})
    assert pod_fraction(hinted, [(reserved, device)]) == "0.22"


def test_bind_fraction_takes_the_smallest_device_share() -> None:
    pod = _pod({"image": "my/app"})
    assert pod_fraction(pod, [(10 * GIB, 40 * GIB), (10 * GIB, 80 * GIB)]) == "0.12"
