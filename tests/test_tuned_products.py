"""``_fast.tuned_linear`` and the decode steps' ``tuned_products`` switch, off CUDA.

On CUDA ``tuned_linear`` is a cuBLASLt primitive (cpp/matmul/cublas_product.cpp); its numerics and speed
are checked on the device by ``benchmarks/gpu_tuned_products.py``. Everywhere else it must be exactly
``x @ w.T`` and the switch must leave the decode steps' tokens and logits unchanged, so a policy that
forces it on (or a build that has it) is harmless off CUDA.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlx_infer import _fast
from mlx_infer.artifacts.loader import load_model
from mlx_infer.generation.bindings import paged_decode_step
from mlx_infer.generation.bindings.decode_step import CompiledDecodeStep
from mlx_infer.generation.bindings.graph_spec import DecodePolicy, DecodeStepUnsupported, graph_spec
from mlx_infer.generation.bindings.paged_decode_step import CompiledPagedDecodeStep, PagedDecodePolicy
from tiny import make_tiny_model_dir

ON_CUDA = _fast.tuned_products_available()
PROMPT = [5, 17, 42, 99, 7, 3, 250, 12]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=str)
@pytest.mark.parametrize("x_shape", [(24,), (5, 24), (2, 3, 24), (300, 24)], ids=["1d", "2d", "3d", "past-max-rows"])
def test_equals_matmul_exactly_off_cuda(dtype, x_shape):
    x = mx.random.normal(x_shape, key=mx.random.key(1)).astype(dtype)
    w = mx.random.normal((40, 24), key=mx.random.key(2)).astype(dtype)
    got = _fast.tuned_linear(x, w, stream=mx.cpu)
    want = mx.matmul(x, w.T, stream=mx.cpu)
    assert got.shape == x_shape[:-1] + (40,) and got.dtype == dtype
    assert mx.array_equal(got, want).item()


def test_transposed_and_mixed_inputs_equal_matmul():
    x = mx.random.normal((24, 6), key=mx.random.key(3)).astype(mx.bfloat16).T  # (6, 24), not row-contiguous
    w = mx.random.normal((24, 40), key=mx.random.key(4)).astype(mx.bfloat16).T  # (40, 24)
    assert mx.array_equal(_fast.tuned_linear(x, w, stream=mx.cpu), mx.matmul(x, w.T, stream=mx.cpu)).item()
    wf = w.astype(mx.float32)  # mixed dtypes: MLX's promotion, as mx.matmul
    got = _fast.tuned_linear(x, wf, stream=mx.cpu)
    assert got.dtype == mx.float32 and mx.array_equal(got, mx.matmul(x, wf.T, stream=mx.cpu)).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=str)
def test_bias_equals_addmm_exactly_off_cuda(dtype):
    x = mx.random.normal((2, 3, 24), key=mx.random.key(5)).astype(dtype)
    w = mx.random.normal((40, 24), key=mx.random.key(6)).astype(dtype)
    b = mx.random.normal((40,), key=mx.random.key(7)).astype(dtype)
    got = _fast.tuned_linear(x, w, b, stream=mx.cpu)
    assert mx.array_equal(got, mx.addmm(b, x, w.T, stream=mx.cpu)).item()


@pytest.mark.parametrize("x_shape,w_shape", [((4, 24), (40, 23)), ((4, 24), (24,)), ((4, 24), (2, 40, 24))])
def test_bad_shapes_raise_a_clear_error(x_shape, w_shape):
    with pytest.raises(ValueError, match=r"\[tuned_linear\] x must be \(\.\.\., K\) and w \(N, K\)"):
        _fast.tuned_linear(mx.zeros(x_shape), mx.zeros(w_shape))


@pytest.mark.parametrize("b_shape", [(39,), (1, 40)])
def test_bad_bias_raises_a_clear_error(b_shape):
    with pytest.raises(ValueError, match=r"\[tuned_linear\] bias must be \(N,\) with N = w.shape\(0\) = 40"):
        _fast.tuned_linear(mx.zeros((4, 24)), mx.zeros((40, 24)), mx.zeros(b_shape))


def test_available_only_with_cuda():
    cuda = hasattr(mx, "cuda") and mx.cuda.is_available()
    assert not ON_CUDA or cuda  # never claimed without MLX's CUDA backend


@pytest.fixture(scope="module")
def bf16_models(tmp_path_factory):
    # bfloat16: the dtype the CUDA primitive takes, so only the device (not the dtype) keeps it off here;
    # qwen2: q/k/v with biases (tuned_linear's bias path).
    return {name: load_model(make_tiny_model_dir(tmp_path_factory.mktemp(name), name, dtype=mx.bfloat16)).model
            for name in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def bf16_llama(bf16_models):
    return bf16_models["llama"]


def test_policy_resolves_off_on_the_cpu_and_reaches_the_config(bf16_llama):
    if mx.default_device().type == mx.DeviceType.cpu or not ON_CUDA:
        assert DecodePolicy().resolved_tuned_products() is False
    assert DecodePolicy(tuned_products=True).resolved_tuned_products() is True
    assert DecodePolicy(tuned_products=False).resolved_tuned_products() is False
    for forced in (True, False):
        cfg, _, _ = graph_spec(bf16_llama, policy=DecodePolicy(tuned_products=forced))
        assert cfg.tuned_products is forced


def _decode(model, policy: DecodePolicy, rows: int, steps: int = 12) -> tuple[list[list[int]], list[mx.array]]:
    """Greedy tokens and logits of ``rows`` copies of PROMPT (row r's last token shifted) through the step."""
    cache = model.make_cache()
    prompts = mx.array([PROMPT[:-1]] * rows, dtype=mx.uint32)
    model.model(prompts, cache=cache)
    y = mx.array([PROMPT[-1] + r for r in range(rows)], dtype=mx.uint32)
    step = CompiledDecodeStep(model, policy=policy)
    toks, logits = [], []
    for _ in range(steps):
        out = step.step(y, cache)  # (rows, vocab)
        logits.append(out)
        y = mx.argmax(out, axis=-1).astype(mx.uint32)
        toks.append(y.tolist())
    assert step.failures == 0
    return toks, logits


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "graph"])
@pytest.mark.parametrize("rows", [1, 3])
def test_forcing_it_on_changes_nothing_off_cuda(bf16_models, name, compile_, rows):
    # Off CUDA the switch builds mx.matmul itself: bit-identical. Where the tuned products exist (a CUDA build
    # with MLX_INFER_CUBLAS=ON) the accumulation order differs: the logits agree within bfloat16 rounding.
    model = bf16_models[name]
    base = dict(compile=compile_, compile_min_batch=1, fuse_projections=True)
    want, want_logits = _decode(model, DecodePolicy(**base, tuned_products=False), rows)
    got, got_logits = _decode(model, DecodePolicy(**base, tuned_products=True), rows)
    if ON_CUDA:
        worst = max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
                    for a, b in zip(got_logits, want_logits))
        assert worst <= 5e-2, worst
        return
    assert got == want
    assert all(mx.array_equal(a, b).item() for a, b in zip(got_logits, want_logits))


def test_paged_policy_passes_the_switch_to_graph_spec(bf16_llama, monkeypatch):
    seen = []

    def spy(model, *, policy, **kw):
        seen.append(policy)
        raise DecodeStepUnsupported("stop after graph_spec")

    monkeypatch.setattr(paged_decode_step, "graph_spec", spy)
    monkeypatch.setattr(paged_decode_step, "paged_unsupported_reason", lambda store: None)
    for forced in (True, False, None):
        with pytest.raises(DecodeStepUnsupported):
            CompiledPagedDecodeStep(bf16_llama, object(), [None], policy=PagedDecodePolicy(tuned_products=forced))
        assert seen[-1].tuned_products is forced


def test_the_environment_turns_the_tuned_default_off(monkeypatch):
    # MLX_INFER_TUNED_PRODUCTS=0: the operator's way back to MLX's matmul where the tuned products misbehave
    # (None resolves off); an explicit policy value still wins.
    from mlx_infer.generation.bindings.graph_spec import DecodePolicy

    monkeypatch.setenv("MLX_INFER_TUNED_PRODUCTS", "0")
    assert DecodePolicy().resolved_tuned_products() is False
    assert DecodePolicy(tuned_products=True).resolved_tuned_products() is True
