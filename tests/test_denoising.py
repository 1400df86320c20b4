"""Diffusion Gemma: graph, denoising binding and canvas loop against transformers (tiny random configs, CPU).

Configs (3 layers: sliding, sliding, full; window 8; canvas 6; vocab 320; full
layers with their own head dim, one KV head and values = keys; proportional
partial RoPE on full layers):

- ``moe``    router top-2 of 4 experts beside the dense MLP (transformers' only variant)
- ``dense``  no experts. transformers has no dense variant, so its MoE model is
             made dense: expert branch post-norm set to 0, dense-branch post-norm
             to 1, and ``rms_norm_eps=1e-12`` so the dense branch's extra RMSNorm is
             the identity up to float32 rounding (with eps 1e-6 it is not: MLP
             outputs have mean squares ~1e-3).

Oracle: transformers 5.24 ``DiffusionGemmaForBlockDiffusion`` in float32 (eager
attention), ``torch.manual_seed(0)``, every tensor perturbed (norms, scalars by
0.3, matrices by 0.05) so each one matters; its state_dict loads into ours.

Tolerances, stated and measured:

- Encoder hidden states, encoder logits (tied head) and decoder logits (first
  step, a self-conditioned step, and after the state is extended by a block;
  prompt 12 > window and prompt 1): ``|ours - hf| <= HF_ATOL = 1e-4``;
  measured max 2.2e-5 on encoder hidden states (magnitude ~4) and 1.0e-5 on
  logits (magnitude ~2).
- Generation, both samplers, sampled and greedy proposals, with and without early
  stop, over >= 3 blocks: token-for-token equal to transformers' ``generate``
  given the same initial canvas. Randomness is replayed, not shared: our run
  records its draws (canvas re-noising and categorical proposals, from its own
  keys) and transformers' ``torch.multinomial`` and ``initialize_canvas`` return
  them in order; every recorded draw must be consumed. The confidence-threshold
  sampler is given to transformers as an ``EntropyBoundSampler`` subclass.
- 8-bit quantized (group 32) weights through the loader: bit-identical to the
  same model quantized in memory (both steps); first-step logits within
  ``QUANT_ATOL = 0.3`` of float (measured 0.12) with the same argmax canvas.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
from transformers.cache_utils import DynamicCache
from transformers.models.diffusion_gemma import generation_diffusion_gemma as hf_gen

from mlx_infer.contracts import GraphDeclaration, GraphDescriptor
from mlx_infer.errors import MlxInferError, UnsupportedModelError
from mlx_infer.generation.bindings.denoising import (GRAPH_ABI_DENOISING, assert_denoising_graph,
                                                     bind_denoising)
from mlx_infer.generation.denoising import (CanvasNoise, DenoisingParams, generate_denoising,
                                            request_params)
from mlx_infer.generation.stopping import CancelToken
from mlx_infer.models import MODEL_TYPE_ALIASES, get_model_classes
from mlx_infer.sampling import RequestRNG, SamplingParams

HF_ATOL = 1e-4
QUANT_ATOL = 0.3
S, F = "sliding_attention", "full_attention"
VOCAB, C, WINDOW = 320, 6, 8
MOE = dict(num_experts=4, top_k_experts=2, moe_intermediate_size=32)
_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
             sliding_window=WINDOW, layer_types=[S, S, F], max_position_embeddings=256, **MOE)
_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, head_dim=8)
_DENSE_OFF = ("router.", "experts.", "post_feedforward_layernorm_1.", "post_feedforward_layernorm_2.",
              "pre_feedforward_layernorm_2.")


@pytest.fixture(autouse=True, scope="module")
def _torch_one_thread():
    """Tiny torch ops on 2 cores beside MLX's threads: 1 thread is ~30x faster (0.18 s vs 6 s per generate)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def hf_setup(name: str):
    """(HF model, our config dict, HF weights as mx float32) for ``name`` in {"moe", "dense"}."""
    # dense: eps 1e-12 so that HF's extra RMSNorm on the dense branch is a no-op to float32 rounding.
    text = dict(_TEXT, rms_norm_eps=1e-12) if name == "dense" else dict(_TEXT)
    config = DiffusionGemmaConfig(text_config=text, vision_config=_VISION, canvas_length=C)
    config._attn_implementation = config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = DiffusionGemmaForBlockDiffusion(config).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            if "inv_freq" in n or "embed_scale" in n or "vision" in n:
                continue
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim <= 1 else 0.05))
        sd = hf.state_dict()
        for k, v in sd.items():
            if name == "dense" and k.endswith("post_feedforward_layernorm_2.weight"):
                v.zero_()
            if name == "dense" and k.endswith("post_feedforward_layernorm_1.weight"):
                v.fill_(1.0)
            if k.startswith("model.encoder.language_model.layers.") and k.endswith("layer_scalar"):
                v.copy_(sd[k.replace("model.encoder.language_model.", "model.decoder.")])  # one set of layers
    cfg = config.to_dict()
    weights = {k: mx.array(v.detach().float().numpy()) for k, v in hf.state_dict().items() if "vision" not in k}
    if name == "dense":
        cfg["text_config"].update(num_experts=None, top_k_experts=None, moe_intermediate_size=None)
        weights = {k: v for k, v in weights.items() if not any(f".{part}" in k for part in _DENSE_OFF)}
    return hf, cfg, weights


