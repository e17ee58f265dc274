"""The weights estimate against published checkpoint sizes and vLLM's measured weight memory.

Published: `metadata.total_size` of the models' model.safetensors.index.json (sources in
extender/sizing/catalogue.yaml); the architecture count must reproduce every one byte for
byte. Measured: "Model loading took N GiB" from vLLM on an H100 (llm-d's
config_explorer/empirical-vllm-memory-results.md).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from extender.sizing import catalogue
from extender.sizing.architecture import architecture_from_config
from extender.sizing.engines import EngineSettings
from extender.sizing.errors import SizingError
from extender.sizing.estimate import estimate, resolve_model
from extender.sizing.quant import checkpoint_format, total_bytes
from extender.sizing.tensors import inventory

GIB = 1 << 30
PUBLISHED = [e for e in catalogue.entries() if e.checkpoint_bytes]


def _checkpoint_bytes(entry: catalogue.Entry) -> int:
    a = entry.architecture
    files = inventory(a, checkpoint=True, lm_head_stored=entry.lm_head_stored)
    return total_bytes(files, checkpoint_format(a.quantization, a.dtype))


@pytest.mark.parametrize("entry", PUBLISHED, ids=lambda e: e.name)
def test_architecture_count_reproduces_the_published_checkpoint_size(
    entry: catalogue.Entry,
) -> None:
    assert _checkpoint_bytes(entry) == entry.checkpoint_bytes


def test_every_architecture_kind_has_a_published_size_checked() -> None:
    kinds = {
        "gqa": lambda a: a.mla is None and 1 < a.kv_heads < a.heads,
        "mqa": lambda a: a.kv_heads == 1,
        "explicit head_dim": lambda a: a.head_dim * a.heads != a.hidden,
        "sliding window": lambda a: a.sliding_layers == a.layers,
        "interleaved sliding": lambda a: 0 < a.sliding_layers < a.layers,
        "moe": lambda a: a.moe is not None,
        "mla": lambda a: a.mla is not None,
        "tied": lambda a: a.tied,
        "group-scaled quantisation (mxfp4)": lambda a: (
            a.quantization.get("quant_method") == "mxfp4"
        ),
    }
    for kind, test in kinds.items():
        assert any(test(e.architecture) for e in PUBLISHED), kind


def test_deepseek_v3_fp8_block_scales_match_the_published_files_less_their_headers() -> None:
    """The published 688,586,727,753 bytes sum the 163 shard files, JSON headers included
    (~95k tensor names); the tensors come to 11.9 MB less, and never more."""
    tensors = _checkpoint_bytes(catalogue.lookup("deepseek-ai/DeepSeek-V3"))
    assert tensors == 688_574_839_360
    assert 0 < 688_586_727_753 - tensors < 12_000_000


def test_deepseek_v3_tensor_bytes_counted_again_by_hand() -> None:
    """The same figure from the checkpoint's tensor list written out here, apart from
    tensors.py: FP8 projections with a float32 [ceil(out/128), ceil(in/128)] weight_scale_inv,
    bf16 norms, routers, embeddings and heads, float32 e_score_correction_bias; 3 dense layers,
    58 MoE layers (256 routed + 1 shared expert), and the multi-token-prediction layer 61
    (a MoE layer plus its own embed_tokens, enorm, hnorm, eh_proj, shared_head)."""

    def fp8(out: int, inp: int) -> int:
        return out * inp + -(-out // 128) * -(-inp // 128) * 4

    norm = 2 * 7168
    attention = (
        fp8(1536, 7168)  # q_a_proj
        + 2 * 1536  # q_a_layernorm
        + fp8(128 * 192, 1536)  # q_b_proj
        + fp8(512 + 64, 7168)  # kv_a_proj_with_mqa
        + 2 * 512  # kv_a_layernorm
        + fp8(128 * 256, 512)  # kv_b_proj
        + fp8(7168, 128 * 128)  # o_proj
        + 2 * norm  # input and post-attention layernorms
    )
    dense = 2 * fp8(18432, 7168) + fp8(7168, 18432)
    expert = 2 * fp8(2048, 7168) + fp8(7168, 2048)
    moe = 2 * 256 * 7168 + 4 * 256 + 257 * expert  # router, bias, routed + shared experts
    vocab = 2 * 129280 * 7168
    mtp = attention + moe + 2 * vocab + 3 * norm + 2 * 7168 * 14336
    by_hand = 3 * (attention + dense) + 58 * (attention + moe) + 2 * vocab + norm + mtp
    assert by_hand == 688_574_839_360
    assert _checkpoint_bytes(catalogue.lookup("deepseek-ai/DeepSeek-V3")) == by_hand


# The Hub's file listings of AWQ/GPTQ releases: sizes in decimal GB to 3 significant digits, the
# only published figures found for them (no model.safetensors.index.json total_size). They bound
# the derived bytes to +-0.005 GB per file, not to the byte; dropping the scales (-0.11 GB on
# Llama-3.1-8B) or the zero points (-0.03 GB) would break them. Headers add under 0.1 MB.
HUB_LISTINGS = [
    # hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4: model-0000{1,2}-of-00002.safetensors
    ("hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4", [4.68, 1.05]),
    # Qwen/Qwen2.5-7B-Instruct-AWQ: model-0000{1,2}-of-00002.safetensors
    ("Qwen/Qwen2.5-7B-Instruct-AWQ", [4.0, 1.57]),
]


@pytest.mark.parametrize(("model", "files_gb"), HUB_LISTINGS, ids=[m for m, _ in HUB_LISTINGS])
def test_awq_checkpoints_agree_with_the_hubs_rounded_file_sizes(
    model: str, files_gb: list[float]
) -> None:
    derived = _checkpoint_bytes(catalogue.lookup(model))
    assert catalogue.lookup(model).checkpoint_bytes is None  # no byte-exact figure published
    slack = 0.005e9 * len(files_gb) + 100_000 * len(files_gb)
    assert abs(derived - sum(files_gb) * 1e9) <= slack


def test_deepseek_v3_serving_leaves_out_the_multi_token_prediction_layer() -> None:
    e = estimate(
        resolve_model("deepseek-v3"), EngineSettings(tp=8, max_model_len=4096), list_devices=False
    )
    assert e.parameters == 671_026_419_200  # "671B"; 684.5B with the MTP layer
    assert e.weights_bytes < e.checkpoint_bytes - 15 * 10**9


@pytest.mark.parametrize(
    ("model", "tp", "measured_gib"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", 1, 14.99),
        ("Qwen/Qwen3-0.6B", 1, 1.12),  # tied: the shipped lm_head is not loaded
        ("Qwen/Qwen3-32B", 1, 61.03),
        ("openai/gpt-oss-20b", 1, 13.47),  # MXFP4 experts, hidden padded to 3072
        ("openai/gpt-oss-120b", 1, 64.38),
        ("RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic", 1, 67.72),
        ("RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic", 2, 33.88),
    ],
)
def test_weights_per_gpu_within_one_percent_of_vllm_measurements(
    model: str, tp: int, measured_gib: float
) -> None:
    e = estimate(
        resolve_model(model), EngineSettings(tp=tp, max_model_len=16000), list_devices=False
    )
    assert abs(e.weights_per_gpu / GIB - measured_gib) <= 0.01 * measured_gib


def test_tied_checkpoint_counts_its_shipped_lm_head_on_disk_only() -> None:
    entry = catalogue.lookup("qwen3-0.6b")
    e = estimate(resolve_model("qwen3-0.6b"), EngineSettings(), list_devices=False)
    lm_head = 151936 * 1024 * 2
    assert e.checkpoint_bytes == entry.checkpoint_bytes
    assert e.weights_bytes == entry.checkpoint_bytes - lm_head


# ----- AWQ / GPTQ: the byte formulas against the tensor layouts vLLM creates ---------------------

_DTYPE_BYTES = {"I32": 4, "F16": 2, "BF16": 2, "F32": 4}


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """A real safetensors file (zeroed data); returns its tensor bytes."""
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = _DTYPE_BYTES[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
    return offset


_TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}


def _projections(layers: int) -> list[tuple[str, int, int]]:
    out = []
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.self_attn.q_proj", 256, 256),
            (f"{p}.self_attn.k_proj", 128, 256),
            (f"{p}.self_attn.v_proj", 128, 256),
            (f"{p}.self_attn.o_proj", 256, 256),
            (f"{p}.mlp.gate_proj", 512, 256),
            (f"{p}.mlp.up_proj", 512, 256),
            (f"{p}.mlp.down_proj", 256, 512),
        ]
    return out


def _unquantised(layers: int) -> dict[str, tuple[str, list[int]]]:
    t = {
        "model.embed_tokens.weight": ("F16", [1024, 256]),
        "lm_head.weight": ("F16", [1024, 256]),
        "model.norm.weight": ("F16", [256]),
    }
    for i in range(layers):
        t[f"model.layers.{i}.input_layernorm.weight"] = ("F16", [256])
        t[f"model.layers.{i}.post_attention_layernorm.weight"] = ("F16", [256])
    return t


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_bytes_match_the_packed_tensor_layouts(tmp_path: Path, method: str) -> None:
    """vLLM's awq.py: qweight [in, out/8] int32, qzeros [in/g, out/8] int32, scales [in/g, out]
    fp16. gptq.py: qweight [in/8, out], qzeros [in/g, out/8], scales [in/g, out], g_idx [in]."""
    g = 64
    tensors = _unquantised(2)
    for name, out, inp in _projections(2):
        if method == "awq":
            tensors[f"{name}.qweight"] = ("I32", [inp, out // 8])
        else:
            tensors[f"{name}.qweight"] = ("I32", [inp // 8, out])
            tensors[f"{name}.g_idx"] = ("I32", [inp])
        tensors[f"{name}.qzeros"] = ("I32", [inp // g, out // 8])
        tensors[f"{name}.scales"] = ("F16", [inp // g, out])
    written = _write_safetensors(tmp_path / "model.safetensors", tensors)
    config = dict(_TINY, quantization_config={"quant_method": method, "bits": 4, "group_size": g})
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = resolve_model(str(tmp_path))
    assert model.checkpoint_bytes == written
    derived = total_bytes(
        inventory(model.architecture, checkpoint=True),
        checkpoint_format(config["quantization_config"], "float16"),
    )
    assert derived == written


def test_local_directory_counts_every_shard_header(tmp_path: Path) -> None:
    tensors = _unquantised(2)
    for name, out, inp in _projections(2):
        tensors[f"{name}.weight"] = ("F16", [out, inp])
    names = sorted(tensors)
    first = {n: tensors[n] for n in names[: len(names) // 2]}
    second = {n: tensors[n] for n in names[len(names) // 2 :]}
    total = _write_safetensors(tmp_path / "model-00001-of-00002.safetensors", first)
    total += _write_safetensors(tmp_path / "model-00002-of-00002.safetensors", second)
    index = {"metadata": {"total_size": total}, "weight_map": {n: "x" for n in names}}
    index["weight_map"] = {
        n: (
            "model-00001-of-00002.safetensors" if n in first else "model-00002-of-00002.safetensors"
        )
        for n in names
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(_TINY))
    model = resolve_model(str(tmp_path / "config.json"))
    assert model.checkpoint_bytes == total
    assert "2 files" in model.source
    arch = architecture_from_config(_TINY)
    assert total_bytes(inventory(arch), checkpoint_format({}, "float16")) == total


@pytest.mark.parametrize(
    "metadata",
    [
        ["total_size"],
        {"total_size": float("inf")},
        "big",
        {"total_size": 10**400},  # ended in an OverflowError (math.isfinite of a huge int)
        {"total_size": 2**53 + 1},
        {"total_size": True},
    ],
)
def test_an_index_with_broken_metadata_is_not_a_size(tmp_path: Path, metadata: object) -> None:
    """Without shards, only an index's total_size of 1 to 2**53 bytes stands for the
    checkpoint; anything else leaves the architecture's own count, as when there is no index."""
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": metadata}))
    (tmp_path / "config.json").write_text(json.dumps(_TINY))
    model = resolve_model(str(tmp_path))
    assert "config.json only" in model.source


