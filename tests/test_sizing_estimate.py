"""KV cache, engine overhead, the estimate and `vramsched estimate`, against hand computations.

Every expected number is written out from the model's config values, not from the code.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from extender.cli import main
from extender.quantity import parse_quantity
from extender.sizing.architecture import architecture_from_config
from extender.sizing.catalogue import lookup
from extender.sizing.engines import (
    GIB,
    MIB,
    EngineSettings,
    fraction,
    outside,
    overhead,
)
from extender.sizing.errors import SizingError
from extender.sizing.estimate import estimate, format_quantity, resolve_model
from extender.sizing.kv import kv_cache


def _kv(
    name: str, context: int, sequences: int = 1, tp: int = 1, dtype: int = 2, windowed: bool = True
):
    return kv_cache(
        lookup(name).architecture,
        dtype_bytes=dtype,
        context=context,
        sequences=sequences,
        tp=tp,
        windowed=windowed,
    )


# ----- KV cache per architecture kind ----------------------------------------------------------


def test_gqa_llama_3_8b() -> None:
    # 2 (K and V) x 32 layers x 8 KV heads x 128 x 2 bytes = 131,072 bytes a token.
    kv = _kv("llama-3.1-8b", 8192, sequences=2)
    assert kv.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv.total_bytes == 131_072 * 8192 * 2
    assert kv.per_gpu_bytes == kv.total_bytes


def test_gqa_under_tensor_parallelism_splits_kv_heads_then_replicates_them() -> None:
    assert _kv("llama-3.1-8b", 8192, tp=2).per_gpu_bytes == 131_072 * 8192 // 2
    # Qwen2.5-7B has 4 KV heads: with tp=8 every GPU still holds one whole head (1/4).
    kv = _kv("qwen2.5-7b", 4096, tp=8)
    assert kv.bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57_344
    assert kv.per_gpu_bytes == 57_344 * 4096 // 4


def test_explicit_head_dim_mistral_nemo() -> None:
    # head_dim 128, although 5120 / 32 heads would be 160.
    kv = _kv("mistral-nemo", 1024)
    assert kv.bytes_per_token == 2 * 40 * 8 * 128 * 2 == 163_840


def test_mqa_with_interleaved_window_gemma_3_1b() -> None:
    # 1 KV head of 256: 1,024 bytes a layer. Layers 6, 12, 18, 24 (every 6th) are global; the
    # other 22 keep a 512-token window, held as 512 + one 16-token block.
    kv = _kv("gemma-3-1b", 32768)
    per_layer = 2 * 1 * 256 * 2
    assert kv.bytes_per_token == per_layer * 26
    assert kv.total_bytes == per_layer * (4 * 32768 + 22 * (512 + 16))


def test_sliding_window_everywhere_mistral_7b_v01() -> None:
    kv = _kv("mistral-7b-v0.1", 32768)
    assert kv.total_bytes == 2 * 32 * 8 * 128 * 2 * (4096 + 16)
    # A context shorter than the window is not rounded up to it.
    assert _kv("mistral-7b-v0.1", 1000).total_bytes == 131_072 * 1008
    # An engine that keeps every token (TGI) is counted at full context.
    assert _kv("mistral-7b-v0.1", 32768, windowed=False).total_bytes == 131_072 * 32768


def test_gemma_2_alternates_local_and_global_layers() -> None:
    # 42 layers: 21 local (window 4096) and 21 global; 8 KV heads of 256.
    kv = _kv("gemma-2-9b", 8192)
    per_layer = 2 * 8 * 256 * 2
    assert kv.total_bytes == per_layer * (21 * 8192 + 21 * (4096 + 16))


def test_mla_deepseek_caches_one_latent_per_layer_on_every_gpu() -> None:
    # (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes per layer.
    assert _kv("deepseek-v2-lite", 1).bytes_per_token == (512 + 64) * 2 * 27 == 31_104
    kv = _kv("deepseek-v3", 16384, tp=8)
    assert kv.bytes_per_token == (512 + 64) * 2 * 61 == 70_272
    assert kv.per_gpu_bytes == kv.total_bytes == 70_272 * 16384


def test_gpt_oss_alternates_128_token_window_and_full_layers() -> None:
    # 8 KV heads of 64: 2,048 bytes a layer; 12 sliding (128 + 16 tokens), 12 full.
    kv = _kv("gpt-oss-20b", 131072)
    assert kv.bytes_per_token == 2 * 8 * 64 * 2 * 24 == 49_152
    assert kv.total_bytes == 2048 * (12 * 131072 + 12 * 144)


def test_moe_mixtral_kv_is_the_attention_only() -> None:
    assert _kv("mixtral-8x7b", 32768).total_bytes == 131_072 * 32768


def test_fp8_kv_cache_halves_it() -> None:
    assert (
        _kv("llama-3.1-8b", 8192, dtype=1).total_bytes * 2 == _kv("llama-3.1-8b", 8192).total_bytes
    )


# ----- engine overhead and the fraction flag ----------------------------------------------------


def test_vllm_activation_model_covers_every_measured_peak() -> None:
    """llm-d's H100 runs at vLLM's H100 defaults (1024 sequences): torch peak + non-torch."""
    measured = {
        "llama-3.1-8b": 4.76 + 0.13,
        "qwen3-0.6b": 5.56 + 0.13,
        "qwen3-32b": 5.64 + 0.14,
        "gpt-oss-20b": 7.38 + 0.13,
    }
    for name, gib in measured.items():
        o = overhead(lookup(name).architecture, EngineSettings(), 80 * GIB, "NVIDIA-H100-80GB-HBM3")
        assert gib * GIB <= o.inside <= (gib + 1) * GIB, name
    o = overhead(lookup("llama-3.3-70b").architecture, EngineSettings(tp=2), 80 * GIB, "H100")
    assert (4.84 + 0.55) * GIB <= o.inside


def test_vllm_small_gpu_defaults_shrink_the_sampler() -> None:
    a = lookup("llama-3.1-8b").architecture
    big = overhead(a, EngineSettings(), 80 * GIB, "NVIDIA-H100-80GB-HBM3")
    a100 = overhead(a, EngineSettings(), 80 * GIB, "NVIDIA-A100-SXM4-80GB")
    assert a100.inside < big.inside  # vLLM keeps the 256-sequence default on A100s
    assert big.inside >= 1024 * 128256 * 40


def test_flag_covers_what_each_engine_counts() -> None:
    reservation, device = 20 * GIB, 80 * GIB
    # vLLM: CUDA context (0.75 GiB) and CUDA graphs (1 GiB) are outside its budget.
    v = EngineSettings(engine="vllm")
    assert outside(v) == 768 * MIB + GIB
    assert (
        fraction(reservation, device, overhead(lookup("qwen2.5-7b").architecture, v)) == 0.22
    )  # 18.25/80
    # TGI: everything is inside; it then uses 90% of the fraction (TGI_WIGGLE_ROOM).
    t = EngineSettings(engine="tgi")
    assert outside(t) == 0
    assert fraction(reservation, device, overhead(lookup("qwen2.5-7b").architecture, t)) == 0.25
    # SGLang: context + its own reserve (512 MiB + 8192 x 1.5 MiB + 256 x 2 MiB + 128 MiB on an H100).
    s = EngineSettings(engine="sglang")
    assert outside(s, 80 * GIB) == 768 * MIB + (512 + 12288 + 512 + 128) * MIB
    assert outside(s, 16 * GIB) == 768 * MIB + (512 + 3072 + 16 + 128) * MIB


@pytest.mark.parametrize("size", [-1, 0])
def test_sglang_without_chunked_prefill_reserves_a_whole_prefill_batch(size: int) -> None:
    """`--chunked-prefill-size -1` is SGLang's documented way to turn chunking off (any size not
    above 0 is); its reserve then takes `--max-prefill-tokens` (16384) tokens at 1.5 MiB each.
    The -1 was refused ("cannot size" in the webhook) and a 0 read as the default chunk."""
    s = EngineSettings(engine="sglang", max_batched_tokens=size)
    assert outside(s, 80 * GIB) == 768 * MIB + (512 + 16384 * 3 // 2 + 512 + 128) * MIB
    a = lookup("qwen2.5-7b").architecture
    assert "16384-token prefill batches (chunked prefill off)" in overhead(a, s).detail
    with pytest.raises(SizingError, match="max-num-batched-tokens -1 is not between 1 and"):
        estimate(resolve_model("qwen2.5-7b"), EngineSettings(engine="vllm", max_batched_tokens=-1))


def test_fraction_rounds_down_and_never_exceeds_one() -> None:
    o = overhead(lookup("qwen2.5-7b").architecture, EngineSettings(engine="tgi"))
    assert fraction(16 * GIB, 80 * GIB, o) == 0.2
    assert fraction(16 * GIB - 1, 80 * GIB, o) == 0.19
    assert fraction(90 * GIB, 80 * GIB, o) == 1.0


def test_estimate_total_adds_up_and_rounds_the_annotation_up() -> None:
    e = estimate(
        resolve_model("qwen2.5-7b"),
        EngineSettings(max_model_len=8192, max_num_seqs=4),
        list_devices=False,
    )
    assert e.weights_per_gpu == 15_231_233_024
    assert e.kv.per_gpu_bytes == 57_344 * 8192 * 4
    assert e.total_per_gpu == e.weights_per_gpu + e.kv.per_gpu_bytes + e.overhead.total
    assert e.reservation_per_gpu % (256 * MIB) == 0
    assert 0 <= e.reservation_per_gpu - e.total_per_gpu < 256 * MIB
    assert e.annotation == f"vramsched.io/model-memory: {format_quantity(e.total_per_gpu)}"


def test_vllm_kv_cache_memory_bytes_is_the_kv_cache_per_gpu() -> None:
    """vLLM's `--kv-cache-memory-bytes` sizes its KV cache per GPU, whatever the memory
    fraction; the estimate counted the sequences' cache instead, and a pod setting a larger
    cache used more VRAM than its annotation said."""
    model = resolve_model("qwen2.5-7b")
    s = EngineSettings(max_model_len=8192, max_num_seqs=4, tp=2, kv_cache_bytes=20 * GIB)
    e = estimate(model, s, list_devices=False)
    one = estimate(model, replace(s, kv_cache_bytes=None, max_num_seqs=1), list_devices=False)
    assert e.kv.per_gpu_bytes == 20 * GIB and e.sequences == 20 * GIB // one.kv.per_gpu_bytes
    assert e.total_per_gpu == e.weights_per_gpu + 20 * GIB + e.overhead.total
    assert "ignores --gpu-memory-utilization" in " ".join(e.notes)
    with pytest.raises(SizingError, match="holds less than one sequence of 8192 tokens"):
        estimate(model, replace(s, kv_cache_bytes=one.kv.per_gpu_bytes - 1))
    with pytest.raises(SizingError, match="kv-cache-memory-bytes 0 is not between 1 and"):
        estimate(model, replace(s, kv_cache_bytes=0))


def test_tgi_total_leaves_its_ten_percent() -> None:
    s = EngineSettings(engine="tgi", max_model_len=8192)
    e = estimate(resolve_model("qwen2.5-7b"), s, list_devices=False)
    inside = e.weights_per_gpu + e.kv.per_gpu_bytes + e.overhead.inside
    assert e.total_per_gpu * 0.90 >= inside


def test_tensor_parallel_annotation_is_for_all_gpus() -> None:
    e = estimate(
        resolve_model("llama-3.1-70b"), EngineSettings(tp=4, max_model_len=8192), list_devices=False
    )
    assert e.model_memory == format_quantity(e.reservation_per_gpu * 4)
    assert e.weights_per_gpu < 141_107_412_992 // 4 + 2 * GIB


def test_format_quantity() -> None:
    assert format_quantity(8 * GIB) == "8Gi"
    assert format_quantity(8 * GIB + 1) == "8.25Gi"
    assert format_quantity(22 * GIB + 300 * MIB) == "22.5Gi"


@pytest.mark.parametrize(
    ("quarters", "written"),
    [
        (4 * 123_456 + 1, "123456.25Gi"),
        (4 * 7_022_675 + 2, "7022675.5Gi"),
        (4 * 10**40 + 3, f"{10**40}.75Gi"),
    ],
)
def test_format_quantity_is_exact_at_any_size(quarters: int, written: str) -> None:
    """It went through a float's `:g`: 123456.25Gi was written 123456Gi, a quarter GiB short,
    and from a million GiB on it wrote `7.02268e+06Gi`, which is no Kubernetes quantity (an
    estimate with `--max-num-seqs 4000000` printed that annotation)."""
    assert format_quantity(quarters * 256 * MIB) == written
    assert parse_quantity(written) == quarters * 256 * MIB


@pytest.mark.parametrize(
    ("model", "settings", "message"),
    [
        ("qwen3", EngineSettings(), "did you mean"),
        ("Qwen/Qwen2.5-7B-Instrct", EngineSettings(), "Qwen/Qwen2.5-7B-Instruct"),
        ("llama-3-8b", EngineSettings(max_model_len=100000), "longer than the 8192 tokens"),
        ("llama-3.1-8b", EngineSettings(tp=3), "does not divide the 32 attention heads"),
        ("qwen2.5-7b-awq", EngineSettings(quantization="gptq"), "quantized with awq"),
        ("qwen2.5-7b-awq", EngineSettings(dtype="fp8"), "--dtype fp8 does not apply"),
        ("gpt-oss-20b", EngineSettings(dtype="int8"), "--dtype int8 does not apply"),
        ("qwen2.5-7b", EngineSettings(dtype="int8", quantization="fp8"), "give one"),
        ("qwen2.5-7b", EngineSettings(dtype="fp8", quantization="awq"), "give one"),
        # Beyond int32 a count is a typo; a 400-digit one ended in an OverflowError traceback.
        (
            "qwen2.5-7b",
            EngineSettings(max_num_seqs=10**400),
            "max-num-seqs 1000000000000",
        ),
        (
            "qwen2.5-7b",
            EngineSettings(max_batched_tokens=2**31),
            "max-num-batched-tokens 2147483648 is not between 1 and 2,147,483,647",
        ),
        # A negative KV pool or graph batch shrank the estimate (no KV cache at all).
        ("qwen2.5-7b", EngineSettings(engine="sglang", kv_tokens=-5), "max-total-tokens -5 is"),
        ("qwen2.5-7b", EngineSettings(engine="sglang", cuda_graph_max_bs=-3), "cuda-graph-max-bs"),
        (
            "qwen2.5-7b",
            EngineSettings(engine="sglang", cuda_graph_max_bs=10**400),
            "is not between 0 and 2,147,483,647",
        ),
    ],
)
def test_bad_input_is_one_line(model: str, settings: EngineSettings, message: str) -> None:
    with pytest.raises(SizingError) as exc:
        estimate(resolve_model(model), settings)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", None])
def test_a_16_bit_dtype_on_a_quantized_checkpoint_changes_nothing(dtype: str | None) -> None:
    e = estimate(resolve_model("qwen2.5-7b-awq"), EngineSettings(dtype=dtype), list_devices=False)
    assert e.weights_bytes == 5_570_747_392


def test_fp8_dtype_on_an_fp8_checkpoint_is_the_checkpoint_itself() -> None:
    plain = estimate(resolve_model("llama-3.3-70b-fp8"), EngineSettings(), list_devices=False)
    fp8 = estimate(
        resolve_model("llama-3.3-70b-fp8"), EngineSettings(dtype="fp8"), list_devices=False
    )
    assert fp8.weights_bytes == plain.weights_bytes


@pytest.mark.parametrize("gpu", ["", "  ", "A1000"])
def test_a_gpu_name_that_names_none_is_refused(gpu: str) -> None:
    """`--gpu ''` used to be taken as no GPU given, silently."""
    with pytest.raises(SizingError, match=f"unknown GPU {gpu!r}; known: T4"):
        estimate(resolve_model("qwen2.5-7b"), EngineSettings(), gpu=gpu)


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_an_8_bit_dtype_on_a_16_bit_checkpoint_quantises_its_weights(dtype: str) -> None:
    """`--dtype fp8` on a 16-bit checkpoint once ended in an UnboundLocalError traceback (the
    test for an fp8 checkpoint read a name set only for quantised ones)."""
    model = resolve_model("qwen2.5-7b")
    plain = estimate(model, EngineSettings(), list_devices=False)
    fp8 = estimate(model, EngineSettings(quantization="fp8"), list_devices=False)
    e = estimate(model, EngineSettings(dtype=dtype), list_devices=False)
    assert e.weight_format.startswith(dtype)
    assert e.weights_bytes == fp8.weights_bytes < plain.weights_bytes
    assert f"weights quantised to {dtype} at load" in e.notes


def test_config_missing_fields_are_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    with pytest.raises(
        SizingError,
        match="missing num_hidden_layers, num_attention_heads, vocab_size, intermediate_size",
    ):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": float("inf")}, "hidden_size=inf is not an integer"),
        (
            {"max_position_embeddings": float("nan")},
            "max_position_embeddings=nan is not an integer",
        ),
        ({"num_hidden_layers": 10**5}, "is more than any model has (at most 10,000)"),
        ({"num_hidden_layers": 2**70}, "is more than 2**53"),
        # A whole float of any size passed, and its products overflowed a float: a traceback.
        ({"hidden_size": 1e300}, "hidden_size=1e+300 is more than 2**53"),
        ({"vocab_size": 2**53 + 1}, f"vocab_size={2**53 + 1} is more than 2**53"),
        # an int beyond a float ended in an OverflowError inside is_whole (math.isfinite)
        ({"vocab_size": 10**400}, "vocab_size=1000000000000000000000000000000"),
        ({"rope_scaling": {"type": "yarn", "factor": float("inf")}}, None),
        # A finite factor whose product is a float's infinity ended in an OverflowError.
        (
            {"rope_scaling": {"type": "yarn", "factor": 1e306}},
            "rope_scaling factor=1e+306 stretches the context of 32768 tokens beyond 2**53",
        ),
        (
            {"quantization_config": {"quant_method": "awq", "bits": "four"}},
            "quantization_config bits='four' in config.json is not a whole number from 1 to 16",
        ),
        (
            {
                "quantization_config": {
                    "quant_method": "gptq",
                    "bits": 4,
                    "group_size": float("nan"),
                }
            },
            "group_size=nan in config.json is not a whole number",
        ),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
            "weight_block_size=[128] in config.json is not [rows, columns]",
        ),
        (
            {
                "quantization_config": {
                    "quant_method": "compressed-tensors",
                    "config_groups": {"g": {"weights": {"num_bits": None}}},
                }
            },
            "num_bits=None in config.json is not a whole number",
        ),
    ],
)
def test_a_broken_config_is_one_line_not_a_crash(
    tmp_path: Path, change: dict, message: str | None
) -> None:
    """Values json.loads accepts (NaN, Infinity, huge integers, wrong types) and a config that
    would make the per-layer tables exhaust memory are named; a rope factor that is not finite
    is not a stretch of the context, as vLLM ignores what it cannot use."""
    (tmp_path / "config.json").write_text(json.dumps(dict(lookup("qwen2.5-7b").config, **change)))
    settings = EngineSettings(max_model_len=4096)
    if message is None:
        e = estimate(resolve_model(str(tmp_path)), settings, list_devices=False)
        assert e.model.architecture.max_context == 32768
        return
    with pytest.raises(SizingError) as exc:
        estimate(resolve_model(str(tmp_path)), settings, list_devices=False)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_config_nested_past_the_stack_is_one_line(tmp_path: Path) -> None:
    """json.loads recurses once per level: 100,000 nested arrays ended in a RecursionError."""
    (tmp_path / "config.json").write_text("[" * 100_000)
    with pytest.raises(SizingError, match="config.json at .* is nested too deeply"):
        resolve_model(str(tmp_path))


def test_config_only_directory_uses_the_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(lookup("qwen2.5-7b").config))
    e = estimate(
        resolve_model(str(tmp_path)), EngineSettings(max_model_len=4096), list_devices=False
    )
    assert e.checkpoint_bytes == 15_231_233_024
    assert "config.json only" in e.model.source


def test_yarn_rope_scaling_stretches_the_context() -> None:
    config = dict(lookup("qwen2.5-7b").config, rope_scaling={"type": "yarn", "factor": 4.0})
    assert architecture_from_config(config).max_context == 131072


# ----- the command ------------------------------------------------------------------------------


def test_cli_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "estimate",
            "Qwen/Qwen2.5-7B-Instruct",
            "--max-model-len",
            "8192",
            "--gpu",
            "NVIDIA-L4",
            "-o",
            "json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    for key in (
        "weightsBytes",
        "kvBytesPerToken",
        "kvCacheBytes",
        "overheadBytes",
        "totalBytesPerGpu",
        "annotation",
    ):
        assert key in out, key
    assert out["weightsBytes"] == 15_231_233_024
    assert out["kvBytesPerToken"] == 57_344
    assert out["gpu"]["flag"].startswith("--gpu-memory-utilization 0.")
    assert out["annotation"].startswith("vramsched.io/model-memory: ")


def test_cli_yaml_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["estimate", "gpt-oss-20b", "--engine", "sglang", "--gpu", "H100", "-o", "yaml"]) == 0
    )
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["gpu"]["flag"].startswith("--mem-fraction-static ")
    assert (
        main(["estimate", "qwen2.5-7b-awq", "--max-model-len", "16384", "--gpu", "A100-80GB"]) == 0
    )
    text = capsys.readouterr().out
    assert "vramsched.io/model-memory: " in text
    assert "--gpu-memory-utilization" in text
    assert "MIG" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "no-such-model"],
        ["estimate", "llama-3-8b", "--max-model-len", "100000"],
        ["estimate", "llama-3.1-8b", "--gpu", "Z100"],
        ["estimate", "llama-3.1-8b", "--max-num-seqs", "0"],
        ["estimate", "llama-3.1-8b", "--max-num-seqs", "2147483648"],
        ["estimate", "llama-3.1-8b", "--max-num-seqs", "9" * 400],
        ["estimate", "/nonexistent/model"],
        ["estimate", "qwen2.5-7b-awq", "--dtype", "fp8"],
        # Printed, but a model that fits no GPU is still an error.
        ["estimate", "llama-3.1-70b", "--max-model-len", "8192", "--gpu", "L4"],
        ["estimate", "llama-3.1-405b", "--max-model-len", "8192"],
    ],
)
def test_cli_errors_exit_2_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err and "Traceback" not in err
    # One error line (argparse's own errors print the usage above it).
    assert err.splitlines()[-1].startswith("vramsched estimate: error: ")
    if "usage:" not in err:
        assert len(err.splitlines()) == 1
