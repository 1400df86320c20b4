"""LoRA adapters (issue 21) on the families of issue 20 (tests/families.py's tiny checkpoints).

Per family, random mlx-lm adapters (made by mlx-lm's own ``linear_to_lora_layers`` on
mlx-lm's model of the same weights, tests/lora_helpers.py) on the family's own module
names: attention (phi3: the fused ``qkv_proj``), dense MLPs (phi3: ``gate_up_proj``), the
MoE routers (qwen3_moe ``mlp.gate``, gpt_oss ``mlp.router``), DeepSeek's MLA projections
(``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``) and shared experts.

- mlx-lm 0.32.2 with the same adapter (``mlx_lm.tuner.utils.load_adapters``): eager logits
  bit-identical (``mx.array_equal``) for an 8-token prompt, and for every chunk of the cached
  schedule of tests/families.py (prefill, decode, a chunk; each side its own caches). Except
  gemma2, whose mlx-lm graph treats every layer as global (tests/families.py's ``in_window``):
  there the prompt and a cached schedule stay within the window (8 tokens).
- ``mlx-infer fuse`` of the adapter loads back and gives its logits (1e-4).
- The engine: a batch mixing 4 adapters (one DoRA) and no adapter gives each row exactly
  the greedy tokens it gets alone (the compiled paged step with the bank's stacks where the family
  has one, else the eager per-row path).
- PEFT + transformers (granite, phi3's fused layers, deepseek_v3's MLA projections with and
  without q_lora_rank, gpt_oss's attention with its sinks): within 1e-4 absolute + 1e-4
  relative, greedy tokens equal (as tests/test_lora_peft.py).
- Refused with a clear error: routed experts (``SwitchLinear``: qwen3_moe ``switch_mlp.*``,
  gpt_oss ``experts.*``; PEFT's ``target_parameters`` on transformers' fused experts) and
  DeepSeek's ``kv_b_proj`` (absorbed into embed_q / unembed_out at load: no such layer runs).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from families import SCHEDULE, SPECS, WINDOW, build_mlx_lm, hf_setup, run_schedule
from lora_helpers import make_mlx_adapter, mlx_lm_with_adapter

from mlx_lm.models.cache import make_prompt_cache

from mlx_infer.adapters import AdapterError, adapter_rows, attach_adapter, bank_of
from mlx_infer.adapters.fuse import fuse_adapter
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.generation.autoregressive import generate_tokens

FAMILIES = ["gemma2", "granite", "smollm3", "glm4", "olmo2", "qwen3_moe", "phi3", "gpt_oss", "deepseek_v3"]
DEFAULT_KEYS = ["self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"]
KEYS = {  # the modules each family's adapters target (layer-relative, as mlx-lm's lora_parameters.keys)
    "qwen3_moe": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate"],
    "phi3": ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"],
    "gpt_oss": ["self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.router"],
    "deepseek_v3": ["self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj",
                    "mlp.down_proj", "mlp.shared_experts.down_proj"],
}
EXPERT_KEYS = {"qwen3_moe": "mlp.switch_mlp.gate_proj", "gpt_oss": "mlp.experts.down_proj"}
N = 6
IN_WINDOW = (4, 1, 1, 2)  # a cached schedule that fits gemma2's window
assert sum(IN_WINDOW) == WINDOW == 8
PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 12, 99, 4]]


@functools.lru_cache(maxsize=None)
def root() -> Path:
    return Path(tempfile.mkdtemp(prefix="lora-families-"))


def keys_of(family: str) -> list[str]:
    return KEYS.get(family, DEFAULT_KEYS)


@functools.lru_cache(maxsize=None)
def adapter(family: str, i: int) -> Path:
    """The family's ``i``-th random mlx-lm adapter (0..3; 3 is DoRA), each on other targets."""
    k = keys_of(family)
    kw = [dict(rank=4, keys=k), dict(rank=8, keys=k[1:3]), dict(rank=16, keys=k[2:]),
          dict(rank=2, keys=k[:2], dora=True)][i]
    return make_mlx_adapter(None, root() / f"{family}-{i}", seed=40 + i, b_std=1.0 if i else 0.3,
                            model=build_mlx_lm(family)[0], **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_lm_adapter_bit_identical(family):
    _, _, ids, _ = hf_setup(family)
    x = mx.array(ids[:, :8])  # (2, 8): within gemma2's window
    a = adapter(family, 0)
    theirs = mlx_lm_with_adapter(None, a, model=build_mlx_lm(family)[0])
    loaded = load_model(hf_setup(family)[0], cpu_kernels=False)
    name = attach_adapter(loaded.model, a)
    targets = bank_of(loaded.model).adapter(name).targets
    assert {k.split(".", 3)[3] for k in targets} == set(keys_of(family))  # every key landed somewhere
    with adapter_rows(bank_of(loaded.model).acquire(name)):
        ours = loaded.model(x)
    ref = theirs(x)
    assert mx.array_equal(ours, ref), f"{family}: max diff {mx.abs(ours - ref).max().item()}"
    base = loaded.model(x)  # no selection: the base model
    assert not mx.allclose(base, ref, atol=1e-3), "the adapter changed nothing: the test would hide a no-op"
    # the cached schedule, each side with its own caches; gemma2 (mlx-lm ignores its window): within the window
    exact = SPECS[family].mlx_lm == "exact"
    full, schedule = (mx.array(ids), SCHEDULE) if exact else (x, IN_WINDOW)  # (2, SEQ) or (2, 8)
    theirs_steps = run_schedule(theirs, make_prompt_cache(theirs), full, schedule)
    with adapter_rows(bank_of(loaded.model).acquire(name)):
        ours_steps = run_schedule(loaded.model, loaded.model.make_cache(), full, schedule)
    for n, (o, r) in enumerate(zip(ours_steps, theirs_steps)):
        assert mx.array_equal(o, r), f"{family}: chunk {n}: max diff {mx.abs(o - r).max().item()}"


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_adapter_matches_the_adapter(family):
    """``mlx-infer fuse`` (adapters/fuse.py) writes a directory that loads and gives the adapter's
    logits (merged weights round differently: 1e-4)."""
    d, _, ids, _ = hf_setup(family)
    x = mx.array(ids[:, :8])
    out = fuse_adapter(d, adapter(family, 0), root() / f"{family}-fused")
    fused = load_model(out, cpu_kernels=False).model(x)
    loaded = load_model(d, cpu_kernels=False)
    name = attach_adapter(loaded.model, adapter(family, 0))
    with adapter_rows(bank_of(loaded.model).acquire(name)):
        ref = loaded.model(x)
    np.testing.assert_allclose(np.array(fused), np.array(ref), atol=1e-4, rtol=1e-4)
    assert not mx.allclose(loaded.model(x), ref, atol=1e-3)  # the adapter changes the base model's logits


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_equals_alone(family):
    loaded = load_model(hf_setup(family)[0], cpu_kernels=False)
    names = [attach_adapter(loaded.model, adapter(family, i)) for i in range(4)]
    alone = {(n, i): [t.token for t in generate_tokens(loaded.model, p, max_tokens=N, adapter=n)]
             for n in names + [None] for i, p in enumerate(PROMPTS)}
    streams = {n: tuple(tuple(alone[n, i]) for i in range(len(PROMPTS))) for n in names + [None]}
    assert len(set(streams.values())) == len(streams), "two adapters give the same tokens: rows indistinguishable"
    reqs = [EngineRequest(prompt_ids=p, max_tokens=N, ignore_eos=True, detokenize=False, adapter=n,
                          request_id=f"{n}-{i}") for i, p in enumerate(PROMPTS) for n in names + [None]]
    with Engine(loaded, EngineConfig(page_size=4, max_batch=16, prefix_cache=False)) as engine:
        results = engine.generate(reqs, timeout=300)
        # Eager families: the per-row path over the bank's stacks; the compiled ones (granite, smollm3, glm4, olmo2,
        # gemma2): the compiled paged step with the bank's stacks as inputs (phi3's adapters on its fused qkv_proj /
        # gate_up_proj too: one linear each in the step); qwen3_moe's and gpt_oss's target their routers
        # (mlp.gate, mlp.router), which the step's adapters do not take: refused, with the reason.
        if loaded.model.declaration.compiled_decode and family not in ("qwen3_moe", "gpt_oss"):
            assert engine.paged_decode is not None and engine.paged_decode.failures == 0
        else:
            assert engine.paged_decode is None and engine.paged_decode_reason
    assert [r.error for r in results] == [None] * len(results)
    got = {r.request_id: r.token_ids for r in results}
    for (n, i), want in alone.items():
        assert got[f"{n}-{i}"] == want, (family, n, i)
    assert all(bank_of(loaded.model).in_use(n) == 0 for n in names)


@pytest.mark.parametrize("family", list(EXPERT_KEYS))
def test_expert_targets_are_refused(family):
    a = make_mlx_adapter(None, root() / f"{family}-experts", seed=9, keys=["self_attn.q_proj", EXPERT_KEYS[family]],
                         model=build_mlx_lm(family)[0])
    mlx_lm_with_adapter(None, a, model=build_mlx_lm(family)[0])  # mlx-lm takes it (LoRASwitchLinear)
    loaded = load_model(hf_setup(family)[0], cpu_kernels=False)
    with pytest.raises(AdapterError, match=r"routed experts.*SwitchLinear.*not supported") as e:
        attach_adapter(loaded.model, a)
    assert EXPERT_KEYS[family] in str(e.value)
    assert bank_of(loaded.model).names == []  # the bank is unchanged


PEFT_TARGETS = {
    "granite": ["q_proj", "v_proj", "down_proj"],
    "phi3": ["qkv_proj", "gate_up_proj", "o_proj"],
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"],
    "deepseek_v3_no_q_lora_tied": ["q_proj", "kv_a_proj_with_mqa", "o_proj"],  # no mlx-lm oracle: PEFT's
    "gpt_oss": ["q_proj", "v_proj", "o_proj"],
}


@pytest.mark.parametrize("family", list(PEFT_TARGETS))
def test_peft_adapter_matches_peft(tmp_path, family):
    from test_lora_peft import IDS, make_peft_adapter

    d = hf_setup(family)[0]
    adir, ref = make_peft_adapter(d, tmp_path / family, seed=72, r=4, lora_alpha=8,
                                  target_modules=PEFT_TARGETS[family])
    loaded = load_model(d, cpu_kernels=False)
    name = attach_adapter(loaded.model, adir)
    base = np.array(loaded.model(mx.array(IDS)))
    with adapter_rows(bank_of(loaded.model).acquire(name)):
        ours = np.array(loaded.model(mx.array(IDS)))
    assert np.abs(base - ref).max() > 1e-2, "the adapter changed nothing: the test would hide a no-op"
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_deepseek_kv_b_proj_is_refused(tmp_path):
    from test_lora_peft import make_peft_adapter

    d = hf_setup("deepseek_v3")[0]
    adir, _ = make_peft_adapter(d, tmp_path / "kvb", seed=73, r=4, lora_alpha=8, target_modules=["kv_b_proj"])
    loaded = load_model(d, cpu_kernels=False)
    with pytest.raises(AdapterError, match=r"kv_b_proj.*embed_q / unembed_out.*merge_and_unload"):
        attach_adapter(loaded.model, adir)
    # the same with target_modules as a regex (no name check up front): the tensors' target is refused
    cfg = adir / "adapter_config.json"
    import json

    c = json.loads(cfg.read_text())
    c["target_modules"] = r".*kv_b_proj"
    cfg.write_text(json.dumps(c))
    with pytest.raises(AdapterError, match=r"self_attn\.kv_b_proj.*absorbed attention.*cannot be applied"):
        attach_adapter(loaded.model, adir)


def test_peft_expert_parameters_are_refused(tmp_path):
    """PEFT maps ``down_proj`` onto transformers' fused experts as ``target_parameters`` (a LoRA on
    the stacked expert tensor, ``mlp.experts.lora_A`` of rank r * experts): refused, naming them."""
    from test_lora_peft import make_peft_adapter

    d = hf_setup("deepseek_v3")[0]
    adir, _ = make_peft_adapter(d, tmp_path / "experts", seed=74, r=4, lora_alpha=8, target_modules=["q_a_proj"],
                                target_parameters=["mlp.experts.down_proj"])
    loaded = load_model(d, cpu_kernels=False)
    with pytest.raises(AdapterError, match=r"target_parameters \['mlp.experts.down_proj'\].*not supported"):
        attach_adapter(loaded.model, adir)