def build_ours(name: str):
    _, cfg, weights = hf_setup(name)
    model_cls, args_cls = get_model_classes(cfg["model_type"])
    model = model_cls(args_cls.from_dict(cfg))
    model.load_weights(list(model.sanitize(dict(weights)).items()), strict=True)
    mx.eval(model.parameters())
    return model


@functools.lru_cache(maxsize=None)
def ours(name: str):
    return build_ours(name)


def _diff(a: mx.array, b: torch.Tensor) -> float:
    return float(np.abs(np.array(a.astype(mx.float32)) - b.detach().float().numpy()).max())


# -- graph --------------------------------------------------------------------


def test_config_and_declaration():
    assert MODEL_TYPE_ALIASES["diffusion_gemma"] == MODEL_TYPE_ALIASES["diffusion_gemma_text"] == "diffusion_gemma"
    model = ours("moe")
    assert model.declaration == GraphDeclaration(method="denoising", bounded_prefill_workspace=True)
    assert model.canvas_length == C and model.vocab_size == VOCAB and model.embed_scale == 64**0.5
    t = model.args.trunk
    assert t.layer_head_dims == [16, 16, 32] and t.layer_kv_heads == [2, 2, 1] and t.enable_moe_block
    assert t.final_logit_softcapping == 30.0 and t.hidden_size_per_layer_input == 0
    assert not ours("dense").args.trunk.enable_moe_block


@pytest.mark.parametrize("name", ["dense", "moe"])
@pytest.mark.parametrize("prompt_len", [12, 1])
def test_logits_match_transformers(name, prompt_len):
    """Encoder hidden/logits and decoder logits (plain, self-conditioned, after an extension) vs HF."""
    hf, _, _ = hf_setup(name)
    model = ours(name)
    rs = np.random.RandomState(prompt_len)
    prompt, canvas, block = (rs.randint(0, VOCAB, (1, n)) for n in (prompt_len, C, C))
    t = lambda a: torch.tensor(a)  # noqa: E731
    with torch.no_grad():
        cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
        o1 = hf(input_ids=t(prompt), cache=cache, decoder_input_ids=t(canvas))
        o2 = hf(cache=cache, decoder_input_ids=t(canvas), self_conditioning_logits=o1.logits)
        enc = hf.model.encoder(input_ids=t(block), cache=cache).last_hidden_state
        o3 = hf(cache=cache, decoder_input_ids=t(canvas), self_conditioning_logits=o2.logits)
        hf_enc_logits = hf.lm_head(o1.encoder_last_hidden_state)
        hf_enc_logits = torch.tanh(hf_enc_logits / 30.0) * 30.0

    state = model.make_cache()
    h1 = model.encode(mx.array(prompt), state)
    l1 = model.decoder_logits(mx.array(canvas), state)
    l2 = model.decoder_logits(mx.array(canvas), state, model.soft_embeddings(l1))
    h2 = model.encode(mx.array(block), state)
    l3 = model.decoder_logits(mx.array(canvas), state, model.soft_embeddings(l2))
    assert [c.offset for c in state] == [prompt_len + C] * 3  # the decoder never writes the state
    diffs = {"encoder": _diff(h1, o1.encoder_last_hidden_state), "encoder_logits":
             _diff(model.logits_from_hidden(h1), hf_enc_logits), "step1": _diff(l1, o1.logits),
             "self_conditioned": _diff(l2, o2.logits), "extended_encoder": _diff(h2, enc),
             "after_extension": _diff(l3, o3.logits)}
    assert max(diffs.values()) <= HF_ATOL, diffs
    assert l1.dtype == mx.float32 and l1.shape == (1, C, VOCAB)
    # The feedback matters far beyond the tolerance (so the self-conditioned check means something).
    assert float(mx.abs(l2 - l1).max()) > 100 * HF_ATOL


