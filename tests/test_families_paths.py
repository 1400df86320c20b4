"""The families of issue 20 through every path: the same greedy tokens.

Each spec of tests/families.py (a checkpoint transformers saved: safetensors +
config.json) is loaded by the loader and decoded greedily (EOS ignored, :data:`N`
tokens) on:

- ``eager``   ``generate_tokens`` on the eager graph (the reference);
- ``compiled`` for the families the C++ step runs (:data:`COMPILED`: SmolLM 3's NoPE layers,
  Granite's multipliers, Gemma 2's soft-capped attention, gpt-oss's sinks, DeepSeek V3's latent attention
  and noaux_tc experts, Phi-3's LongRoPE: both prompts decode across its original 16 positions, so rows switch
  from the short table to the long one mid-stream), ``generate_tokens`` through the compiled decode step;
  the others have none, so the binding must refuse it with a reason;
- ``engine``  ``Engine`` over paged KV, two requests batched: the compiled paged step for
  :data:`COMPILED`, else refused likewise and the engine decodes on the eager graph over the pages;
- ``server``  one ``/v1/completions`` request through uvicorn on 127.0.0.1;

on MLX's stock kernels and (on a CPU) mlx-infer's CPU kernels, and after
``convert`` to 4-bit weights (eager == engine on the quantized model).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from families import SPECS, hf_setup
from http_helpers import completion_text, rendered_text
from mlx_infer.artifacts.convert import convert
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.generation.autoregressive import generate_tokens
from mlx_infer.generation.bindings.autoregressive import bind_autoregressive
from mlx_infer.state.kv import RotatingKVCache
from mlx_infer.state.paged.store import model_geometry

N = 10
PROMPT = [5, 17, 33, 3, 100, 7, 9, 11, 40, 41, 42, 43]  # 12 tokens > the sliding window of 8
PROMPT_2 = PROMPT[3:12]
PROMPTS = (PROMPT, PROMPT_2)
MIN_DISTINCT = 6  # distinct tokens over the reference streams
KERNELS = ("stock", "cpu") if mx.default_device() == mx.cpu else ("stock",)
ALL = list(SPECS)
#: Families with a compiled decode step (their specs' names start with the family)...
COMPILED = ("granite", "smollm3", "glm4", "phi3", "olmo2", "qwen3_moe", "gemma2", "gpt_oss", "deepseek_v3")
#: ... and the specs whose step is refused all the same (the reason names what).
STEP_REFUSES: dict[str, str] = {}


def compiled(name: str) -> bool:
    return any(name == f or name.startswith(f + "_") for f in COMPILED) and name not in STEP_REFUSES


def eager_tokens(loaded, prompt: list[int]) -> list[int]:
    return [t.token for t in generate_tokens(loaded.model, prompt, max_tokens=N)]


def engine_tokens(loaded, name: str) -> list[list[int]]:
    with Engine(loaded, EngineConfig(page_size=4)) as engine:
        if compiled(name):
            assert engine.paged_decode is not None, engine.paged_decode_reason
        else:
            assert engine.paged_decode is None and engine.paged_decode_reason  # refused, with a reason
            assert STEP_REFUSES.get(name, "declares no compiled decode") in engine.paged_decode_reason
        reqs = [EngineRequest(prompt_ids=p, max_tokens=N, ignore_eos=True, detokenize=False) for p in PROMPTS]
        results = engine.generate(reqs, timeout=120)
        assert engine.paged_decode is None or engine.paged_decode.failures == 0
    assert [r.error for r in results] == [None, None]
    return [r.token_ids for r in results]


def server_text(loaded) -> str:
    engine = Engine(loaded, EngineConfig(page_size=4)).start()
    try:
        return completion_text(engine, PROMPT, N)
    finally:
        engine.stop()


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", ALL)
def test_same_greedy_tokens_on_every_path(name, kernels):
    path = hf_setup(name)[0]
    load = lambda: load_model(path, cpu_kernels=kernels == "cpu")  # noqa: E731 - a fresh load per path
    loaded = load()
    binding = bind_autoregressive(loaded)
    want = [eager_tokens(loaded, p) for p in PROMPTS]
    assert len(set().union(*want)) >= MIN_DISTINCT, f"a near-constant reference hides nothing: {want}"
    if compiled(name):
        assert binding.decode_unavailable_reason() is None
        got = [[t.token for t in generate_tokens(loaded.model, p, max_tokens=N, decode=binding.create_decode())]
               for p in PROMPTS]
        assert got == want
    else:
        assert binding.create_decode() is None
        assert STEP_REFUSES.get(name, "declares no compiled decode") in binding.decode_unavailable_reason()
    assert engine_tokens(load(), name) == want
    fresh = load()
    assert server_text(fresh) == rendered_text(fresh, want[0])


@pytest.mark.parametrize("name", ALL)
def test_convert_to_4_bit_and_run(name, tmp_path: Path):
    out = convert(hf_setup(name)[0], tmp_path / "q4", quantize_bits=4, group_size=32, progress=False)
    loaded = load_model(out, cpu_kernels=False)
    assert any(k.endswith(".scales") for k in mx.load(str(out / "model.safetensors")))
    want = [eager_tokens(loaded, p) for p in PROMPTS]
    assert len(set().union(*want)) >= 3, want  # 4-bit random weights collapse sooner; still not constant
    assert engine_tokens(load_model(out, cpu_kernels=False), name) == want


@pytest.mark.parametrize("name", ALL)
def test_paged_windows_follow_the_layers(name):
    model = load_model(hf_setup(name)[0], cpu_kernels=False).model
    windows, _, _ = model_geometry(model)
    caches = model.make_cache()
    assert len(windows) == len(caches) == len(model.layers)
    for window, layer, cache in zip(windows, model.layers, caches):
        assert (window is not None) == getattr(layer, "use_sliding", False) == isinstance(cache, RotatingKVCache)
    assert any(w is not None for w in windows) == SPECS[name].windowed


def test_mla_pages_hold_the_latent():
    """DeepSeek V3's paged KV holds the latent (K) and the RoPE key (V), one head, and the
    engine's page sizing counts exactly those bytes (not 2 * heads * head_dim per token)."""
    from mlx_infer.engine.config import kv_page_bytes

    loaded = load_model(hf_setup("deepseek_v3")[0], cpu_kernels=False)
    args = loaded.model.args
    with Engine(loaded, EngineConfig(page_size=4)) as engine:
        reqs = [EngineRequest(prompt_ids=PROMPT, max_tokens=2, ignore_eos=True, detokenize=False)]
        assert engine.generate(reqs, timeout=120)[0].error is None
        store = engine.store
        for s in store.storage:
            assert s.keys[0].shape[1:] == (1, 4, args.kv_lora_rank)  # (pages, 1, P, latent)
            assert s.values[0].shape[1:] == (1, 4, args.qk_rope_head_dim)  # (pages, 1, P, rope)
        assert kv_page_bytes(loaded.model, 4) == store.page_bytes
    per_token = store.page_bytes // 4 // len(store.storage) // 4  # float32 numbers per token per layer
    assert per_token == args.kv_lora_rank + args.qk_rope_head_dim  # vs 2 * heads * (nope + rope) uncompressed
    assert per_token < 2 * args.num_attention_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "deepseek_v3", "phi3_longrope_partial"])
