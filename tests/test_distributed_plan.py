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
