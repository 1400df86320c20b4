"""PEFT adapters (issue 21) vs PEFT + transformers on the same tiny checkpoint.

The adapter is made and saved by PEFT itself (``get_peft_model`` + ``save_pretrained``:
``adapter_config.json`` + ``adapter_model.safetensors``), with random ``lora_B`` (zero at
init). Different backends (torch vs MLX, float32): logits within 1e-4 absolute + 1e-4
relative, greedy tokens equal. Covered: plain scaling (alpha / r), rsLoRA (alpha / sqrt(r)),
``rank_pattern`` / ``alpha_pattern`` and DoRA on llama; plain LoRA on qwen2, qwen3 and gemma3.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import peft  # the test extra's oracle
import pytest
import torch

from tiny import make_tiny_model_dir

from mlx_infer.adapters import adapter_rows, attach_adapter, bank_of
from mlx_infer.artifacts.loader import load_model

IDS = [[5, 17, 33, 2, 90, 41, 7, 12]]
CASES = {
    "lora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "rslora": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["k_proj", "o_proj", "up_proj"]),
    "patterns": dict(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj"], rank_pattern={"gate_proj": 8},
                     alpha_pattern={"gate_proj": 2}),
    "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
}


_DIRS: dict[str, Path] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("peft")


@pytest.fixture
def model_dir(root) -> Path:
    return family_dir(root, "llama")


def family_dir(root: Path, family: str) -> Path:
    if family not in _DIRS:
        spread = {"vector_noise": True, "embed_scale": 0.5} if family == "gemma3" else {}
        _DIRS[family] = make_tiny_model_dir(root / family, family, **spread)
    return _DIRS[family]


def make_peft_adapter(model_dir: Path, out: Path, seed: int, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    model = peft.get_peft_model(hf, peft.LoraConfig(lora_dropout=0.0, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
            elif "lora_magnitude_vector" in name:
                p.mul_(1.0 + 0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(str(out))
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits.float().numpy()
    return out, logits


@pytest.mark.parametrize("case", list(CASES))
def test_peft_adapter_matches_peft(model_dir, tmp_path, case):
    adir, ref = make_peft_adapter(model_dir, tmp_path / case, seed=70, **CASES[case])
    assert (adir / "adapter_model.safetensors").is_file()
    loaded = load_model(model_dir, cpu_kernels=False)
    name = attach_adapter(loaded.model, adir)
    adapter = bank_of(loaded.model).adapter(name)
    assert adapter.format == "peft" and adapter.kind == ("dora" if case == "dora" else "lora")
    if case == "patterns":
        gate = adapter.targets["model.layers.0.mlp.gate_proj"]
        assert gate.rank == 8 and gate.scale == 2 / 8
        assert adapter.targets["model.layers.0.self_attn.q_proj"].scale == 8 / 4
    if case == "rslora":
        assert adapter.targets["model.layers.1.mlp.up_proj"].scale == pytest.approx(4 / 8 ** 0.5)
    base = np.array(loaded.model(mx.array(IDS)))
    with adapter_rows(bank_of(loaded.model).acquire(name)):
        ours = np.array(loaded.model(mx.array(IDS)))
    assert np.abs(base - ref).max() > 1e-2, "the adapter changed nothing: the test would hide a no-op"
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_peft_adapter_matches_peft_for_other_families(root, tmp_path, family):
    d = family_dir(root, family)
    adir, ref = make_peft_adapter(d, tmp_path / family, seed=71, **CASES["lora"])
    loaded = load_model(d, cpu_kernels=False)
    name = attach_adapter(loaded.model, adir)
    with adapter_rows(bank_of(loaded.model).acquire(name)):
        ours = np.array(loaded.model(mx.array(IDS)))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
