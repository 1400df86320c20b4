"""Phi-3's LongRoPE through the compiled decode steps: each row's table picked by its call's end.

Model: tests/families.py's ``phi3_longrope_partial`` (2 layers, head_dim 16 of which 8 rotate,
``original_max_position_embeddings`` 16, short and long factors far apart, attention_factor != 1),
the checkpoint transformers saved, loaded by the loader, float32, on MLX's stock kernels.

Oracle: the eager graph (``layers/rope.py: LongRoPE``): a call whose end (offset + its length) is past
``original`` rotates with the long table, else with the short one. Checks:

- plain step (``CompiledDecodeStep``, traced and op by op): a 12-token prompt and 12 steps after, so
  the rows run at positions 11..22, both sides of 16; greedy tokens equal, teacher-forced logits within
  :data:`ATOL` at every step;
- paged step (``CompiledPagedDecodeStep``, kernel and gather path, traced and op by op): one step of
  decode rows at positions 5, 15 (ends at 16: short) and 16 (long) beside two prefill chunks, one of
  positions 10..19 (straddling 16: every row long, as the eager graph runs the chunk as one call) and
  one of 10..15 (ends at 16: short); every row's logits within ATOL of the eager graph's;
- a LongRoPE spec without its short table, with a long table of the wrong size or without ``original``
  is refused when the step is built;
- the tables matter: a step that never switches (``original`` out of reach) or one that decides a chunk
  row by its own position (``call_ends = positions + 1``) moves the affected rows' logits by more than
  :data:`WRONG_MIN`, so each rule above is really checked.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from families import hf_setup
from mlx_infer import _fast
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine.batch import DecodeBatch
from mlx_infer.generation.bindings.decode_step import CompiledDecodeStep
from mlx_infer.generation.bindings.graph_spec import DecodePolicy, graph_spec
from mlx_infer.generation.bindings.paged_decode_step import CompiledPagedDecodeStep, PagedDecodePolicy
from mlx_infer.layers.rope import LongRoPE
from mlx_infer.state.paged import PagedKVStore

# Float32. Measured on CPU (mlx 0.32.4), max |step - eager|: plain step 0.0 (compiled and op by op);
# paged step <= 2.0e-6 (kernel) and 0.0 (gather): summation order only, far under the bound.
ATOL = 1e-4
WRONG_MIN = 1e-2  # the least a wrong table moves the affected rows' logits (measured 0.36 to 4.9)
NAME = "phi3_longrope_partial"
ORIGINAL = 16
PROMPT = [5, 17, 33, 2, 100, 7, 9, 11, 40, 41, 42, 43]  # 12 tokens: decode rows at positions 11..22
STEPS = 12
#: The paged step's sequences: (tokens already in the pages, tokens this step). Rows in this order.
PAGED_ROWS = [(5, 1), (15, 1), (16, 1), (10, 10), (10, 6)]

_MODEL: list = []


def model_of():
    if not _MODEL:
        _MODEL.append(load_model(hf_setup(NAME)[0]).model)
    return _MODEL[0]


def ropes(model) -> list[LongRoPE]:
    return [layer.self_attn.rope for layer in model.model.layers]


def test_spec_carries_both_tables():
    model = model_of()
    cfg, _, _ = graph_spec(model)
    rope = ropes(model)[0]
    assert isinstance(rope, LongRoPE) and rope.dims == 8 and rope.scale != 1.0
    scale = mx.array(rope.scale, mx.float32).item()  # the spec's float
    assert [(r.dims, r.original, r.mscale, r.base) for r in cfg.ropes] == [(8, ORIGINAL, scale, None)] * 2


def test_step_refuses_an_incomplete_longrope_spec():
    model = model_of()
    cfg, weights, quant = graph_spec(model)
    rope = ropes(model)[0]
    paged = _fast.PagedDecodeConfig()
    paged.layer_groups = [0, 0]
    _fast.PagedDecodeStep(cfg, paged, weights, quant)  # the spec as built: accepted
    bad = [
        (dict(base=10000.0, long_freqs=rope._long_freqs, original=ORIGINAL), r"freqs \(the short table\)"),
        (dict(freqs=rope._short_freqs, long_freqs=rope._long_freqs[:2], original=ORIGINAL), "dims / 2"),
        (dict(freqs=rope._short_freqs, long_freqs=rope._long_freqs, original=0), "original"),
    ]
    for fields, match in bad:
        cfg.ropes = [_fast.RopeSpec(dims=8, **fields)] * 2
        with pytest.raises(ValueError, match=match):
            _fast.PagedDecodeStep(cfg, paged, weights, quant)


def run_plain(model, forced: mx.array | None, step: CompiledDecodeStep | None):
    cache = model.make_cache()
    tokens = mx.array([PROMPT], mx.uint32)
    model(tokens[:, :-1], cache=cache)
    y = tokens[0, -1:]
    toks, logits = [], []
    for i in range(STEPS):
        out = model(y.reshape(1, 1), cache=cache)[:, -1, :] if step is None else step.step(y, cache)  # (1, V)
        logits.append(out)
        toks.append(int(mx.argmax(out, axis=-1).item()))
        y = forced[i:i + 1] if forced is not None else mx.argmax(out, axis=-1)
    return toks, logits


def diffs(a: list[mx.array], b: list[mx.array]) -> list[float]:
    return [mx.abs(x - y).max().item() for x, y in zip(a, b)]


@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "graph"])
def test_plain_step_matches_eager_across_original(compile_):
    model = model_of()
    policy = DecodePolicy(compile=compile_, compile_min_batch=1)
    assert len(PROMPT) - 1 < ORIGINAL <= len(PROMPT) - 1 + STEPS - 2  # rows on both sides of it
    for forced in (None, mx.random.randint(3, 300, (STEPS,), key=mx.random.key(3)).astype(mx.uint32)):
        want, want_logits = run_plain(model, forced, None)
        step = CompiledDecodeStep(model, policy=policy)
        got, got_logits = run_plain(model, forced, step)
        assert step.failures == 0  # no fallback to the eager graph
        assert got == want
        d = diffs(got_logits, want_logits)
        print(f"plain compile={compile_} forced={forced is not None}: {max(d):.2e}")
        assert max(d) <= ATOL
    assert len(set(want)) > 3, want  # a near-constant stream would hide a wrong step


def test_plain_step_that_never_switches_differs(monkeypatch):
    model = model_of()
    _, want_logits = run_plain(model, None, None)
    for rope in ropes(model):  # the spec reads original when the step is built
        monkeypatch.setattr(rope, "original", 10 ** 6)
    step = CompiledDecodeStep(model, policy=DecodePolicy(compile_min_batch=1))
    monkeypatch.undo()
    _, got_logits = run_plain(model, None, step)
    d = diffs(got_logits, want_logits)
    short = ORIGINAL - (len(PROMPT) - 1)  # steps before this one end within original
    assert max(d[:short]) <= ATOL and min(d[short:]) > WRONG_MIN, d


def sequence(i: int, n: int) -> list[int]:
    return [(13 * i + 7 * j + i * j) % 290 + 5 for j in range(n)]


def eager_rows(model) -> mx.array:
    """``(R, V)``: each sequence's new tokens run eagerly as one call over a plain cache, in row order."""
    out = []
    for i, (have, n) in enumerate(PAGED_ROWS):
        ids = mx.array([sequence(i, have + n)], mx.uint32)
        cache = model.make_cache()
        model(ids[:, :have], cache=cache)
        out.append(model(ids[:, have:], cache=cache)[0])  # (n, V): one call, offset have, end have + n
    return mx.concatenate(out)


