"""The engine's sampling of a step (``engine.rows.sample_rows``) against each row sampled alone.

Greedy constrained rows without processors or logprobs take their token from one argmax over
the batch's masked logits; forced rows take the grammar's token; the others call their own
sampler. Every row must get exactly what its sampler would give it on its own masked row.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.constraints import Constraint, ConstraintState, apply_bitmask
from mlx_infer.engine.rows import sample_rows
from mlx_infer.sampling import RequestRNG, SamplingParams, make_sampler

from structured_schemas import SCHEMAS
from tiny import make_tiny_model_dir

# (temperature, logprobs, repetition_penalty, constrained, advance): a mix of every path
KINDS = [
    (0.0, False, None, False, 0),  # simple
    (0.0, False, None, True, 3),  # greedy constrained: the batched argmax
    (0.0, False, None, True, 0),  # at the object's start: a forced token
    (0.0, True, None, True, 5),  # greedy with logprobs: its own sampler
    (1.0, False, None, True, 2),  # seeded draw, constrained
    (0.0, False, 1.3, True, 4),  # greedy with a processor: its own sampler
    (0.7, True, None, False, 0),  # seeded draw, unconstrained, logprobs
    (0.0, False, None, True, 7),  # greedy constrained again (batched)
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("gemma3"), "gemma3"))


def _state(loaded, i: int, steps: int, rng: np.random.Generator) -> ConstraintState:
    """A matcher of a suite schema, ``steps`` random allowed tokens in (then past a forced span,
    unless ``steps`` is 0: then it stays where the grammar forces the next token)."""
    vocab = loaded.model.args.vocab_size
    names = ["obj_person", "order", "obj_many_fields"]
    st = ConstraintState.create(Constraint.json_schema(SCHEMAS[names[i % 3]]), loaded.tokenizer, vocab,
                                loaded.eos_token_ids)
    for _ in range(steps):
        while st.forced() and not st.done:
            for t in st.forced():
                st.advance(t, forced=True)
        if st.done:
            break
        allowed = np.flatnonzero(np.unpackbits(st.bitmask().view(np.uint8), bitorder="little")[:vocab])
        st.advance(int(rng.choice(allowed)))
    if steps:
        while st.forced() and not st.done:
            for t in st.forced():
                st.advance(t, forced=True)
    return st


def _rows(loaded, states, kinds):
    rows = []
    for i, ((temp, logprobs, pen, _, _), st) in enumerate(zip(kinds, states)):
        p = SamplingParams(temperature=temp, seed=100 + i, logprobs=logprobs, top_logprobs=2 if logprobs else 0,
                           **({"repetition_penalty": pen} if pen else {}))
        sampler = make_sampler(p, eos_token_ids=tuple(loaded.eos_token_ids))
        needs = bool(sampler.processors)
        rows.append(SimpleNamespace(simple=p.greedy and not needs and not logprobs and st is None, constraint=st,
                                    needs_history=needs, all_ids=[3, 5, 7, 5], sampler=sampler,
                                    rng=RequestRNG(p.seed), request=SimpleNamespace(sampling=p)))
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_rows_equal_each_row_alone(tiny, seed):
    vocab = tiny.model.args.vocab_size
    gen = np.random.default_rng(seed)
    kinds = KINDS * 2
    states = [_state(tiny, i, k[4], gen) if k[3] else None for i, k in enumerate(kinds)]
    assert any(s is not None and s.forced() for s in states), "the mix must hold a forced row"
    logits = mx.array(gen.standard_normal((len(kinds), vocab)).astype(np.float32))  # (B, V)
    batch_rows = _rows(tiny, states, kinds)
    assert [r.sampler.argmax_only for r in batch_rows] == [k[0] == 0 and not k[1] and k[2] is None for k in kinds]
    tokens, outs = sample_rows(batch_rows, logits)
    tokens = tokens.tolist()
    alone = _rows(tiny, states, kinds)  # fresh samplers and key sequences, same seeds
    for i, r in enumerate(alone):
        st = r.constraint
        if st is not None and st.forced():
            assert tokens[i] == st.forced()[0] and outs[i].forced
            continue
        row = logits[i:i + 1]  # (1, V)
        if st is not None:
            row = apply_bitmask(row, st.bitmask())
        want = r.sampler.step(row, r.all_ids if r.needs_history else (), r.rng)
        assert tokens[i] == want.token.item(), f"row {i} ({kinds[i]})"
        if batch_rows[i].simple or batch_rows[i].sampler.argmax_only:
            assert outs[i] is None
        else:
            assert not outs[i].forced
            if want.token_logprob is not None:
                assert np.allclose(outs[i].token_logprob.tolist(), want.token_logprob.tolist(), atol=1e-6)
                assert outs[i].top_ids.tolist() == want.top_ids.tolist()
        if st is not None:
            allowed = np.unpackbits(st.bitmask().view(np.uint8), bitorder="little")[:vocab]
            assert allowed[tokens[i]], f"row {i} got a token its grammar refuses"


def test_all_greedy_constrained_one_argmax(tiny):
    """Only simple and argmax-only rows: the result is the masked batch's argmax, no outputs."""
    vocab = tiny.model.args.vocab_size
    gen = np.random.default_rng(7)
    kinds = [(0.0, False, None, i % 2 == 1, 3) for i in range(6)]
    states = [_state(tiny, i, 3, gen) if k[3] else None for i, k in enumerate(kinds)]
    logits = mx.array(gen.standard_normal((6, vocab)).astype(np.float32))  # (B, V)
    tokens, outs = sample_rows(_rows(tiny, states, kinds), logits)
    assert outs == [None] * 6
    for i, st in enumerate(states):
        row = logits[i] if st is None else apply_bitmask(logits[i:i + 1], st.bitmask())[0]
        assert tokens[i].item() == mx.argmax(row).item()


def test_forced_computed_once_per_state(tiny):
    """``forced()`` is cached until the next ``advance``, and follows it."""
    st = ConstraintState.create(Constraint.json_schema(SCHEMAS["obj_many_fields"]), tiny.tokenizer,
                                tiny.model.args.vocab_size, tiny.eos_token_ids)
    first = st.forced()
    assert first and st.forced() is first
    st.advance(first[0], forced=True)
    after = st.forced()
    assert after is not first and after == list(st.matcher.compute_ff_tokens())