def test_encoder_scalar_mismatch_is_refused():
    _, cfg, weights = hf_setup("moe")
    model_cls, args_cls = get_model_classes("diffusion_gemma")
    model = model_cls(args_cls.from_dict(cfg))
    key = "model.encoder.language_model.layers.0.layer_scalar"
    bad = dict(weights, **{key: weights[key] + 1})
    with pytest.raises(UnsupportedModelError, match="layer_scalar"):
        model.sanitize(bad)


def _write_dir(path, model, cfg, *, quantization=None, generation_config=None):
    from tiny import make_tokenizer_json

    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps({**cfg, **({"quantization": quantization} if quantization else {})}))
    (path / "tokenizer.json").write_text(make_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                            "add_bos_token": True}))
    (path / "generation_config.json").write_text(json.dumps(generation_config or {"eos_token_id": 1}))
    return path


def test_quantized_weights(tmp_path):
    """8-bit weights (experts via gather_qmm, embeddings for both the head and the soft embeddings)."""
    from mlx_infer.artifacts.loader import load_model_dir

    _, cfg, _ = hf_setup("moe")
    q = build_ours("moe")
    nn.quantize(q, group_size=32, bits=8)
    loaded = load_model_dir(_write_dir(tmp_path / "q8", q, cfg, quantization={"group_size": 32, "bits": 8}))
    assert isinstance(loaded.model.model.embed_tokens, nn.QuantizedEmbedding)
    assert type(loaded.model.layers[0].experts.switch_glu.gate_proj).__name__ == "QuantizedSwitchLinear"
    rs = np.random.RandomState(3)
    prompt, canvas = mx.array(rs.randint(0, VOCAB, (1, 10))), mx.array(rs.randint(0, VOCAB, (1, C)))
    outs = []
    for m in (q, loaded.model, ours("moe")):
        state = m.prefill(prompt)
        l1 = m.decoder_logits(canvas, state)
        outs.append((l1, m.decoder_logits(canvas, state, m.soft_embeddings(l1))))
    assert all(mx.array_equal(a, b) for a, b in zip(outs[0], outs[1]))
    # Against float, the first step only: self-conditioning feeds a softmax of the logits back
    # and this random model's scale-1 attention amplifies the 8-bit error (0.8 measured there).
    assert float(mx.abs(outs[0][0] - outs[2][0]).max()) <= QUANT_ATOL
    assert mx.array_equal(mx.argmax(outs[0][0], -1), mx.argmax(outs[2][0], -1))
    # Quantized soft embeddings equal softmax @ the dequantized table.
    e = q.model.embed_tokens
    table = mx.dequantize(e.weight, e.scales, e.biases, e.group_size, e.bits)
    ref = mx.softmax(outs[0][0], axis=-1) @ table * q.embed_scale
    assert float(mx.abs(q.soft_embeddings(outs[0][0]) - ref).max()) <= 1e-5


# -- generation against transformers --------------------------------------------


class RecordingNoise(CanvasNoise):
    """Our draws, kept so transformers can be handed the same ones."""

    def __init__(self, *args):
        super().__init__(*args)
        self.canvases, self.proposals = [], []

    def canvas(self):
        c = super().canvas()
        self.canvases.append(np.array(c))
        return c

    def propose(self, logits):
        p = super().propose(logits)
        self.proposals.append(np.array(p))
        return p


class HFConfidenceThresholdSampler(hf_gen.EntropyBoundSampler):
    """The confidence-threshold rule in transformers' sampler interface (independent torch code)."""

    threshold: float

    def accept_canvas(self, current_canvas, denoiser_canvas, logits, cur_step):
        conf = torch.softmax(logits.float(), -1).gather(-1, denoiser_canvas[..., None]).squeeze(-1)
        mask = conf >= self.threshold
        if not mask.any():
            mask = torch.zeros_like(mask)
            mask[0, conf[0].argmax()] = True
        self.accepted_token_mask = mask
        return torch.where(mask, denoiser_canvas, current_canvas)