def test_cli_convert_to_4_bit_and_run(name, tmp_path: Path, capsys):
    """``mlx-infer convert -q`` on the checkpoint (experts, MLA's kv_b_proj, fused projections) loads and decodes."""
    from mlx_infer.cli import main

    out = tmp_path / "q4"
    rc = main(["convert", "--model", str(hf_setup(name)[0]), "-o", str(out), "-q", "--q-bits", "4",
               "--q-group-size", "32"])
    assert rc == 0, capsys.readouterr().err
    loaded = load_model(out, cpu_kernels=False)
    want = [eager_tokens(loaded, p) for p in PROMPTS]
    assert len(set().union(*want)) >= 3, want
    assert engine_tokens(load_model(out, cpu_kernels=False), name) == want


@pytest.mark.parametrize("name", ["gemma2_untied_global", "gpt_oss_yarn_untruncated", "qwen3_moe",
                                  "deepseek_v3_no_q_lora_tied"])
def test_engine_with_8_bit_paged_kv(name):
    """Quantized paged KV reaches the soft-capped and the sink attention (and MLA's latent) as
    (packed, scales, biases); they dequantize it. Oracle: the plain-KV engine's tokens; 8-bit KV moves these logits (|l| <= 5) by up to
    0.03-0.06 (measured), so near-ties may flip later tokens: the first ones and half of all must agree."""
    from mlx_infer.state.paged import LayerKV

    path = hf_setup(name)[0]
    want = engine_tokens(load_model(path, cpu_kernels=False), name)
    with Engine(load_model(path, cpu_kernels=False), EngineConfig(page_size=4, kv_scheme=LayerKV(8, 32))) as engine:
        assert all(s is None or s.scheme.quantized for s in engine.store.storage)
        reqs = [EngineRequest(prompt_ids=p, max_tokens=N, ignore_eos=True, detokenize=False) for p in PROMPTS]
        results = engine.generate(reqs, timeout=120)
        assert all(s is not None and s.scheme.quantized for s in engine.store.storage)
    assert [r.error for r in results] == [None, None]
    got = [r.token_ids for r in results]
    same = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
    print(f"{name}: 8-bit KV keeps {same}/{2 * N} greedy tokens")
    assert got[0][:3] == want[0][:3] and same >= N


