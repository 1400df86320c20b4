"""Sampling policy: SamplingParams validation (one test per bad value) and
construction, and hypothesis properties of the sampler over random parameters.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
import re

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_infer.errors import MlxInferError
from mlx_infer.sampling import (
    RequestRNG,
    SamplingParams,
    log_softmax,
    make_filters,
    make_sampler,
)

from sampling_helpers import INF, np_


# ---------------------------------------------------------------------------
# validation: one test per bad value


BAD = [
    (dict(temperature=-0.1), r"temperature must be >= 0"),
    (dict(temperature=float("nan")), r"temperature must be a finite number"),
    (dict(temperature=float("inf")), r"temperature must be a finite number"),
    (dict(temperature="1"), r"temperature must be a number"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=-0.2), r"top_p must be in \(0, 1\]"),
    (dict(min_p=-0.01), r"min_p must be in \[0, 1\]"),
    (dict(min_p=1.01), r"min_p must be in \[0, 1\]"),
    (dict(min_tokens_to_keep=0), r"min_tokens_to_keep must be >= 1"),
    (dict(top_k=-1), r"top_k must be >= 0"),
    (dict(top_k=2.5), r"top_k must be an integer"),
    (dict(xtc_threshold=0.6), r"xtc_threshold must be in \[0, 0.5\]"),
    (dict(xtc_threshold=-0.1), r"xtc_threshold must be in \[0, 0.5\]"),
    (dict(xtc_probability=1.1), r"xtc_probability must be in \[0, 1\]"),
    (dict(xtc_probability=-0.5), r"xtc_probability must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be > 0"),
    (dict(repetition_penalty=-1.0), r"repetition_penalty must be > 0"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty must be a finite number"),
    (dict(repetition_context_size=-1), r"repetition_context_size must be >= 0"),
    (dict(presence_context_size=-3), r"presence_context_size must be >= 0"),
    (dict(frequency_context_size=-20), r"frequency_context_size must be >= 0"),
    (dict(presence_penalty=float("nan")), r"presence_penalty must be a finite number"),
    (dict(frequency_penalty=float("-inf")), r"frequency_penalty must be a finite number"),
    (dict(top_logprobs=-1, logprobs=True), r"top_logprobs must be in 0\.\.20"),
    (dict(top_logprobs=21, logprobs=True), r"top_logprobs must be in 0\.\.20"),
    (dict(top_logprobs=3), r"top_logprobs must be 0 unless logprobs=True"),
    (dict(logprobs=1), r"logprobs must be True or False"),
    (dict(seed=-5), r"seed must be a non-negative integer"),
    (dict(seed=1.0), r"seed must be an integer"),
    (dict(logit_bias={-1: 1.0}), r"logit_bias token id must be >= 0"),
    (dict(logit_bias={3: float("nan")}), r"logit_bias\[3\] must be a finite number"),
    (dict(logit_bias={"a": 1.0}), r"logit_bias keys must be token ids"),
    (dict(logit_bias={3: 1.0, "3": 2.0}), r"lists token id 3 twice"),
    (dict(logit_bias=[1, 2]), r"logit_bias must be a mapping"),
]


@pytest.mark.parametrize("kw,msg", BAD, ids=[f"{next(iter(k))}={next(iter(k.values()))!r}" for k, _ in BAD])
def test_validation_rejects(kw, msg):
    with pytest.raises(MlxInferError, match=msg) as err:
        SamplingParams(**kw)
    assert isinstance(err.value, ValueError)
    assert "got" in str(err.value) or "give each id once" in str(err.value)


def test_logit_bias_ids_checked_against_vocab():
    params = SamplingParams(logit_bias={5: 1.0, 10: 1.0})
    params.validate()  # no vocab: nothing to check
    params.validate(11)
    with pytest.raises(MlxInferError, match=re.escape("must be in [0, 10) for this model's vocabulary, got [10]")):
        params.validate(10)
    with pytest.raises(MlxInferError, match=r"\[0, 8\)"):
        make_sampler(params, vocab_size=8)
    s = make_sampler(params)  # vocab unknown: checked on the first call
    with pytest.raises(MlxInferError, match=r"\[0, 6\)"):
        s(mx.zeros((1, 6)), [])


def test_params_are_frozen_keyword_only_hashable_and_copyable():
    p = SamplingParams(temperature=0.5, logit_bias={"7": 1})
    assert p.logit_bias == {7: 1.0}
    with pytest.raises(Exception):
        p.temperature = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        SamplingParams(0.5)  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(temperature=0.5, logit_bias={7: 1.0}))
    assert pickle.loads(pickle.dumps(p)) == p == copy.deepcopy(p)
    assert json.loads(json.dumps(p.to_dict()))["logit_bias"] == [[7, 1.0]]
    assert SamplingParams().greedy and not p.greedy


def test_from_generation_config():
    cfg = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 64, "min_p": None,
           "repetition_penalty": 1.1, "bos_token_id": 2, "eos_token_id": [1, 106]}
    p = SamplingParams.from_generation_config(cfg)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.9, 64, 0.0, 1.1)
    greedy = SamplingParams.from_generation_config({**cfg, "do_sample": False})
    assert greedy.temperature == 0.0 and greedy.top_k == 64
    assert SamplingParams.from_generation_config({"do_sample": False}, temperature=0.3).temperature == 0.3
    o = SamplingParams.from_generation_config(cfg, top_k=None, seed=4, top_p=0.5)
    assert (o.top_k, o.seed, o.top_p) == (64, 4, 0.5)  # None overrides fall through
    assert SamplingParams.from_generation_config({"top_p": 0}).top_p == 1.0
    assert SamplingParams.from_generation_config(None) == SamplingParams()
    with pytest.raises(MlxInferError, match="unknown sampling parameter"):
        SamplingParams.from_generation_config({}, temp=1.0)
    with pytest.raises(MlxInferError, match="top_p must be in"):
        SamplingParams.from_generation_config({"top_p": 3})


# ---------------------------------------------------------------------------
# properties


@st.composite
def sampling_case(draw):
    V = draw(st.integers(1, 48))
    finite = st.floats(-20, 20, allow_nan=False, width=32)
    row = draw(st.lists(st.one_of(finite, finite, finite, st.just(-INF)), min_size=V, max_size=V))
    if all(math.isinf(v) for v in row):
        row[draw(st.integers(0, V - 1))] = draw(finite)
    ids = st.integers(0, V - 1)
    ctx = st.integers(0, 30)
    params = SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.floats(0.05, 3.0))),
        top_p=draw(st.floats(0.01, 1.0)),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
        min_tokens_to_keep=draw(st.integers(1, 5)),
        top_k=draw(st.integers(0, 60)),
        xtc_probability=draw(st.floats(0.0, 1.0)),
        xtc_threshold=draw(st.floats(0.0, 0.5)),
        logit_bias=draw(st.dictionaries(ids, st.floats(-5, 5), max_size=4)),
        repetition_penalty=draw(st.floats(0.5, 2.0)),
        repetition_context_size=draw(ctx),
        presence_penalty=draw(st.floats(-2, 2)),
        presence_context_size=draw(ctx),
        frequency_penalty=draw(st.floats(-2, 2)),
        frequency_context_size=draw(ctx),
        logprobs=draw(st.booleans()),
    )
    history = draw(st.lists(ids, max_size=40))
    eos = draw(st.lists(ids, max_size=2))
    newline = draw(st.lists(ids, max_size=2))
    seed = draw(st.integers(0, 2**31))
    return mx.array([row]), params, history, eos, newline, seed


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sampling_case())
def test_sampled_token_survives_processing_and_filters(case):
    logits, params, history, eos, newline, seed = case
    s = make_sampler(params, eos_token_ids=eos, newline_token_ids=newline)
    rng = RequestRNG(seed)
    view = s.filtered_logprobs(logits, history, RequestRNG.from_state(rng.state()))
    tok = int(s(logits, history, rng).item())
    assert 0 <= tok < logits.shape[-1]
    v = np_(view)[0]
    assert np.isfinite(v[tok]), f"sampled token {tok} has filtered logprob {v[tok]}"
    assert rng.steps == (0 if params.greedy else 1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sampling_case(), st.floats(0.0, 0.5))
def test_xtc_never_removes_eos_or_newline(case, threshold):
    logits, _, _, eos, newline, _ = case
    lp = log_softmax(logits)
    (xtc,) = make_filters(SamplingParams(xtc_probability=1.0, xtc_threshold=threshold),
                          protected_token_ids=list(eos) + list(newline))
    before, after = np_(lp)[0], np_(xtc(lp, None))[0]
    for t in set(eos) | set(newline):
        assert after[t] == before[t]
    assert np.isfinite(after).any(), "XTC removed every token"