def hf_generate(monkeypatch, hf, prompt, init, noise: RecordingNoise, params: DenoisingParams, max_new: int):
    canvases, proposals = list(noise.canvases), list(noise.proposals)
    calls = {"init": 0}

    def initialize_canvas(batch_size, device):
        calls["init"] += 1
        if calls["init"] == 1:  # evaluated (and discarded) beside the injected first canvas
            return torch.zeros(1, C, dtype=torch.long)
        return torch.tensor(canvases.pop(0), dtype=torch.long)

    def multinomial(probs, num_samples):
        if params.greedy:
            return probs.argmax(-1, keepdim=True)
        return torch.tensor(proposals.pop(0), dtype=torch.long).reshape(-1, 1)

    sampler_cls = hf_gen.EntropyBoundSampler if params.sampler == "entropy-bound" else HFConfidenceThresholdSampler

    def prepare_sampler(gc):
        sampler = sampler_cls(gc.sampler_config, C, VOCAB, gc.max_denoising_steps)
        sampler.threshold = params.confidence_threshold
        sampler.initialize_canvas = initialize_canvas
        return sampler

    monkeypatch.setattr(torch, "multinomial", multinomial)
    monkeypatch.setattr(hf, "_prepare_sampler", prepare_sampler)
    out = hf.generate(torch.tensor([prompt]), decoder_input_ids=torch.tensor(init)[None], max_new_tokens=max_new,
                      max_denoising_steps=params.steps, t_min=params.t_min, t_max=params.t_max,
                      sampler_config=hf_gen.EntropyBoundSamplerConfig(entropy_bound=params.entropy_bound),
                      stability_threshold=params.stability_steps,
                      confidence_threshold=params.stop_entropy or 1e-12,  # 1e-12: never confident enough
                      eos_token_id=[1, 106], pad_token_id=0)
    monkeypatch.undo()
    assert not canvases and not proposals, "transformers consumed fewer draws than we made"
    return out.sequences[0, len(prompt):].tolist()


