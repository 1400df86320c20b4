"""The compiled step consumes exactly the model's parameters: a parameter the translation would ignore, or a
weight name the step does not read, is a clear error — never a step that silently runs without it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_infer import _fast
from mlx_infer.generation.bindings.graph_spec import DecodeStepUnsupported, graph_spec
from mlx_infer.models import get_model_classes
from tiny import CONFIGS


def _model(family: str, **overrides):
    config = dict(CONFIGS[family], **overrides)
    cls, args = get_model_classes(config["model_type"])
    model = cls(args.from_dict(config))
    mx.eval(model.parameters())
    return model


#: family -> config overrides: gemma2 is gemma3's tiny config read as Gemma 2 (no q/k norms, soft caps).
FAMILIES = {"llama": {}, "qwen3": {}, "gemma3": {}, "gemma4": {},
            "gemma2": {"model_type": "gemma2", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_parameter_of_every_family_is_handed_to_the_step(family):
    over = FAMILIES[family]
    cfg, weights, quant = graph_spec(_model("gemma3" if over else family, **over))
    _fast.DecodeStep(cfg, weights, quant)  # and every handed-over name is one the step reads


def test_a_parameter_the_step_would_not_read_refuses_the_step_by_name():
    model = _model("llama")
    model.model.layers[1].self_attn.extra_scale = mx.ones((4,))  # a weight no translation knows
    with pytest.raises(DecodeStepUnsupported, match=r"model\.layers\.1\.self_attn\.extra_scale"):
        graph_spec(model)


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_a_weight_name_the_step_does_not_read_is_an_error(family):
    cfg, weights, quant = graph_spec(_model(family))
    weights["layers.0.q_norm_typo.weight"] = mx.ones((16,))
    with pytest.raises(ValueError, match=r"does not use: 'layers\.0\.q_norm_typo\.weight'"):
        _fast.DecodeStep(cfg, weights, quant)


def test_a_missing_weight_is_an_error():
    cfg, weights, quant = graph_spec(_model("llama"))
    del weights["layers.1.mlp_norm.weight"]
    with pytest.raises(ValueError, match=r"missing weight 'layers\.1\.mlp_norm\.weight'"):
        _fast.DecodeStep(cfg, weights, quant)


def test_a_decode_switch_the_step_lacks_is_refused_by_name():
    """A family file's ``decode_switches`` may only name settings the C++ step has."""
    model = _model("llama")
    model.decode_switches = lambda: {"residual_scale": 0.5, "logit_temperature_typo": 2.0}
    with pytest.raises(DecodeStepUnsupported, match=r"logit_temperature_typo"):
        graph_spec(model)
    model.decode_switches = lambda: {"residual_scale": 0.5}
    cfg, _, _ = graph_spec(model)
    assert cfg.residual_scale == 0.5


def test_a_norm_over_every_head_is_refused_under_tensor_parallelism(monkeypatch):
    """OLMo 2's q/k norms span all heads; a rank of a tensor-parallel graph holds some heads only."""
    import mlx_infer.generation.bindings.graph_spec as spec

    model = _model("llama")
    model.decode_switches = lambda: {"qk_norm_whole": True}
    graph_spec(model)  # one process: fine (the llama graph simply has no q/k norms)
    monkeypatch.setattr(spec, "_apply_tensor_parallel", lambda cfg, m: setattr(cfg, "tp_backend", "ring"))
    with pytest.raises(DecodeStepUnsupported, match=r"tensor-parallel.*q/k norms span"):
        graph_spec(model)


# Gemma 4's block is switches of the one forward (cpp/decode/forward.cpp): each switch reads its own weights,
# so a switch left off leaves them unread (an error naming one), and a switch on without them is missing one.
GEMMA4_SWITCH_WEIGHTS = [("moe", "moe_beside_mlp", False, r"does not use: .*'layers\.0\.mlp_norm_2\.weight'"),
                         ("moe", "v_from_k", [0, 0, 0], r"missing weight 'layers\.2\.v\.weight'"),
                         ("ple", "per_layer_width", 0, r"does not use: 'embed_per_layer\.weight'"),
                         ("ple", "layer_scalars", False, r"does not use: .*'layers\.0\.layer_scalar'")]


@pytest.mark.parametrize("variant,switch,value,error", GEMMA4_SWITCH_WEIGHTS,
                         ids=[s for _, s, _, _ in GEMMA4_SWITCH_WEIGHTS])
def test_each_gemma4_switch_reads_its_own_weights(variant, switch, value, error):
    from tiny import GEMMA4_SWITCHES

    cfg, weights, quant = graph_spec(_model("gemma4", **GEMMA4_SWITCHES[variant]))
    _fast.DecodeStep(cfg, weights, quant)  # as translated: every weight read
    setattr(cfg, switch, value)
    with pytest.raises(ValueError, match=error):
        _fast.DecodeStep(cfg, weights, quant)


# DeepSeek V3 (generation/bindings/mla_spec.py): the latent attention's and the noaux_tc router's weights are
# covered both ways too (tests/families.py's checkpoint: q LoRA, a dense first layer, shared experts).
def _deepseek():
    from families import hf_setup
    from mlx_infer.artifacts.loader import load_model

    return load_model(hf_setup("deepseek_v3")[0], cpu_kernels=False).model


def test_deepseek_parameter_the_step_would_not_read_refuses_the_step_by_name():
    model = _deepseek()
    model.model.layers[2].self_attn.extra_scale = mx.ones((4,))
    with pytest.raises(DecodeStepUnsupported, match=r"model\.layers\.2\.self_attn\.extra_scale"):
        graph_spec(model)


@pytest.mark.parametrize("name,error", [
    ("layers.1.router.correction_bias", r"missing weight 'layers\.1\.router\.correction_bias'"),
    ("layers.2.kv_a_norm.weight", r"missing weight 'layers\.2\.kv_a_norm\.weight'"),
    ("layers.0.unembed_out.weight", r"missing weight 'layers\.0\.unembed_out\.weight'"),
    ("layers.1.shared.up.weight", r"missing weight 'layers\.1\.shared\.up\.weight'"),
])
def test_deepseek_missing_weight_is_an_error(name, error):
    cfg, weights, quant = graph_spec(_deepseek())
    del weights[name]
    with pytest.raises(ValueError, match=error):
        _fast.DecodeStep(cfg, weights, quant)


def test_deepseek_weight_or_switch_the_step_does_not_read_is_an_error():
    cfg, weights, quant = graph_spec(_deepseek())
    _fast.DecodeStep(cfg, weights, quant)  # as translated: every weight read
    typo = dict(weights, **{"layers.1.kv_a_norm_typo.weight": mx.ones((32,))})
    with pytest.raises(ValueError, match=r"does not use: 'layers\.1\.kv_a_norm_typo\.weight'"):
        _fast.DecodeStep(cfg, typo, quant)
    cfg.moe_noaux_tc = False  # softmax routing would leave the correction bias unread
    with pytest.raises(ValueError, match=r"does not use: 'layers\.1\.router\.correction_bias'"):
        _fast.DecodeStep(cfg, weights, quant)
