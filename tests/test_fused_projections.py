"""q|k|v and gate|up fused in place (generation/bindings/fused.py): one product each in the compiled
steps, the model's projections views of the fused weights, so the device holds each weight once."""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from test_decode_step import compiled_run, eager_run, max_diff, LOGITS_ATOL
from tiny import make_tiny_model_dir

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.generation.bindings import graph_spec as spec_module
from mlx_infer.generation.bindings.fused import fuse_in_place
from mlx_infer.generation.bindings.graph_spec import DecodePolicy, graph_spec


def fresh(family: str = "llama", bits: int | None = None, **overrides):
    model = load_model(make_tiny_model_dir(Path(tempfile.mkdtemp()) / family, family, **overrides)).model
    if bits is not None:
        nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def proj_bytes(model) -> int:
    total = 0
    for layer in model.model.layers:
        for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                  layer.mlp.gate_proj, layer.mlp.up_proj):
            total += sum(v.nbytes for k, v in m.items() if isinstance(v, mx.array))
    return total


@pytest.mark.parametrize("bits", [None, 4], ids=["plain", "q4"])
def test_fusing_holds_each_weight_once_and_keeps_the_values(bits):
    model = fresh(bits=bits)
    attn = model.model.layers[0].self_attn
    before_q = mx.array(attn.q_proj.weight)  # a copy of the values, to compare
    want, want_logits = eager_run(model, steps=8)
    mx.eval(model.parameters())
    mx.clear_cache()
    active = mx.get_active_memory()
    fused_bytes = proj_bytes(model)
    cfg, weights, quant = graph_spec(model, policy=DecodePolicy(fuse_projections=True))
    mx.eval(list(weights.values()))
    grown = mx.get_active_memory() - active
    assert grown < 0.25 * fused_bytes, (grown, fused_bytes)  # a copy would add all of fused_bytes
    assert "layers.0.qkv.weight" in weights and "layers.0.q.weight" not in weights
    assert "layers.0.gate_up.weight" in weights and "layers.0.up.weight" not in weights
    assert weights["layers.0.qkv.weight"].shape[0] == sum(
        m.weight.shape[0] for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert mx.array_equal(attn.q_proj.weight, before_q).item()
    assert (("layers.0.qkv" in quant) == (bits is not None))
    got, got_logits = eager_run(model, steps=8)  # the eager graph on the views: same as before
    assert got == want and max_diff(got_logits, want_logits) == 0.0
    # Idempotent while the views are in place; a replaced module fuses anew.
    again = fuse_in_place(attn, ("q_proj", "k_proj", "v_proj"), "qkv")
    assert again["weight"] is weights["layers.0.qkv.weight"]
    if bits is None:  # a module replaced after fusing (a reload, a wrapper): fused anew from what is there now
        attn.k_proj = nn.Linear(attn.k_proj.weight.shape[1], attn.k_proj.weight.shape[0], bias=False)
        anew = fuse_in_place(attn, ("q_proj", "k_proj", "v_proj"), "qkv")
        assert anew["weight"] is not weights["layers.0.qkv.weight"]
        assert attn.k_proj.weight.shape[0] + attn.q_proj.weight.shape[0] < anew["weight"].shape[0]


def test_projections_of_different_kinds_are_not_fused():
    model = fresh()
    attn = model.model.layers[0].self_attn
    attn.k_proj = nn.QuantizedLinear.from_linear(attn.k_proj, group_size=32, bits=4)
    assert fuse_in_place(attn, ("q_proj", "k_proj", "v_proj"), "qkv") is None
    cfg, weights, _ = graph_spec(model, policy=DecodePolicy(fuse_projections=True))
    assert "layers.0.q.weight" in weights and "layers.0.qkv.weight" not in weights  # this layer: one each
    assert "layers.1.qkv.weight" in weights


@pytest.mark.parametrize("family,bits", [("llama", None), ("llama", 8), ("qwen2", None), ("gemma3", None)])
def test_the_fused_steps_give_the_eager_tokens(family, bits):
    model = fresh(family, bits)
    want, want_logits = eager_run(model, steps=16)
    got, got_logits, step = compiled_run(model, steps=16, policy=DecodePolicy(compile_min_batch=1,
                                                                              fuse_projections=True))
    assert got == want and step.failures == 0
    assert max_diff(got_logits, want_logits) <= LOGITS_ATOL


def test_the_engine_paged_step_fuses_where_the_device_default_says(monkeypatch):
    """On a GPU the paged step fuses by default (``None`` resolves there); forced on here, the
    engine's tokens equal the plain model's and no second copy of the projections exists."""
    monkeypatch.setattr(spec_module.DecodePolicy, "resolved_fuse_projections", lambda self: True)
    loaded = load_model(make_tiny_model_dir(Path(tempfile.mkdtemp()) / "llama", "llama"))
    engine = Engine(loaded, EngineConfig(page_size=4, prefill_step_size=16, mixed_steps=True))
    assert engine.paged_decode is not None
    attn = loaded.model.model.layers[0].self_attn
    assert getattr(attn, "_mlx_infer_fused_qkv", None) is not None
    prompts = [[5 + (3 * i + j) % 200 for j in range(n)] for i, n in enumerate((7, 19, 12))]
    handles = [engine.submit(EngineRequest(prompt_ids=p, max_tokens=6, detokenize=False, ignore_eos=True))
               for p in prompts]
    engine.run_until_idle()
    model = loaded.model
    for p, h in zip(prompts, handles):
        ids = list(p)
        for _ in range(6):
            ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1]).item()))
        assert h.result(1).token_ids == ids[len(p):]
    assert engine.paged_decode.failures == 0 and engine.paged_decode.eager_steps == 0
