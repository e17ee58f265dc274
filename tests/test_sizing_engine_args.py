"""Engines and their flags read from container specs, and the bind-time fraction."""

from __future__ import annotations

from typing import Any

import pytest

from extender.sizing.engine_args import human_readable_int, parse_container
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


@pytest.mark.parametrize(
    ("context_flag", "batched_flag", "context", "batched"),
    [
        ("32k", "8k", 32_000, 8_000),  # lowercase: decimal
        ("32K", "8K", 32_768, 8_192),  # uppercase: binary
        ("25.6k", "6.4k", 25_600, 6_400),
        ("1.001k", "512", 1_000, 512),  # vLLM multiplies in floats and truncates
        ("auto", "2k", None, 2_000),  # vLLM fits the context to its memory: sized as unset
        ("-1", "2k", None, 2_000),
        ("1.5K", "1.5K", None, None),  # vLLM refuses decimals with a binary suffix
    ],
)
def test_vllm_counts_take_its_human_readable_spelling(
    context_flag: str, batched_flag: str, context: int | None, batched: int | None
) -> None:
    """vLLM reads `--max-model-len` and `--max-num-batched-tokens` with `human_readable_int`;
    `32k` read as no flag at all sized a pod for the model's whole context."""
    args = ["--model", "m", f"--max-model-len={context_flag}"]
    inv = parse_container(
        {
            "image": "vllm/vllm-openai:v0.11.0",
            "args": [*args, "--max-num-batched-tokens", batched_flag],
        }
    )
    assert inv is not None
    assert (inv.settings.max_model_len, inv.settings.max_batched_tokens) == (context, batched)


def test_vllm_flags_spelled_with_underscores_are_its_flags() -> None:
    """vLLM's parser reads `--max_model_len` as `--max-model-len`: read exactly, such a flag was
    ignored, and `--gpu_memory_utilization 0.9` or `--enable_lora` went unseen."""
    inv = parse_container(
        {
            "image": "vllm/vllm-openai:v0.11.0",
            "args": ["--model", "m", "--max_model_len=8192", "--tensor_parallel_size", "2"]
            + ["--gpu_memory_utilization", "0.9", "--enable_lora", "--enforce_eager"],
        }
    )
    assert inv is not None
    assert (inv.settings.max_model_len, inv.settings.tp, inv.settings.enforce_eager) == (
        8192,
        2,
        True,
    )
    assert inv.fixed_fraction == "0.9" and inv.unestimated == ("--enable-lora (LoRA adapters)",)
    sglang = parse_container({"image": "lmsysorg/sglang", "args": ["--context_length", "8192"]})
    assert sglang is not None and sglang.settings.max_model_len is None  # argparse: dashes only


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], None),  # vLLM's default: up to 512 tokens, where the graph pool was measured
        (["--max-cudagraph-capture-size", "1024"], "up to 1024 tokens"),
        (["--max_cudagraph_capture_size=256"], None),
        (["--cudagraph-capture-sizes", "1", "2", "2048", "--max-model-len", "4096"], "2048"),
        (["--cuda-graph-sizes", "1,2,1024"], "up to 1024 tokens"),
        (["-cc.max_cudagraph_capture_size", "64"], None),
        (["-cc.cudagraph_capture_sizes", "[1,2,4,8,16,32,64]"], None),
        (["--compilation-config", '{"max_cudagraph_capture_size": 1024}'], "1024"),
        (['--compilation-config={"cudagraph_capture_sizes": [1, 600]}'], "600"),
        (["--compilation-config.max_cudagraph_capture_size=768"], "768"),
        (["-cc.max-cudagraph-capture-size", "1024"], "1024"),
        (["-O3"], None),
        (["-O", '{"level": 3}'], None),
        (["--max-cudagraph-capture-size", "$(SIZE)"], "not written out"),
        (["--cudagraph-capture-sizes"], "not written out"),
        # a smaller size set after a larger one does not hide it
        (["--cudagraph-capture-sizes", "1", "1024", "--max-cudagraph-capture-size", "256"], "1024"),
        (["--max-cudagraph-capture-size", "1024", "--enforce_eager"], None),  # no graphs at all
    ],
)
def test_vllm_cuda_graphs_beyond_the_measured_sizes_are_not_estimated(
    args: list[str], says: str | None
) -> None:
    """The estimate counts vLLM's CUDA graph pool at 1 GiB, measured at vLLM's default sizes (up
    to 512 tokens). Larger graphs take more memory outside the fraction, so a pod capturing them
    (or whose sizes the webhook cannot read) is left unsized, as one with a draft model is."""
    inv = parse_container({"image": "vllm/vllm-openai:v0.11.0", "args": ["--model", "m", *args]})
    assert inv is not None
    graphs = [u for u in inv.unestimated if "CUDA graph" in u]
    if says is None:
        assert graphs == []
    else:
        assert len(graphs) == 1 and says in graphs[0], graphs


def test_other_engines_take_plain_counts_only() -> None:
    """TGI (clap) and SGLang (argparse int) read plain integers; `32k` is not one to them."""
    for image, flag in (
        ("ghcr.io/huggingface/text-generation-inference:3", "--max-total-tokens"),
        ("lmsysorg/sglang:latest", "--context-length"),
    ):
        inv = parse_container({"image": image, "args": [flag, "32k"]})
        assert inv is not None and inv.settings.max_model_len is None


def test_human_readable_counts_beyond_a_float_stay_exact() -> None:
    assert human_readable_int("9" * 400 + "k") == int("9" * 400) * 1000
    with pytest.raises(ValueError):
        human_readable_int("1e3k")


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