def test_a_tensor_beyond_2_53_bytes_is_named(tmp_path: Path) -> None:
    """Its size became the checkpoint's, and scaling the weights to it overflowed a float."""
    raw = json.dumps({"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 10**400]}})
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw.encode())
    (tmp_path / "config.json").write_text(json.dumps(_TINY))
    with pytest.raises(SizingError, match=r"model.safetensors: tensor 'w' has 1000\d+ bytes, more"):
        resolve_model(str(tmp_path))


def test_a_shard_whose_offsets_are_not_finite_is_named(tmp_path: Path) -> None:
    raw = b'{"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, Infinity]}}'
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    (tmp_path / "config.json").write_text(json.dumps(_TINY))
    with pytest.raises(SizingError, match="model.safetensors: tensor 'w' has no data_offsets"):
        resolve_model(str(tmp_path))


def _header(body: bytes, length: int | None = None) -> bytes:
    """A safetensors header: its length (the body's unless given), then the body."""
    return struct.pack("<Q", len(body) if length is None else length) + body


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"abc", "model.safetensors is not a safetensors file (shorter than 8 bytes)"),
        (_header(b"{}", 256 * 1024 * 1024 + 1), "is not a safetensors file (header of 268435457"),
        (_header(b"{}", 100), "model.safetensors is truncated (header of 100 bytes)"),
        (_header(b"abc"), "model.safetensors has no valid safetensors JSON header"),
        (_header(b"[]"), "model.safetensors has no valid safetensors JSON header"),
        (_header(b"\xff\xfe"), "model.safetensors has no valid safetensors JSON header"),
        # json.loads recursed past the stack: a RecursionError traceback
        (_header(b"[" * 100_000), "model.safetensors has no valid safetensors JSON header"),
        (_header(b'{"w": {}}'), "model.safetensors: tensor 'w' has no data_offsets"),
        (
            _header(b'{"w": {"data_offsets": [10, 0]}}'),
            "model.safetensors: tensor 'w' has negative size",
        ),
    ],
)
def test_a_broken_safetensors_file_is_one_line(tmp_path: Path, content: bytes, says: str) -> None:
    """What a partly downloaded or foreign file gives: a line naming the file, never a
    traceback, and only the header is read (a file claiming a header of 256 MiB and more is
    refused before reading it)."""
    (tmp_path / "model.safetensors").write_bytes(content)
    (tmp_path / "config.json").write_text(json.dumps(_TINY))
    with pytest.raises(SizingError) as exc:
        resolve_model(str(tmp_path))
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_a_config_that_is_not_utf8_json_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(SizingError, match="config.json at .* is not valid JSON"):
        resolve_model(str(tmp_path))
