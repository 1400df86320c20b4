"""The compiled paged step's attention kernel against its gather path, on the step contract.

Oracles: the same step with ``attention="gather"`` (the reference: gathered K/V
and MLX SDPA), the engine's eager paged decode, and a plain (unpaged) forward
of the whole prompt. Tiny random models of each family the paged step covers:
llama, gemma3 (window 8, rows longer than it), qwen3 (q/k norms). Checks:

- teacher-forced decode, B=8 rows of different lengths: kernel logits within
  ``ATOL`` of the gather path's and of the eager graph's, same argmax, every step;
- greedy tokens of the engine with the kernel equal the gather path's;
- compiled rows padded to buckets: steps of 5, 6 and 7 rows trace once (bucket 8)
  and their logits equal the op-by-op step's at the exact row count;
- a prefill chunk of L tokens (L rows sharing one block table, consecutive
  positions) beside a decode row, all written first, then read through the
  tables: each row's logits match the plain forward of its prompt (the chunk's
  tokens see each other causally through their lengths), ``logit_rows``
  returns the asked rows in order.

gemma4's paged step (its KV-owning layers not read by a shared one attend
through the kernel too) is checked in test_paged_decode_step.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer import _fast
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.engine.batch import DecodeBatch
from mlx_infer.generation.bindings.autoregressive import Composition
from mlx_infer.generation.bindings.paged_decode_step import CompiledPagedDecodeStep, PagedDecodePolicy
from mlx_infer.state.paged import PagedKVStore
from test_paged_attention import BACKEND
from tiny import make_tiny_model_dir

# Measured on CPU (mlx 0.32.4, float32 tiny models), max |diff| over 24 teacher-forced steps, B=8:
# kernel vs gather 2.3e-5 / 2.5e-6 / 1.2e-5 (llama / gemma3 / qwen3), kernel vs eager 2.6e-5 /
# 2.5e-6 / 1.1e-5; the chunk rows vs the plain forward 1.2e-5 / 2.1e-6 / 5.2e-6 (kernel) and
# 9.7e-6 / 1.9e-6 / 6.5e-6 (gather). Float32 sums in another order, about 4x under the bound.
ATOL = 1e-4
STEPS = 24
FAMILIES = {"llama": ("llama", {}), "gemma3": ("gemma3", {}), "qwen3": ("llama", {"model_type": "qwen3", "head_dim": 32})}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            family, over = FAMILIES[name]
            cache[name] = load_model(make_tiny_model_dir(tmp_path_factory.mktemp(name), family, **over))
        return cache[name]
    return get


def prompts(n: int) -> list[list[int]]:
    return [[(13 * i + 7 * j + i * j) % 290 + 5 for j in range(4 + (i * 5) % 19)] for i in range(n)]


def prefilled(loaded, ps):
    store = PagedKVStore.for_model(loaded.model, num_pages=200, page_size=4)
    seqs = []
    for p in ps:
        seq = store.add_sequence()
        loaded.model.model(mx.array([p[:-1]], mx.uint32), cache=store.make_cache(seq))
        seqs.append(seq)
    return store, seqs


@pytest.mark.parametrize("name", list(FAMILIES))
def test_kernel_logits_match_gather_and_eager(tiny, name):
    loaded = tiny(name)
    ps = prompts(8)
    runs = {}
    for mode in ("kernel", "gather", "eager"):
        store, seqs = prefilled(loaded, ps)
        batch = DecodeBatch(store, seqs)
        step = None if mode == "eager" else CompiledPagedDecodeStep(
            loaded.model, store, batch.group_windows(), policy=PagedDecodePolicy(attention=mode))
        runs[mode] = (batch, step)
    rng = np.random.default_rng(0)
    tokens = mx.array([p[-1] for p in ps], mx.uint32)
    worst = {"gather": 0.0, "eager": 0.0}
    for i in range(STEPS):
        out = {}
        for mode, (batch, step) in runs.items():
            assert batch.reserve()
            out[mode] = (loaded.model(tokens[:, None], cache=batch.caches)[:, -1, :] if step is None
                         else step.step(tokens, batch))
            batch.commit()
        mx.eval(list(out.values()))
        for ref in worst:
            worst[ref] = max(worst[ref], mx.abs(out["kernel"] - out[ref]).max().item())
            assert mx.array_equal(mx.argmax(out["kernel"], -1), mx.argmax(out[ref], -1)).item(), (ref, i)
        tokens = mx.array(rng.integers(5, 300, size=len(ps)), mx.uint32)
    assert max(worst.values()) <= ATOL, worst
    for mode in ("kernel", "gather"):
        assert runs[mode][1].eager_steps == 0 and runs[mode][1].failures == 0
    assert runs["kernel"][1].attention_backend == BACKEND  # the kernel ran, not the gather fallback
    assert runs["gather"][1].attention_backend == "gather"


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_engine_greedy_tokens_kernel_equal_gather(tiny, name):
    loaded = tiny(name)
    ps = prompts(6)
    got = {}
    for mode in ("kernel", "gather"):
        engine = Engine(loaded, EngineConfig(page_size=4, max_batch=8), composition=Composition(compiled_decode=True),
                        decode_policy=PagedDecodePolicy(attention=mode))
        hs = [engine.submit(EngineRequest(prompt_ids=p, max_tokens=32, ignore_eos=True, detokenize=False)) for p in ps]
        engine.run_until_idle()
        got[mode] = [h.result(timeout=0).token_ids for h in hs]
        assert engine.paged_decode is not None and engine.paged_decode.eager_steps == 0
        engine.stop()
    assert got["kernel"] == got["gather"]


def test_padded_rows_trace_once_per_bucket_and_match_exact_rows(tiny):
    loaded = tiny("gemma3")
    ps = prompts(7)
    (store_c, seqs_c), (store_r, seqs_r) = prefilled(loaded, ps), prefilled(loaded, ps)
    groups = DecodeBatch.windows_of(store_c)
    padded = CompiledPagedDecodeStep(loaded.model, store_c, groups)
    exact = CompiledPagedDecodeStep(loaded.model, store_r, groups, policy=PagedDecodePolicy(compile=False))
    for n in (5, 6, 7):
        tokens = mx.array([p[-1] for p in ps[:n]], mx.uint32)
        out = []
        for step, store, seqs in ((padded, store_c, seqs_c), (exact, store_r, seqs_r)):
            batch = DecodeBatch(store, seqs[:n])
            assert batch.reserve()
            out.append(step.step(tokens, batch))
            batch.commit()
        mx.eval(out)
        assert out[0].shape == out[1].shape == (n, out[1].shape[1])
        assert mx.abs(out[0] - out[1]).max().item() <= ATOL
    assert padded.traces == 1 and padded.eager_steps == 0  # 5, 6, 7 rows: one bucket of 8


def _chunk_inputs(store, seqs, chunk_lens):
    """The step contract for rows: seq i contributes chunk_lens[i] consecutive tokens."""
    P = store.page_size
    reserved = [store.pages.append(s.seq_id, n) for s, n in zip(seqs, chunk_lens)]
    positions = np.concatenate([np.arange(s.offsets[0], s.offsets[0] + n) for s, n in zip(seqs, chunk_lens)])
    groups = []
    for w in DecodeBatch.windows_of(store):
        g = store.group_of_window(w)
        tabs = [store.pages.block_table(s.seq_id, g) for s in seqs]
        T = max(map(len, tabs))
        table = np.zeros((len(positions), T), np.int32)
        slots = []
        row = 0
        for s, n, t, res in zip(seqs, chunk_lens, tabs, reserved):
            assert not res[g].copies
            table[row:row + n, :len(t)] = t  # a chunk's rows share its table
            slots += list(res[g].slots)
            row += n
        groups.append((mx.array(table), mx.array(positions + 1, mx.int32), mx.array(slots, mx.int32)))
    assert all(np.array(g[2]).max() // P < store.pages.pool(0).num_pages for g in groups)
    return mx.array(positions, mx.int32), groups


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("mode", ["kernel", "gather"])
def test_prefill_chunk_rows_attend_causally_through_tables(tiny, name, mode):
    loaded = tiny(name)
    a, b = prompts(4)[3], prompts(4)[2]  # 19 and 14 tokens: past gemma3's window of 8
    L = 6
    store = PagedKVStore.for_model(loaded.model, num_pages=200, page_size=4)
    sa, sb = store.add_sequence(), store.add_sequence()
    loaded.model.model(mx.array([a[:-L]], mx.uint32), cache=store.make_cache(sa))  # cached: a[:-L]
    loaded.model.model(mx.array([b[:-1]], mx.uint32), cache=store.make_cache(sb))  # cached: b[:-1]
    step = CompiledPagedDecodeStep(loaded.model, store, DecodeBatch.windows_of(store),
                                   policy=PagedDecodePolicy(attention=mode))
    positions, groups = _chunk_inputs(store, [sa, sb], [L, 1])
    tokens = mx.array(a[-L:] + b[-1:], mx.uint32)  # R = L + 1 rows
    rows = mx.array([L, *range(L)], mx.int32)  # the decode row first, then the chunk's rows
    keys = [s.keys[0] for s in store.storage]
    values = [s.values[0] for s in store.storage]
    logits, _, _ = step.native.step(tokens, positions, rows, groups, keys, values)
    want_a = loaded.model(mx.array([a], mx.uint32))[0, -L:]  # (L, vocab), plain causal forward
    want_b = loaded.model(mx.array([b], mx.uint32))[0, -1:]
    want = mx.concatenate([want_b, want_a], 0)
    mx.eval(logits, want)
    assert logits.shape == want.shape
    diff = mx.abs(logits - want).max().item()
    assert diff <= ATOL, diff
    assert mx.array_equal(mx.argmax(logits, -1), mx.argmax(want, -1)).item()


def test_group_window_mismatch_and_attention_choice_are_refused(tiny):
    from mlx_infer import _fast
    from mlx_infer.generation.bindings.graph_spec import DecodePolicy, graph_spec

    loaded = tiny("gemma3")
    cfg, weights, quant = graph_spec(loaded.model, policy=DecodePolicy(compile=False))
    paged = _fast.PagedDecodeConfig()
    paged.layer_groups = [0] * cfg.num_layers  # global and windowed layers in one group
    with pytest.raises(ValueError, match="share layer group"):
        _fast.PagedDecodeStep(cfg, paged, weights, quant)
    paged.layer_groups = [0 if w == 0 else 1 for w in cfg.windows]
    paged.attention = "flash"
    with pytest.raises(ValueError, match="attention must be"):
        _fast.PagedDecodeStep(cfg, paged, weights, quant)


def _mlx_cuda_block_z(d0: int, d1: int, d2: int) -> int:
    """The z extent of the thread block MLX 0.32's CUDA backend gives a (d0, d1, d2) launch
    (``get_block_dims_common`` in mlx/backend/common/utils.cpp, read from its source)."""
    pows, total = [0, 0, 0], 0
    while True:
        before = total
        for axis, dim in enumerate((d0, d1, d2)):
            if dim >= 1 << (pows[axis] + 1):
                pows[axis] += 1
                total += 1
            if total == 10:
                return 1 << pows[2]
        if total == before:
            return 1 << pows[2]


@pytest.mark.parametrize("rows,heads,dims", [(1024, 4, 16), (256, 4, 16), (128, 4, 16), (64, 4, 16),
                                             (512, 32, 16), (2048, 32, 24), (1024, 4, 32), (4096, 32, 128)])
def test_rope_rows_per_call_keeps_cuda_blocks_within_64_in_z(rows, heads, dims):
    # The compiled steps split the rows of a RoPE call where MLX's CUDA kernel would get a block deeper
    # than CUDA's 64 in z (session 6 on the H200: 1,024 chunk rows of a head-dim-16 model were refused,
    # "cudaLaunchKernelExC ... invalid argument", in RoPE::eval_gpu). Every call's block must fit; where
    # the whole batch fits, one call; never a split off CUDA.
    groups = -(-heads // 4)  # MLX's RoPE kernel takes 4 heads per thread
    per = _fast.rope_rows_per_call(rows, heads, 1, dims, cuda=True)
    assert 1 <= per <= rows
    assert _mlx_cuda_block_z(dims // 2, 1, per * groups) <= 64
    if _mlx_cuda_block_z(dims // 2, 1, rows * groups) <= 64:
        assert per == rows
    else:
        assert per < rows and per * groups >= 64  # not needlessly many calls
    assert _fast.rope_rows_per_call(rows, heads, 1, dims, cuda=False) == rows
