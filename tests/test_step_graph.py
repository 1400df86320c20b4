"""The shape of a decode step's graph: what MLX must encode every step.

MLX's host cost grows with a step's graph nodes, kernel launches and views alike (an H100 census of a
1-stream llama-1B engine step, session 20: 685 nodes for ~215 kernels, 2.08 ms to submit; 314 nodes and
-18 % step time once the views went). These tests pin what the lean step graph removed, on MLX's stock
kernels (the graph a GPU builds, less the CUDA-only kernels; on the CPU device, so a CUDA machine checks the
same graph): no Flatten / Unflatten around a product (the hidden state is (B, E)), no Transpose of a weight
(made once at load), the paged K/V written by one scatter per part. The last test pins which steps take the
norm kernels (MLX_INFER_FUSED_NORM_MAX_ROWS), on whatever device runs it.
"""

from __future__ import annotations

import collections
import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.engine.scheduler import DECODE
from mlx_infer.generation.bindings.graph_spec import DecodePolicy
from mlx_infer.generation.bindings.decode_step import CompiledDecodeStep
from tiny import make_tiny_model_dir


def _host_step():
    """benchmarks/host_step.py (its ``step_census`` and ``_arrays``: one census for the benchmark and the tests)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "host_step.py"
    spec = importlib.util.spec_from_file_location("host_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_HS = _host_step()
census, _arrays = _HS.step_census, _HS._arrays


def engine_step_census(loaded, rows: int, monkeypatch) -> collections.Counter:
    """The graph of one decode step of the engine's compiled paged step, ``rows`` streams decoding."""
    engine = Engine(loaded, EngineConfig(max_batch=rows, num_pages=rows * 16 + 1))
    seen: list[collections.Counter] = []
    armed = [False]
    real = mx.async_eval

    def spy(*args, **kwargs):
        if armed[0]:
            armed[0] = False
            seen.append(census(_arrays(args)))
        return real(*args, **kwargs)

    monkeypatch.setattr(mx, "async_eval", spy)
    for i in range(rows):
        engine.submit(EngineRequest(prompt_ids=[5 + i, 6, 7, 8, 9, 10], max_tokens=12, ignore_eos=True,
                                    detokenize=False))
    while not (len(engine.scheduler.running) == rows and all(r.state == DECODE for r in engine.scheduler.running)):
        engine.step()
    engine.step()
    armed[0] = True
    engine.step()
    assert engine.paged_decode is not None, engine.paged_decode_reason
    engine.run_until_idle()
    engine.stop()
    assert seen, "the engine's step handed MLX nothing to evaluate"
    return seen[0]


@pytest.fixture
def llama(tmp_path):
    """The tiny llama on MLX's stock kernels: loaded and run on the CPU device (a CUDA machine's GPU graph takes
    our CUDA kernels, whose products, norms and attention are CustomKernel nodes, and its SDPA; those graphs are
    pinned by benchmarks/host_step.py's census on the device)."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield load_model(make_tiny_model_dir(tmp_path / "llama", "llama"), cpu_kernels=False)
    finally:
        mx.set_default_device(previous)


@pytest.mark.parametrize("rows", [1, 4])
def test_paged_step_graph_has_no_product_views_and_one_scatter_per_part(llama, rows, monkeypatch):
    c = engine_step_census(llama, rows, monkeypatch)
    layers = len(llama.model.layers)
    products = 7 * layers + 1  # q, k, v, o, gate, up, down a layer, and the head
    assert c["Matmul"] == products, c
    assert c["Flatten"] == 0 and c["Unflatten"] == 0, c  # the hidden state is (B, E)
    # RoPE on the unfused q and k transposes them (B, 1, H, D) -> (B, H, 1, D), and v alike: 3 a layer, none of
    # a weight (made once at load).
    assert c["Transpose"] <= 3 * layers, c
    # K and V: one write each; a GPU's one Scatter into the 4-D storage, the CPU's one put_along_axis over its flat
    # view (MLX's CPU Scatter is slower per element; cpp/decode/paged_step.cpp: write_part).
    write, other = ("ScatterAxis", "Scatter") if mx.default_device() == mx.cpu else ("Scatter", "ScatterAxis")
    assert c[write] == 2 * layers and c[other] == 0, c


def test_plain_step_graph_has_no_product_views(llama):
    """The plain step's graph (op by op: its forward handed back unevaluated) is as lean."""
    model = llama.model
    cache = model.make_cache()
    mx.eval(model.model(mx.array([[5, 6, 7, 8]], mx.uint32), cache=cache), [c.state for c in cache])
    step = CompiledDecodeStep(model, policy=DecodePolicy(compile=False))
    logits = step.step(mx.array([9], mx.uint32), cache)  # (1, vocab), lazily
    c = census([logits])
    layers = len(model.layers)
    products = 7 * layers + 1
    # On the CPU MLX's SDPA falls back to ops: two matmuls a layer, its GQA heads unflattened and flattened
    # back, K transposed. Nothing else may flatten or transpose: no product of ours does.
    assert c["Matmul"] == products + 2 * layers, c  # the forward is there to count
    assert c["Flatten"] <= layers and c["Unflatten"] <= layers, c
    assert c["Transpose"] <= 5 * layers, c  # q, k, v for RoPE, the output's, SDPA's K


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("gemma3") / "gemma3", "gemma3"), cpu_kernels=False)


def test_steps_above_the_norm_row_bound_take_mlx_norms(gemma3, monkeypatch):
    """A step of more rows than MLX_INFER_FUSED_NORM_MAX_ROWS keeps MLX's RMSNorm nodes (a prompt chunk's buffers
    stay fewer in a CUDA graph: fused_cuda.h); a step within it takes the norm kernels on CUDA (gemma3's q/k,
    sandwich and next-block norms), and elsewhere the graph is the same either way."""
    def count(bound: str | None) -> collections.Counter:
        if bound is None:
            monkeypatch.delenv("MLX_INFER_FUSED_NORM_MAX_ROWS", raising=False)
        else:
            monkeypatch.setenv("MLX_INFER_FUSED_NORM_MAX_ROWS", bound)
        return engine_step_census(gemma3, 4, monkeypatch)

    default, within, above = count(None), count("4"), count("3")
    assert within == default, (within, default)
    if mx.default_device() == mx.cpu:
        assert default == above, (default, above)  # no CUDA kernel applies: the bound changes nothing
    else:
        # the kernels take the q/k norms and the norms after each residual; above the bound MLX's RMSNorm has
        # every norm: per layer attention's input norm, q's, k's, the two sandwich post-norms, the MLP's input
        # norm; and the final norm
        assert above["RMSNorm"] == 6 * len(gemma3.model.layers) + 1, above
        assert default["RMSNorm"] < above["RMSNorm"] and sum(default.values()) < sum(above.values()), (default, above)