def paged_rows(model, policy: PagedDecodePolicy, per_row_ends: bool = False) -> mx.array:
    """``(R, V)``: the same rows as one step of the compiled paged step (the chunks' rows beside the decode rows)."""
    store = PagedKVStore.for_model(model, num_pages=64, page_size=4)
    seqs, tokens = [], []
    for i, (have, n) in enumerate(PAGED_ROWS):
        ids = sequence(i, have + n)
        seq = store.add_sequence()
        model.model(mx.array([ids[:have]], mx.uint32), cache=store.make_cache(seq))
        seqs.append(seq)
        tokens += ids[have:]
    batch = DecodeBatch(store, seqs, [n for _, n in PAGED_ROWS])
    step = CompiledPagedDecodeStep(model, store, batch.group_windows(), policy=policy)
    assert batch.reserve()
    assert batch.offset.tolist() == [have + j for have, n in PAGED_ROWS for j in range(n)]
    assert batch.call_ends.tolist() == [have + n for have, n in PAGED_ROWS for _ in range(n)]  # a chunk's end
    if per_row_ends:  # the wrong rule: every row a call of its own
        batch.call_ends = batch.offset + 1
    logits = step.step(mx.array(tokens, mx.uint32), batch)  # (R, V)
    batch.commit()
    mx.eval(logits)
    assert step.eager_steps == 0 and step.failures == 0
    return logits


@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "graph"])
@pytest.mark.parametrize("attention", ["kernel", "gather"])
def test_paged_step_matches_eager_with_a_chunk_across_original(attention, compile_):
    model = model_of()
    want = eager_rows(model)
    got = paged_rows(model, PagedDecodePolicy(attention=attention, compile=compile_))
    assert got.shape == want.shape == (sum(n for _, n in PAGED_ROWS), want.shape[-1])
    diff = mx.abs(got - want).max().item()
    print(f"paged {attention} compile={compile_}: {diff:.2e}")
    assert diff <= ATOL


def test_paged_step_deciding_chunk_rows_by_their_own_position_differs():
    model = model_of()
    want = eager_rows(model)
    got = paged_rows(model, PagedDecodePolicy(), per_row_ends=True)
    row_diffs = mx.abs(got - want).max(axis=-1).tolist()  # (R,)
    # Rows 3..12 are the straddling chunk: its positions 10..15 (rows 3..8), whose own ends (11..16) are within
    # original, rotate with the wrong table (and rows 9..12 attend their keys); the other rows are untouched.
    chunk = range(3, 13)
    assert all(row_diffs[r] > WRONG_MIN for r in range(3, 3 + ORIGINAL - 10)), row_diffs
    assert all(d <= ATOL for r, d in enumerate(row_diffs) if r not in chunk), row_diffs
