"""gpt-oss through the compiled decode steps: attention sinks, biased routed experts (issue 20).

Models: tests/families.py's ``gpt_oss`` (3 layers, sliding window 8 on layers 0 and 2, 4 experts, top 2,
biased router and experts, per-head sinks) and ``gpt_oss_yarn_untruncated`` (YaRN RoPE), the checkpoints
transformers saved, loaded by the loader, float32, on MLX's stock kernels and on mlx-infer's CPU kernels.

Oracle: the eager graph (``models/gpt_oss.py``: MLX's SDPA with ``sinks=``, ``swiglu_oai`` experts, the
softmax over the chosen router logits) over its plain caches, or over the paged store's caches for the
paged step. Prompts of 12 tokens and 24 steps after: past the window. Checks:

- plain step (traced and built per step): greedy tokens equal, teacher-forced logits within :data:`ATOL`;
- paged step, B=6 rows of different lengths: the paged kernel (CPU, or CUDA on an NVIDIA GPU) and the
  gather path within :data:`ATOL` of the eager graph's logits, same argmax, every step;
- the sinks are really read: with every sink raised by :data:`SINK_SHIFT` the eager logits move by more than
  :data:`MOVED_MIN`, and the steps built from that model still match it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from families import hf_setup
from mlx_infer.artifacts.loader import load_model
from mlx_infer.generation.bindings.decode_step import CompiledDecodeStep
from mlx_infer.generation.bindings.graph_spec import DecodePolicy, graph_spec
from test_gemma2_decode_step import (KERNELS, STEPS, assert_paged_step_matches_eager,
                                     assert_plain_step_matches_eager, max_diff, paged_logits, run_plain)

# Float32, logits up to ~5. Measured on CPU (mlx 0.32.4) max |step - eager| over 24 steps: plain step
# <= 1.7e-6, paged kernel <= 2.4e-6, gather 0.0 (summation order only).
ATOL = 1e-4
SINK_SHIFT = 3.0  # the tiny checkpoints' sinks are ~0.2: raised, each takes most of its head's softmax
MOVED_MIN = 0.1
NAMES = ["gpt_oss", "gpt_oss_yarn_untruncated"]


def model_of(name: str, cpu_kernels: bool = False, sink_shift: float = 0.0):
    model = load_model(hf_setup(name)[0], cpu_kernels=cpu_kernels).model
    if sink_shift:
        for layer in model.layers:
            layer.self_attn.sinks = layer.self_attn.sinks + sink_shift
        mx.eval(model.parameters())
    return model


def test_spec_carries_sinks_and_the_expert_switches():
    model = model_of("gpt_oss")
    cfg, weights, _ = graph_spec(model)
    assert (cfg.activation, cfg.swiglu_limit, cfg.moe_softmax_topk) == ("swiglu_oai", 7.0, True)
    assert (cfg.num_experts, cfg.top_k_experts, cfg.windows) == (4, 2, [8, 0, 8])
    assert all(weights[f"layers.{i}.sinks"] is layer.self_attn.sinks for i, layer in enumerate(model.layers))
    assert "layers.0.experts.gate.bias" in weights and "layers.0.router.bias" in weights


@pytest.mark.parametrize("cpu_kernels", KERNELS, ids=["stock", "cpu"][:len(KERNELS)])
@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "graph"])
@pytest.mark.parametrize("name", NAMES)
def test_plain_step_matches_eager(name, compile_, cpu_kernels):
    assert_plain_step_matches_eager(model_of(name, cpu_kernels), compile_, f"{name} cpu_kernels={cpu_kernels}")


@pytest.mark.parametrize("name", NAMES)
def test_paged_step_kernel_and_gather_match_eager(name):
    assert_paged_step_matches_eager(model_of(name), name)


def test_steps_follow_the_sinks():
    """Raised sinks move the eager logits far; both steps, built from that model, still match it."""
    base, shifted = model_of("gpt_oss"), model_of("gpt_oss", sink_shift=SINK_SHIFT)
    forced = mx.random.randint(3, 300, (STEPS,), key=mx.random.key(3)).astype(mx.uint32)
    _, want_base = run_plain(base, forced, None)
    _, want = run_plain(shifted, forced, None)
    assert max_diff(want, want_base) > MOVED_MIN
    _, got = run_plain(shifted, forced, CompiledDecodeStep(shifted, policy=DecodePolicy(compile_min_batch=1)))
    assert max_diff(got, want) <= ATOL
    paged_want = paged_logits(shifted, "eager")
    assert max_diff(paged_want, paged_logits(base, "eager")) > MOVED_MIN
    for mode in ("kernel", "gather"):
        assert max_diff(paged_logits(shifted, mode), paged_want) <= ATOL
