"""Gemma 2 through the compiled decode steps: soft-capped attention scores and logits (issue 20).

Models: tests/families.py's ``gemma2`` (3 layers, sliding window 8 on layers 0 and 2,
``attn_logit_softcapping`` 5, ``final_logit_softcapping`` 3, tied head) and
``gemma2_untied_global`` (no caps, two global layers, untied head), the checkpoints transformers
saved, loaded by the loader, float32, on MLX's stock kernels and on mlx-infer's CPU kernels.

Oracle: the eager graph (``models/gemma2.py``: ``softcapped_attention`` over its plain caches, or
over the paged store's caches for the paged step). Prompts of 12 tokens and 24 steps after: past the
window. Checks:

- plain step (``CompiledDecodeStep``, traced and built per step): greedy tokens equal, teacher-forced
  logits within :data:`ATOL` and the same argmax at every step;
- paged step (``CompiledPagedDecodeStep``), B=6 rows of different lengths: the paged kernel (CPU, or
  CUDA on an NVIDIA GPU) and the gather path within :data:`ATOL` of the eager graph's logits, same argmax, every step;
- the cap is really applied: the same steps with ``attn_softcap`` set to 0 move the logits by far more
  than :data:`ATOL` (the cap binds on these weights), so a step that ignored it would fail the above.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from families import hf_setup
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine.batch import DecodeBatch
from mlx_infer.generation.bindings.decode_step import CompiledDecodeStep
from mlx_infer.generation.bindings.graph_spec import DecodePolicy, graph_spec
from mlx_infer.generation.bindings.paged_decode_step import CompiledPagedDecodeStep, PagedDecodePolicy
from mlx_infer.state.paged import PagedKVStore

# Float32, logits up to ~3 (the final cap). Measured on CPU (mlx 0.32.4) max |step - eager| over 24
# steps: plain step <= 1.1e-6 (gemma2) and <= 4.3e-6 (untied_global on the CPU kernels, whose uncapped
# step runs the fused SDPA kernel where the eager graph composes its ops; 0.0 on stock kernels); paged
# kernel <= 5.5e-6, gather 0.0. Summation order only, ~20x under the bound.
ATOL = 1e-4
UNCAPPED_MIN = 0.1  # the least the logits move when the step drops the attention cap (measured 1.9 / 0.64)
STEPS = 24
PROMPT = [5, 17, 33, 2, 100, 7, 9, 11, 40, 41, 42, 43]  # 12 tokens > the window of 8
NAMES = ["gemma2", "gemma2_untied_global"]
ON_CPU = mx.default_device() == mx.cpu
KERNELS = [False, True] if ON_CPU else [False]  # mlx-infer's CPU kernels exist on the CPU only
KERNEL_BACKEND = "cpu" if ON_CPU else "cuda"  # the paged kernel this run's device has (no Metal kernel)

_LOADED: dict[tuple[str, bool], object] = {}


def model_of(name: str, cpu_kernels: bool = False):
    key = (name, cpu_kernels)
    if key not in _LOADED:
        _LOADED[key] = load_model(hf_setup(name)[0], cpu_kernels=cpu_kernels).model
    return _LOADED[key]


def without_attn_cap(model, monkeypatch) -> None:
    """The model's decode switches with the attention cap dropped (what a step ignoring it would run)."""
    monkeypatch.setattr(model, "decode_switches", lambda: {"attn_softcap": 0.0}, raising=False)


def run_plain(model, forced: mx.array, step: CompiledDecodeStep | None):
    cache = model.make_cache()
    tokens = mx.array([PROMPT], mx.uint32)
    model.model(tokens[:, :-1], cache=cache)
    y = tokens[0, -1:]
    toks, logits = [], []
    for i in range(STEPS):
        out = model(y.reshape(1, 1), cache=cache)[:, -1, :] if step is None else step.step(y, cache)
        logits.append(out)
        toks.append(int(mx.argmax(out, axis=-1).item()))
        y = forced[i:i + 1] if forced is not None else mx.argmax(out, axis=-1)
    return toks, logits


def max_diff(a: list[mx.array], b: list[mx.array]) -> float:
    return max(mx.abs(x - y).max().item() for x, y in zip(a, b))


def test_spec_carries_both_caps():
    cfg, _, _ = graph_spec(model_of("gemma2"))
    assert cfg.attn_softcap == 5.0 and cfg.final_logit_softcap == 3.0
    assert cfg.windows == [8, 0, 8] and not cfg.clip_f16_residual and cfg.activation == "gelu_tanh"
    assert cfg.embed_scale == 8.0  # sqrt(64), exact
    cfg, weights, _ = graph_spec(model_of("gemma2_untied_global"))
    assert cfg.attn_softcap == 0.0 and cfg.final_logit_softcap is None and "lm_head.weight" in weights


