"""Property: whatever a local model's config.json holds, `vramsched estimate` gives an estimate whose
annotation is a Kubernetes quantity covering it, or refuses with one line (a SizingError). The
configs are the catalogue's with keys deleted, set to odd values (NaN, 1e306, 2**53 + 1, lists,
text), or added: rope scaling, quantisation, layer kinds, MoE and MLA fields, a text_config
wrapper. A rope factor whose stretch overflowed a float, a field of 1e300 and a `--max-num-seqs`
beyond int32 once ended in an OverflowError traceback here."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from extender.quantity import parse_quantity
from extender.sizing import catalogue
from extender.sizing.engines import EngineSettings
from extender.sizing.errors import SizingError
from extender.sizing.estimate import estimate, resolve_model

ODD = st.sampled_from(
    [0, -1, 1, 2, 3, 7, 64, 10**6, 2**53, 2**53 + 1, 10**30, 10**400, 1.5, 0.0, 1e300, 1e306]
    + [-1e-9]
    + [float("nan"), float("inf"), "", "x", "12", None, True, False, [], {}, [1, 2], [0], [-1]]
)
KEYS = st.sampled_from(
    ["sliding_window", "sliding_window_pattern", "max_window_layers", "num_local_experts"]
    + ["n_routed_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size"]
    + ["first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step", "mlp_only_layers"]
    + ["shared_expert_intermediate_size", "n_shared_experts", "kv_lora_rank", "q_lora_rank"]
    + ["qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim", "num_key_value_heads"]
    + ["num_nextn_predict_layers", "use_sliding_window", "tie_word_embeddings", "torch_dtype"]
    + ["max_position_embeddings", "hidden_size", "num_hidden_layers", "num_attention_heads"]
    + ["intermediate_size", "vocab_size", "model_type"]
)
ROPE = st.builds(
    lambda kind, factor, original: {"type": kind, "factor": factor, **original},
    st.sampled_from(["yarn", "dynamic", "linear", "llama3", "x"]),
    st.sampled_from([4, 32.0, 0.5, 1e20, 1e306, float("nan"), float("inf"), "4"]),
    st.one_of(
        st.just({}), st.just({}), st.builds(lambda n: {"original_max_position_embeddings": n}, ODD)
    ),
)
QUANT = st.fixed_dictionaries(
    {"quant_method": st.sampled_from(["awq", "gptq", "fp8", "compressed-tensors", "mxfp4", "x"])},
    optional={
        "bits": ODD,
        "group_size": ODD,
        "weight_block_size": st.one_of(ODD, st.lists(ODD, max_size=2)),
        "config_groups": st.builds(
            lambda bits, group: {"g": {"weights": {"num_bits": bits, "group_size": group}}},
            ODD,
            ODD,
        ),
    },
)
SETTINGS = st.builds(
    EngineSettings,
    engine=st.sampled_from(["vllm", "tgi", "sglang"]),
    max_model_len=st.sampled_from([None, 1, 4096, 10**6]),
    max_num_seqs=st.sampled_from([None, 1, 256, 2**31 - 1, 2**31]),
    tp=st.sampled_from([1, 2, 8]),
    quantization=st.sampled_from([None, "awq", "fp8"]),
    kv_cache_dtype=st.sampled_from([None, "fp8"]),
)


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    entry = draw(st.sampled_from(catalogue.entries()))
    cfg: dict[str, Any] = json.loads(json.dumps(entry.config))
    for _ in range(draw(st.integers(1, 3))):
        change = draw(st.sampled_from(["set", "set", "delete", "rope", "quant", "wrap", "kinds"]))
        event(change)
        if change == "set":
            cfg[draw(KEYS)] = draw(ODD)
        elif change == "delete" and cfg:
            del cfg[draw(st.sampled_from(sorted(cfg)))]
        elif change == "rope":
            cfg["rope_scaling"] = draw(ROPE)
        elif change == "quant":
            cfg["quantization_config"] = draw(QUANT)
        elif change == "wrap" and "text_config" not in cfg:
            cfg = {"model_type": draw(st.sampled_from(["gemma3", "llava"])), "text_config": cfg}
        elif change == "kinds":
            kinds = st.sampled_from(["sliding_attention", "full_attention", 3, None])
            cfg["layer_types"] = draw(st.lists(kinds, max_size=40))
    return cfg


def _finite_and_not_negative(value: Any) -> bool:
    if isinstance(value, dict):
        return all(_finite_and_not_negative(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite_and_not_negative(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value) and value >= 0
    return not isinstance(value, int) or value >= 0


@settings(
    max_examples=400,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(config=configs(), engine=SETTINGS)
def test_a_config_gets_an_estimate_it_covers_or_one_line(
    config: dict[str, Any], engine: EngineSettings
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config, allow_nan=True))
        try:
            e = estimate(resolve_model(folder), engine, list_devices=False)
        except SizingError as exc:
            event("refused")
            assert str(exc) and "\n" not in str(exc)
            return
    event("estimated")
    reserved = parse_quantity(e.model_memory)  # a quantity Kubernetes reads
    assert reserved >= e.reservation_per_gpu * max(1, engine.tp)
    assert e.reservation_per_gpu >= e.total_per_gpu > 0
    out = e.to_dict()
    json.dumps(out, allow_nan=False)  # what `-o json` prints: no NaN or Infinity
    assert _finite_and_not_negative({k: v for k, v in out.items() if k.endswith("Bytes")})
