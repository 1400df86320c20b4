"""The tensor-parallel plan and the sharded reader, without processes: exact slices, clear refusals."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer.errors import MlxInferError, UnsupportedModelError
from mlx_infer.models import get_model_classes
from mlx_infer.parallel.group import ParallelGroup, collective_timeout, launched_backend, parallel_mode
from mlx_infer.parallel.load import read_header
from mlx_infer.parallel.shard import Slice, make_plan
from tiny import CONFIGS, GEMMA4_SWITCHES


def _model(family: str, **overrides):
    config = dict(CONFIGS[family], **overrides)
    cls, args = get_model_classes(config["model_type"])
    return cls(args.from_dict(config))


def _pg(rank: int, size: int) -> ParallelGroup:
    return ParallelGroup(group=None, rank=rank, size=size, backend="ring")


def test_llama_plan_slices_heads_mlp_and_vocabulary():
    model = _model("llama", attention_bias=True)  # 4 heads, 2 KV heads, head dim 16, vocab 320
    plan = make_plan(model, _pg(1, 2))
    a = "model.layers.0.self_attn"
    assert plan.slices[f"{a}.q_proj.weight"] == Slice(0, 2, 4, 4)  # query heads 2, 3
    assert plan.slices[f"{a}.k_proj.weight"] == Slice(0, 1, 2, 2)  # KV head 1
    assert plan.slices[f"{a}.o_proj.weight"] == Slice(-1, 2, 4, 4)
    assert plan.slices[f"{a}.o_proj.bias"].zero_unless_leader  # added once, by rank 0
    assert plan.slices["model.layers.0.mlp.down_proj.weight"] == Slice(-1, 1, 2, 2)
    assert plan.heads[a] == (2, 1)
    assert plan.vocab_parallel and plan.slices["lm_head.weight"] == Slice(0, 1, 2, 2)
    assert "model.layers.0.input_layernorm.weight" not in plan.slices  # replicated
    assert plan.local_shape(f"{a}.q_proj.weight", (64, 64)) == (32, 64)
    assert plan.local_shape(f"{a}.o_proj.weight", (64, 64)) == (64, 32)


def test_fewer_kv_heads_than_ranks_are_replicated():
    model = _model("llama")  # 2 KV heads over 4 ranks: ranks 0, 1 read KV head 0; ranks 2, 3 KV head 1
    heads = [make_plan(model, _pg(r, 4)).slices["model.layers.0.self_attn.k_proj.weight"] for r in range(4)]
    assert [(s.lo, s.hi) for s in heads] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert "KV heads replicated" in make_plan(model, _pg(0, 4)).notes[0]


@pytest.mark.parametrize("size,message", [(3, "4 attention heads cannot be split over 3"),
                                          (8, "4 attention heads cannot be split over 8")])
def test_indivisible_heads_are_refused(size, message):
    with pytest.raises(UnsupportedModelError, match=message):
        make_plan(_model("llama"), _pg(0, size))


def test_gemma4_experts_split_whole_and_refused_when_indivisible():
    model = _model("gemma4", **GEMMA4_SWITCHES["moe"])  # 4 experts
    plan = make_plan(model, _pg(1, 2))
    assert plan.slices["model.layers.0.experts.switch_glu.gate_proj.weight"] == Slice(0, 1, 2, 2)
    assert plan.experts == [f"model.layers.{i}.experts" for i in range(3)]
    assert "model.layers.0.router.proj.weight" not in plan.slices  # every rank routes every token
    with pytest.raises(UnsupportedModelError, match="4 experts cannot be split over 8"):
        make_plan(_model("gemma4", **GEMMA4_SWITCHES["moe"], num_attention_heads=8), _pg(0, 8))


def test_a_split_off_a_quantization_group_is_refused():
    with pytest.raises(UnsupportedModelError, match="cannot split .* into 4 equal parts"):
        Slice(-1, 1, 2, 4).bounds(2, "layers.0.o_proj.scales")  # 2 groups over 4 ranks


def test_unsupported_family_names_the_supported_ones():
    from mlx_infer.parallel.pipeline import make_pipeline_plan

    with pytest.raises(UnsupportedModelError, match="pipeline parallel is not supported for the 'gemma4'"):
        make_pipeline_plan(_model("gemma4"), _pg(0, 2))


def test_launch_environment_and_settings(monkeypatch):
    assert launched_backend({}) is None
    assert launched_backend({"MLX_HOSTFILE": "/h.json", "MLX_RANK": "1"}) == "ring"
    assert launched_backend({"NCCL_HOST_IP": "10.0.0.1", "MLX_WORLD_SIZE": "8"}) == "nccl"
    assert launched_backend({"MLX_JACCL_COORDINATOR": "a:1"}) == "jaccl"
    monkeypatch.setenv("MLX_INFER_DIST_TIMEOUT", "soon")
    with pytest.raises(MlxInferError, match="MLX_INFER_DIST_TIMEOUT='soon'"):
        collective_timeout()
    monkeypatch.setenv("MLX_INFER_DIST_TIMEOUT", "2.5")
    assert collective_timeout() == 2.5
    monkeypatch.setenv("MLX_INFER_PARALLEL", "data")
    with pytest.raises(MlxInferError, match="use tensor .* or pipeline"):
        parallel_mode()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.uint32])
def test_sharded_reader_reads_exactly_the_slice(tmp_path, dtype):
    full = (mx.arange(6 * 8).reshape(6, 8) * 3).astype(dtype)  # (6, 8)
    mx.save_safetensors(str(tmp_path / "w.safetensors"), {"w": full})
    (t,) = read_header(tmp_path / "w.safetensors").values()
    rows = t.read(Slice(0, 1, 2, 3), rank=1)  # rows 2..3
    cols = t.read(Slice(-1, 3, 4, 4), rank=3)  # columns 6..7
    assert rows.dtype == dtype and mx.array_equal(rows, full[2:4])
    assert mx.array_equal(cols, full[:, 6:8])
    assert mx.array_equal(t.read(Slice(0, 0, 1, 1, zero_unless_leader=True), rank=1), mx.zeros_like(full))
    np.testing.assert_array_equal(np.array(t.read(None, 0).astype(mx.float32)), np.array(full.astype(mx.float32)))


def test_adapters_are_refused_clearly_when_the_model_is_split(monkeypatch, tmp_path):
    """Under mlx.launch the base layers are sharded and an adapter's A/B would not fit them: a clear error."""
    from mlx_infer.adapters import AdapterBank, AdapterError
    from mlx_infer.parallel import group

    bank = AdapterBank(_model("llama"), capacity=1)
    monkeypatch.setattr(group, "_CURRENT", _pg(0, 2))
    with pytest.raises(AdapterError, match="split over processes.*mlx-infer fuse"):
        bank.register("a", tmp_path)  # refused before the path is even read
    assert bank.names == []