CASES = {  # name: (config, params, seed); "stop" cases set stop_entropy=50 (above any entropy here)
    "entropy-bound": ("moe", dict(sampler="entropy-bound"), 3),
    "entropy-bound-greedy-stop": ("moe", dict(sampler="entropy-bound", greedy=True, entropy_bound=100.0,
                                              stop_entropy=50.0), 6),
    "confidence": ("moe", dict(sampler="confidence-threshold"), 4),
    "confidence-greedy-stop": ("moe", dict(sampler="confidence-threshold", greedy=True, confidence_threshold=1e-3,
                                           stop_entropy=50.0), 3),
    "dense-entropy-bound-stop0": ("dense", dict(sampler="entropy-bound", stability_steps=0, stop_entropy=50.0), 5),
    "dense-confidence-greedy": ("dense", dict(sampler="confidence-threshold", greedy=True), 6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generate_matches_transformers(monkeypatch, case):
    """Same initial canvas, same draws: the same tokens as transformers over 3 blocks.

    Early stop: with ``stability_steps=0`` it fires after the first step; with greedy,
    accept-all proposals once the argmax canvas repeats; without ``stop_entropy`` never.
    """
    name, kwargs, seed = CASES[case]
    steps, blocks = 8, 3
    rs = np.random.RandomState(seed)
    prompt, init = rs.randint(2, VOCAB, (10,)).tolist(), rs.randint(0, VOCAB, (C,))
    params = DenoisingParams(steps=steps, seed=seed, **{"stop_entropy": None, **kwargs})
    noise = RecordingNoise(VOCAB, C, RequestRNG(seed))
    gen = generate_denoising(bind_denoising(ours(name)), prompt, params=params, max_tokens=blocks * C,
                             initial_canvas=init, noise=noise)
    tokens = [t.token for t in gen]
    assert len(tokens) == blocks * C and gen.stats.finish_reason == "length"  # several blocks, no early EOS
    all_steps = blocks * steps + blocks - 1  # one re-noise per step, one fresh canvas per later block
    if params.stop_entropy is None:
        assert len(noise.canvases) == all_steps
    else:
        assert len(noise.canvases) < all_steps  # early stop fired
    assert tokens == hf_generate(monkeypatch, hf_setup(name)[0], prompt, init, noise, params, blocks * C)


# -- determinism, stats, cancellation -------------------------------------------


def _tokens(model, seed, **kw):
    params = DenoisingParams(steps=4, seed=seed, **kw)
    return [t.token for t in generate_denoising(bind_denoising(model), [2, 5, 7, 9], params=params, max_tokens=2 * C)]


def test_seed_determinism():
    model = ours("moe")
    a, b, c = _tokens(model, 7), _tokens(model, 7), _tokens(model, 8)
    assert a == b and a != c
    assert _tokens(model, 7, sampler="confidence-threshold", greedy=True) == \
        _tokens(model, 7, sampler="confidence-threshold", greedy=True)


def test_eos_stats_and_release():
    model = ours("moe")
    binding = bind_denoising(model)
    states = []
    spy = dataclasses.replace(binding, prefill=lambda t: states.append(binding.prefill(t)) or states[-1])
    # EOS: token 1 or 106 or the caller's; the first one ends the run and is yielded.
    gen = generate_denoising(spy, [2, 5, 7], params=DenoisingParams(steps=3, seed=0), max_tokens=4 * C)
    tokens = [t.token for t in gen]
    assert len(tokens) <= 4 * C and gen.stats.generated_tokens == len(tokens)
    eos_gen = generate_denoising(spy, [2, 5, 7], params=DenoisingParams(steps=3, seed=0), max_tokens=4 * C,
                                 eos_token_ids=[tokens[2]])
    stopped = list(eos_gen)
    first = min(i for i, t in enumerate(tokens) if t in {1, 106, tokens[2]})
    assert [t.token for t in stopped] == tokens[:first + 1] and stopped[-1].finish_reason == "stop"
    s = eos_gen.stats
    assert s.finish_reason == "stop" and s.prompt_tokens == 3 and s.generated_tokens == first + 1
    assert s.prefill_ms > 0 and s.decode_ms > 0 and s.cache_tokens == 3 + C * (first // C)
    assert all(state == [] for state in states)  # every run released its state


def test_cancellation_between_steps_and_close_release_state():
    model = ours("moe")
    binding = bind_denoising(model)
    states = []
    spy = dataclasses.replace(binding, prefill=lambda t: states.append(binding.prefill(t)) or states[-1])
    cancel = CancelToken()

    class CancellingNoise(CanvasNoise):
        def canvas(self):
            if self.rng.steps >= 10:  # mid-way through the second block
                cancel.cancel()
            return super().canvas()

    params = DenoisingParams(steps=4, seed=1, stop_entropy=None)
    gen = generate_denoising(spy, [3, 4, 5], params=params, max_tokens=4 * C, cancel=cancel,
                             noise=CancellingNoise(VOCAB, C, RequestRNG(1)))
    tokens = list(gen)
    assert len(tokens) == C and gen.stats.finish_reason == "cancelled" and states[-1] == []
    gen = generate_denoising(spy, [3, 4, 5], params=params, max_tokens=4 * C)
    next(gen)
    gen.close()
    assert gen.stats.finish_reason == "cancelled" and gen.stats.generated_tokens == 1 and states[-1] == []


# -- bad input ----------------------------------------------------------------------


def test_binding_refuses_autoregressive_or_incomplete_graphs():
    gemma4_cls, gemma4_args = get_model_classes("gemma4_text")
    ar = gemma4_cls(gemma4_args.from_dict(dict(_TEXT, model_type="gemma4_text", hidden_size_per_layer_input=0)))
    with pytest.raises(TypeError, match="'autoregressive' method, not 'denoising'"):
        bind_denoising(ar)

    class NoSoftEmbeddings:
        declaration = GraphDeclaration(method="denoising")
        canvas_length, vocab_size = C, VOCAB
        prefill = extend_prefill = decoder_logits = staticmethod(lambda *a: None)

    with pytest.raises(TypeError, match="provides no soft_embeddings"):
        bind_denoising(NoSoftEmbeddings())

    class ZeroCanvas(NoSoftEmbeddings):
        soft_embeddings = staticmethod(lambda *a: None)
        canvas_length = 0

    with pytest.raises(MlxInferError, match="canvas_length must be a positive integer"):
        bind_denoising(ZeroCanvas())
    with pytest.raises(MlxInferError, match="method is 'autoregressive'.*graph_abi is 'mlx-hidden-bsh-v1'"):
        assert_denoising_graph(GraphDescriptor(id="x", method="autoregressive"))
    assert_denoising_graph(GraphDescriptor(id="x", method="denoising", graph_abi=GRAPH_ABI_DENOISING))


def test_canvas_length_zero_is_refused(tmp_path):
    from mlx_infer.artifacts.loader import load_model_dir
    from mlx_infer.errors import ModelLoadError

    _, cfg, _ = hf_setup("moe")
    with pytest.raises(ValueError, match="canvas_length must be a positive integer"):
        get_model_classes("diffusion_gemma")[1].from_dict({**cfg, "canvas_length": 0})
    path = _write_dir(tmp_path / "zero", ours("moe"), {**cfg, "canvas_length": 0})
    with pytest.raises(ModelLoadError, match="canvas_length"):
        load_model_dir(path)


@pytest.mark.parametrize("kwargs,match", [
    (dict(t_max=0.4, t_min=0.4), "t_max must be greater than t_min"),
    (dict(t_max=0.3, t_min=0.5), "t_max must be greater than t_min"),
    (dict(t_min=-0.1), "t_min must be >= 0"),
    (dict(t_max=float("nan")), "t_max must be a finite number"),
    (dict(steps=0), "steps must be an integer >= 1"),
    (dict(sampler="top-k"), "sampler must be one of"),
    (dict(entropy_bound=0.0), "entropy_bound must be > 0"),
    (dict(confidence_threshold=1.5), r"confidence_threshold must be in \(0, 1\]"),
    (dict(stop_entropy=0.0), "stop_entropy must be > 0"),
])
def test_bad_params(kwargs, match):
    with pytest.raises(MlxInferError, match=match):
        DenoisingParams(**kwargs)


def test_bad_requests():
    binding = bind_denoising(ours("moe"))
    with pytest.raises(MlxInferError, match="prompt is empty"):
        generate_denoising(binding, [])
    with pytest.raises(MlxInferError, match="initial_canvas must hold 6 token ids"):
        generate_denoising(binding, [2], initial_canvas=[1, 2, 3])
    with pytest.raises(MlxInferError, match="initial_canvas must hold 6 token ids"):
        generate_denoising(binding, [2], initial_canvas=[VOCAB] * C)
    with pytest.raises(MlxInferError, match="top_p"):
        request_params(SamplingParams(top_p=0.5))
    cold = request_params(SamplingParams())
    assert cold.greedy and cold.sampler == "confidence-threshold"
    hot = request_params(SamplingParams(temperature=1.0, seed=3),
                         {"t_max": 0.8, "t_min": 0.2, "max_denoising_steps": None})  # HF writes unset keys as null
    assert (hot.sampler, hot.t_max, hot.t_min, hot.seed, hot.greedy, hot.steps) == \
        ("entropy-bound", 1.0, 0.25, 3, False, 48)


# -- CLI ------------------------------------------------------------------------------


def test_cli_generate_on_a_diffusion_checkpoint(tmp_path, capsys):
    """An HF-layout checkpoint (save_pretrained) + tokenizer: the CLI picks the denoising method."""
    from tiny import make_tokenizer_json

    from mlx_infer.artifacts.loader import load_model
    from mlx_infer.cli import main
    from mlx_infer.generation import denoising

    hf, _, _ = hf_setup("moe")
    path = tmp_path / "dg"
    hf.save_pretrained(path)
    (path / "tokenizer.json").write_text(make_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                            "add_bos_token": True}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "max_denoising_steps": 4}))
    argv = ["generate", "--model", str(path), "--prompt", "The capital of France", "-m", "12", "--seed", "5",
            "--verbose", "false"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    loaded = load_model(path)
    assert loaded.model.declaration.method == "denoising"
    with denoising.generate(loaded, "The capital of France", sampling=SamplingParams(seed=5), max_tokens=12) as gen:
        text = "".join(t.text for t in gen)
    assert out == text + "\n"
    assert gen.stats.generated_tokens >= 1 and gen.stats.finish_reason in ("stop", "length")
    assert main(argv + ["--temp", "0.7"]) == 0
    capsys.readouterr()
    assert main(argv + ["--top-p", "0.5"]) == 2
    assert "temperature and a seed" in capsys.readouterr().err
