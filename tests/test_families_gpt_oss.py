"""gpt-oss's own expert quantization: OpenAI's MXFP4 layout loads as MLX's ``mxfp4`` mode.

The checkpoint transformers saved (tests/families.py, bf16-style fused experts) is rewritten
as OpenAI ships it: each expert tensor quantized to MXFP4 (``*_blocks`` uint8
``(E, out, in/32, 16)``, ``*_scales`` uint8 ``(E, out, in/32)``, gate/up rows interleaved).
Oracle: the same checkpoint with the experts replaced by their dequantized values, loaded
dense: logits within ``ATOL`` (``gather_qmm`` vs ``gather_mm`` on identical values) and the
same greedy tokens, eager and through the engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from families import SPECS, build_mlx_lm, hf_setup
from mlx_infer.artifacts.loader import load_model
from mlx_infer.layers.switch import QuantizedSwitchLinear
from test_families_paths import PROMPTS, eager_tokens, engine_tokens

ATOL = 1e-4  # measured max |diff| printed with -s


def _mxfp4(w: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """``w (E, out, in)`` -> (blocks (E, out, in/32, 16) uint8, scales (E, out, in/32) uint8, dequantized)."""
    wq, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
    deq = mx.dequantize(wq, scales, group_size=32, bits=4, mode="mxfp4")
    E, out, _ = w.shape
    return wq.view(mx.uint8).reshape(E, out, -1, 16), scales, deq


def _interleave(a: mx.array, b: mx.array, axis: int) -> mx.array:
    return mx.stack([a, b], axis=axis + 1).flatten(axis, axis + 1)


def write_pair(tmp: Path) -> tuple[Path, Path]:
    src = hf_setup("gpt_oss")[0]
    weights = mx.load(str(src / "model.safetensors"))
    quant, dense = dict(weights), dict(weights)
    for k in [k for k in weights if k.endswith("experts.gate_up_proj")]:
        v = weights[k]  # (E, hidden, 2I), gate/up interleaved on the last axis
        gate, up = v[..., ::2].swapaxes(-1, -2), v[..., 1::2].swapaxes(-1, -2)  # (E, I, hidden)
        (gb, gs, gd), (ub, us, ud) = _mxfp4(gate), _mxfp4(up)
        del quant[k]
        quant[k + "_blocks"], quant[k + "_scales"] = _interleave(gb, ub, 1), _interleave(gs, us, 1)
        dense[k] = _interleave(gd.swapaxes(-1, -2), ud.swapaxes(-1, -2), 2)
    for k in [k for k in weights if k.endswith("experts.down_proj")]:
        blocks, scales, deq = _mxfp4(weights[k].swapaxes(-1, -2))  # (E, hidden, I)
        del quant[k]
        quant[k + "_blocks"], quant[k + "_scales"] = blocks, scales
        dense[k] = deq.swapaxes(-1, -2)
    out = []
    for name, w in (("mxfp4", quant), ("dense", dense)):
        d = tmp / name
        shutil.copytree(src, d)
        mx.save_safetensors(str(d / "model.safetensors"), w)
        out.append(d)
    cfg = json.loads((out[0] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out[0] / "config.json").write_text(json.dumps(cfg))
    return out[0], out[1]


def test_mxfp4_experts_load_and_match_their_dequantized_values(tmp_path):
    qdir, ddir = write_pair(tmp_path)
    q, d = load_model(qdir, cpu_kernels=False), load_model(ddir, cpu_kernels=False)
    experts = q.model.layers[0].mlp.experts
    assert all(isinstance(experts[p], QuantizedSwitchLinear) and experts[p].mode == "mxfp4"
               for p in ("gate_proj", "up_proj", "down_proj"))
    ids = mx.array(hf_setup("gpt_oss")[2])
    a, b = np.array(q.model(ids)), np.array(d.model(ids))
    print(f"mxfp4 vs dequantized dense: max |diff| {np.abs(a - b).max():.2e}")
    np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)
    want = [eager_tokens(d, p) for p in PROMPTS]
    assert [eager_tokens(q, p) for p in PROMPTS] == want
    assert engine_tokens(load_model(qdir, cpu_kernels=False), "gpt_oss") == want


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_mlx_lm_quantized_gpt_oss_directory_loads_bit_identical(mode, tmp_path):
    """An mlx-community style gpt-oss directory (mlx-lm's names, experts quantized by mlx-lm's
    ``quantize_model``, affine or mxfp4) loads here and gives mlx-lm's logits bit for bit."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    src, cfg, ids, _ = hf_setup("gpt_oss")
    theirs, _ = build_mlx_lm("gpt_oss")
    config = dict(SPECS["gpt_oss"].mlx_lm_args(cfg))
    group = 32
    theirs, config = quantize_model(theirs, config, group, 4, mode=mode)
    out = tmp_path / "q"
    save_model(out, theirs)
    save_config(config, out / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, out / f)
    ours = load_model(out, cpu_kernels=False).model
    assert isinstance(ours.layers[0].mlp.experts["gate_proj"], QuantizedSwitchLinear)
    x = mx.array(ids)
    assert mx.array_equal(ours(x), theirs(x))