@pytest.mark.parametrize("name", [n for n in ALL if SPECS[n].mlx_lm_module and SPECS[n].mlx_lm_module != "gpt_oss"])
def test_mlx_lm_quantized_directory_loads_bit_identical(name, tmp_path: Path):
    """A directory ``mlx_lm.convert -q`` wrote (quantized experts, MLA's quantized embed_q / unembed_out)
    loads here and gives mlx-lm's logits bit for bit. gpt-oss is left out: mlx-lm's own convert cannot
    read transformers' bf16 expert layout (its sanitize expects OpenAI's MXFP4 one)."""
    import json
    import shutil

    from mlx_lm import convert as mlx_lm_convert
    from mlx_lm.utils import load as mlx_lm_load

    src, cfg, ids, _ = hf_setup(name)
    shutil.copytree(src, tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text(json.dumps(SPECS[name].mlx_lm_args(cfg)))
    mlx_lm_convert(str(tmp_path / "src"), str(tmp_path / "q"), quantize=True, q_bits=4, q_group_size=32)
    theirs, _ = mlx_lm_load(str(tmp_path / "q"))
    ours = load_model(tmp_path / "q", cpu_kernels=False).model
    # Within every window (mlx-lm ignores some); past original_max_position_embeddings for LongRoPE.
    x = mx.array(ids if SPECS[name].mlx_lm == "full_only" else ids[:, :6])
    assert mx.array_equal(ours(x), theirs(x))


BF16_TIE = 0.125  # a top-2 logit gap below this (~4 bfloat16 ulps at |logit| ~ 4) is a near-tie


def eager_with_gaps(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens of the eager graph (plain caches) and each step's top-2 logit gap."""
    cache, tokens, gaps = model.make_cache(), [], []
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    for _ in range(N):
        top2 = mx.topk(logits.astype(mx.float32), 2).tolist()
        gaps.append(abs(top2[1] - top2[0]))
        tokens.append(int(logits.argmax().item()))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
    return tokens, gaps


@pytest.mark.parametrize("name", ALL)
def test_bfloat16_eager_equals_engine(name):
    """Loaded in bfloat16 (``dtype=``), the engine over paged KV (two requests batched) gives the eager
    graph's greedy tokens up to the first near-tie of the eager stream (a top-2 gap under
    :data:`BF16_TIE`): padded, batched attention sums in another order, which in bfloat16 moves a
    logit by an ulp or two (measured: deepseek_v3_yarn's second row flips at a 0.078 gap, token 8 of 10,
    where a step-by-step eager loop flips too);
    float32 batches are compared exactly (test_same_greedy_tokens_on_every_path)."""
    path = hf_setup(name)[0]
    loaded = load_model(path, dtype="bfloat16", cpu_kernels=False)
    assert loaded.model.model.embed_tokens.weight.dtype == mx.bfloat16
    want = [eager_tokens(loaded, p) for p in PROMPTS]
    assert len(set().union(*want)) >= 3, want
    got = engine_tokens(load_model(path, dtype="bfloat16", cpu_kernels=False), name)
    for prompt, w, g in zip(PROMPTS, want, got):
        # A step-by-step eager loop: its gaps say where bfloat16 rounding may pick either token (it can
        # itself leave generate's stream there: deepseek_v3_yarn's second row does, at token 8).
        tokens, gaps = eager_with_gaps(loaded.model, prompt)
        same = next((i for i, (a, b) in enumerate(zip(tokens, w)) if a != b), N)
        sure = min(next((i for i, gap in enumerate(gaps) if gap < BF16_TIE), N), same)
        assert same == N or gaps[same] < BF16_TIE, (same, gaps)  # two eager orders part only at a near-tie
        # Up to the first near-tie (there the compiled step's own summation order, SmolLM 3's and
        # Granite's, may pick the other of the two: measured smollm3 at a 0.016 gap, token 3).
        assert g[:sure] == w[:sure], (sure, gaps)