_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5)


def _new_family(model_type: str, **overrides):
    cls, args = get_model_classes(model_type)
    return cls(args.from_dict(dict(_SMALL, model_type=model_type, **overrides)))


def test_phi3_fused_projections_split_part_by_part(tmp_path):
    """q | k | v rows each split by heads (not the raw rows): rank 1 of 2 holds query heads 2, 3 and KV head 1."""
    from mlx_infer.parallel.shard import FusedSlice

    plan = make_plan(_new_family("phi3"), _pg(1, 2))  # head dim 16: q 64 rows, k 32, v 32
    qkv = plan.slices["model.layers.0.self_attn.qkv_proj.weight"]
    assert isinstance(qkv, FusedSlice)
    assert qkv.ranges(128, "qkv") == [(32, 64), (80, 96), (112, 128)]
    assert plan.slices["model.layers.0.mlp.gate_up_proj.weight"].ranges(256, "gate_up") == [(64, 128), (192, 256)]
    assert plan.local_shape("model.layers.0.self_attn.qkv_proj.weight", (128, 64)) == (64, 64)
    full = mx.arange(128 * 3).reshape(128, 3).astype(mx.float32)  # (128, 3)
    mx.save_safetensors(str(tmp_path / "w.safetensors"), {"w": full})
    (t,) = read_header(tmp_path / "w.safetensors").values()
    want = mx.concatenate([full[32:64], full[80:96], full[112:128]])
    assert mx.array_equal(t.read(qkv, rank=1), want)


def test_moe_sinks_and_all_head_norms_follow_their_heads():
    plan = make_plan(_new_family("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), _pg(1, 2))
    assert plan.slices["model.layers.0.mlp.switch_mlp.down_proj.weight"] == Slice(0, 1, 2, 2)  # experts 2, 3
    assert "model.layers.0.mlp.gate.weight" not in plan.slices  # the router is replicated
    assert "model.layers.0.mlp" in plan.row_parallel
    gpt = make_plan(_new_family("gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                intermediate_size=32), _pg(0, 2))
    assert gpt.slices["model.layers.0.self_attn.sinks"] == Slice(0, 0, 2, 4)  # sinks of query heads 0, 1
    assert gpt.slices["model.layers.0.mlp.experts.gate_proj.bias"] == Slice(0, 0, 1, 2)
    olmo = make_plan(_new_family("olmo2"), _pg(1, 2))
    assert olmo.slices["model.layers.0.self_attn.q_norm.weight"] == Slice(0, 2, 4, 4)
    assert "model.layers.1.self_attn.k_norm" in olmo.global_norms


@pytest.mark.parametrize("model_type", ["phi3", "qwen3_moe", "olmo2", "smollm3"])
def test_new_families_refuse_pipeline_parallel(model_type):
    from mlx_infer.parallel.pipeline import make_pipeline_plan

    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if model_type == "qwen3_moe" else {}
    with pytest.raises(UnsupportedModelError, match=f"pipeline parallel is not supported for the '{model_type}'"):
        make_pipeline_plan(_new_family(model_type, **extra), _pg(0, 2))