@pytest.mark.parametrize("cpu_kernels", KERNELS, ids=["stock", "cpu"][:len(KERNELS)])
@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "graph"])
@pytest.mark.parametrize("name", NAMES)
def test_plain_step_matches_eager(name, compile_, cpu_kernels):
    assert_plain_step_matches_eager(model_of(name, cpu_kernels), compile_, f"{name} cpu_kernels={cpu_kernels}")


def assert_plain_step_matches_eager(model, compile_: bool, label: str) -> None:
    """The compiled plain step's tokens equal the eager graph's, greedy and teacher-forced, logits within ATOL."""
    policy = DecodePolicy(compile=compile_, compile_min_batch=1)
    for forced in (None, mx.random.randint(3, 300, (STEPS,), key=mx.random.key(7)).astype(mx.uint32)):
        want, want_logits = run_plain(model, forced, None)
        step = CompiledDecodeStep(model, policy=policy)
        got, got_logits = run_plain(model, forced, step)
        assert step.failures == 0
        assert got == want
        diff = max_diff(got_logits, want_logits)
        print(f"{label} compile={compile_} forced={forced is not None}: {diff:.2e}")
        assert diff <= ATOL
    assert len(set(want)) > 3, want  # a near-constant stream would hide a wrong step


def test_plain_step_without_the_cap_differs(monkeypatch):
    model = model_of("gemma2")
    _, want_logits = run_plain(model, None, None)
    without_attn_cap(model, monkeypatch)
    _, got_logits = run_plain(model, None, CompiledDecodeStep(model, policy=DecodePolicy(compile_min_batch=1)))
    assert max_diff(got_logits, want_logits) > UNCAPPED_MIN


def prompts(n: int) -> list[list[int]]:
    return [[(13 * i + 7 * j + i * j) % 290 + 5 for j in range(9 + (i * 5) % 13)] for i in range(n)]


def paged_run(model, mode: str, backend: str | None = None) -> tuple[list[mx.array], PagedKVStore]:
    """Teacher-forced logits of 6 rows through ``mode`` ("eager", or the paged step's "kernel" / "gather")
    and the store after; ``backend``: the attention the step must report (default: the mode's own)."""
    ps = prompts(6)
    store = PagedKVStore.for_model(model, num_pages=200, page_size=4)
    seqs = []
    for p in ps:
        seq = store.add_sequence()
        model.model(mx.array([p[:-1]], mx.uint32), cache=store.make_cache(seq))
        seqs.append(seq)
    batch = DecodeBatch(store, seqs)
    step = None if mode == "eager" else CompiledPagedDecodeStep(
        model, store, batch.group_windows(), policy=PagedDecodePolicy(attention=mode))
    rng = np.random.default_rng(0)
    tokens = mx.array([p[-1] for p in ps], mx.uint32)
    out = []
    for _ in range(STEPS):
        assert batch.reserve()
        logits = model(tokens[:, None], cache=batch.caches)[:, -1, :] if step is None else step.step(tokens, batch)
        batch.commit()
        mx.eval(logits)
        out.append(logits)
        tokens = mx.array(rng.integers(5, 300, size=len(ps)), mx.uint32)
    if step is not None:
        assert step.eager_steps == 0 and step.failures == 0
        want = backend or (KERNEL_BACKEND if mode == "kernel" else "gather")
        assert step.attention_backend == want  # no silent fallback
    return out, store


def paged_logits(model, mode: str) -> list[mx.array]:
    """:func:`paged_run`'s logits."""
    return paged_run(model, mode)[0]


@pytest.mark.parametrize("name", NAMES)
def test_paged_step_kernel_and_gather_match_eager(name):
    assert_paged_step_matches_eager(model_of(name), name)


def assert_paged_step_matches_eager(model, label: str) -> None:
    """The paged step's logits, with the attention kernel and with the gather path, within ATOL of the
    eager paged graph's, same argmax."""
    want = paged_logits(model, "eager")
    for mode in ("kernel", "gather"):
        got = paged_logits(model, mode)
        diff = max_diff(got, want)
        print(f"{label} paged {mode}: {diff:.2e}")
        assert diff <= ATOL
        for g, w in zip(got, want):
            assert mx.array_equal(mx.argmax(g, -1), mx.argmax(w, -1)).item()


def test_paged_step_without_the_cap_differs(monkeypatch):
    model = model_of("gemma2")
    want = paged_logits(model, "eager")
    without_attn_cap(model, monkeypatch)
    for mode in ("kernel", "gather"):
        assert max_diff(paged_logits(model, mode), want) > UNCAPPED_MIN
