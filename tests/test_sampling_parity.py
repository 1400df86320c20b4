"""Sampling policy: parity with mlx-lm 0.32.2 of the logits processors, the filters and the sampler.

Tolerances: every parity comparison is EXACT — the same -inf positions and
bit-equal finite values (``np.array_equal``) — because our processors and
filters compose the same MLX ops as ``mlx_lm.sample_utils`` (theirs are
``mx.compile``d, ours eager; on CPU that gives identical bits). Our order is
mlx-lm's (processors in its order, log-softmax, top_p → min_p → XTC → top_k,
temperature), so the whole chain is compared too; where behaviour differs on
purpose (top_k >= vocab, top_p = 1, XTC's coin from the request key) the test
says so. Logprobs, seeds and temperature statistics: test_sampling_draws.py;
validation and properties: test_sampling_params.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import sample_utils as su

from mlx_infer.errors import MlxInferError
from mlx_infer.sampling import (
    RequestRNG,
    SamplingParams,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    apply_xtc,
    log_softmax,
    make_filters,
    make_logits_processors,
    make_sampler,
    sample,
)

from sampling_helpers import CASES, assert_same, np_


# ---------------------------------------------------------------------------
# processors vs mlx-lm make_logits_processors


HISTORIES = {
    "empty": [],
    "short_dupes": [3, 3, 1, 0, 3, 1],
    "long": [int(t) for t in np.random.default_rng(1).integers(0, 50, 60)],
}


def run_theirs(procs, logits: mx.array, history: list[int]) -> mx.array:
    x = logits + 0  # mlx-lm writes into its argument
    tokens = mx.array(history, dtype=mx.int32)
    for p in procs:
        x = p(tokens, x)
    return x


def run_ours(procs, logits: mx.array, history: list[int]) -> mx.array:
    for p in procs:
        logits = p(logits, history)
    return logits


PROCESSOR_KWARGS = {
    "logit_bias": dict(logit_bias={0: 2.5, 7: -1.25, 40: 100.0}),
    "repetition": dict(repetition_penalty=1.3),
    "repetition_lt1": dict(repetition_penalty=0.7, repetition_context_size=5),
    "repetition_all": dict(repetition_penalty=1.5, repetition_context_size=0),
    "presence": dict(presence_penalty=0.8),
    "presence_neg": dict(presence_penalty=-0.5, presence_context_size=3),
    "frequency": dict(frequency_penalty=0.4),
    "frequency_all": dict(frequency_penalty=0.25, frequency_context_size=0),
    "all": dict(logit_bias={1: 3.0, 2: -3.0}, repetition_penalty=1.2, repetition_context_size=7,
                presence_penalty=0.3, presence_context_size=11, frequency_penalty=0.6,
                frequency_context_size=0),
}


@pytest.mark.parametrize("history", list(HISTORIES), ids=list(HISTORIES))
@pytest.mark.parametrize("name", list(PROCESSOR_KWARGS))
@pytest.mark.parametrize("case", ["normal", "neg_inf", "all_equal", "bf16"])
def test_processors_match_mlx_lm(name, history, case):
    """Each processor (and the four chained) gives mlx-lm's processed logits exactly.
    A context size of 0 is "whole history" in both (``tokens[-0:]``)."""
    kw = PROCESSOR_KWARGS[name]
    logits = CASES[case]
    hist = [t % logits.shape[-1] for t in HISTORIES[history]]
    ours = make_logits_processors(SamplingParams(**kw))
    theirs = su.make_logits_processors(**kw)
    assert len(ours) == len(theirs)
    before = np_(logits).copy()
    assert_same(run_ours(ours, logits, hist), run_theirs(theirs, logits, hist))
    assert np.array_equal(np_(logits), before), "a processor wrote into its input"


def test_processors_each_use_their_own_window():
    logits = mx.zeros((1, 10))
    hist = [1, 2, 3, 4, 5]
    params = SamplingParams(presence_penalty=1.0, presence_context_size=2,
                            frequency_penalty=10.0, frequency_context_size=4)
    out = np_(run_ours(make_logits_processors(params), logits, hist))[0]
    assert out.tolist() == [0, 0, -10, -10, -11, -11, 0, 0, 0, 0]


def test_processors_accept_mx_history_and_skip_inactive():
    assert make_logits_processors(SamplingParams()) == []
    params = SamplingParams(frequency_penalty=1.0)
    (proc,) = make_logits_processors(params)
    x = CASES["normal"]
    assert_same(proc(x, mx.array([1, 1, 2])), proc(x, [1, 1, 2]))


# ---------------------------------------------------------------------------
# filters vs mlx-lm apply_*


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_matches_mlx_lm(case, top_p):
    lp = log_softmax(CASES[case])
    assert_same(apply_top_p(lp, top_p), su.apply_top_p(lp, top_p))


@pytest.mark.parametrize("case", list(CASES))
def test_top_p_one_is_off(case):
    """top_p = 1 builds no filter, as mlx-lm's ``make_sampler`` (``0 < top_p < 1``).
    Calling ``apply_top_p(x, 1.0)`` directly is not the identity in either: the
    float cumsum can round the least likely tokens' "mass above" up to the total
    (on the "normal" case it drops 2 of 97)."""
    assert make_filters(SamplingParams(top_p=1.0)) == []
    logits = CASES[case]
    mx.random.seed(5)
    theirs = su.make_sampler(temp=1.0, top_p=1.0)(log_softmax(logits))
    ours = make_sampler(SamplingParams(temperature=1.0, top_p=1.0))(logits, [], RequestRNG(5))
    assert np_(ours).tolist() == np_(theirs).tolist()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("min_p,keep", [(0.01, 1), (0.1, 1), (0.5, 3), (1.0, 1), (0.9, 5)])
def test_min_p_matches_mlx_lm(case, min_p, keep):
    lp = log_softmax(CASES[case])
    keep = min(keep, lp.shape[-1])  # mlx-lm's argpartition needs keep <= V; ours clamps
    assert_same(apply_min_p(lp, min_p, keep), su.apply_min_p(lp, min_p, keep))


def test_min_p_zero_is_off_and_keep_clamps_to_vocab():
    assert make_filters(SamplingParams(min_p=0.0)) == []
    lp = log_softmax(CASES["single_token"])
    assert_same(apply_min_p(lp, 0.5, 4), lp)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("top_k", [1, 2, 5, 40])
def test_top_k_matches_mlx_lm(case, top_k):
    lp = log_softmax(CASES[case])
    if top_k >= lp.shape[-1]:
        # mlx-lm raises for top_k >= vocab; here it keeps everything. (Not called:
        # an exception while mx.compile traces leaves MLX's compile state broken,
        # and later compiled mlx-lm calls in the session then fail.)
        assert_same(apply_top_k(lp, top_k), lp)
    else:
        assert_same(apply_top_k(lp, top_k), su.apply_top_k(lp, top_k))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.1, 0.3, 0.5])
@pytest.mark.parametrize("special", [[], [7], [0, 7, 30]])
def test_xtc_matches_mlx_lm(case, threshold, special):
    """xtc_probability = 1 (always applies) so both are deterministic; mlx-lm
    draws its coin from the global RNG, ours from the request's key."""
    lp = log_softmax(CASES[case])
    V = lp.shape[-1]
    special = [t for t in special if t < V]
    removable = None
    if special:
        removable = mx.ones((V,), dtype=mx.bool_)
        removable[mx.array(special)] = False
    theirs = su.apply_xtc(lp, 1.0, threshold, special)
    assert_same(apply_xtc(lp, 1.0, threshold, removable), theirs)
    # And through make_filters (protected ids = EOS + newline).
    (xtc,) = make_filters(SamplingParams(xtc_probability=1.0, xtc_threshold=threshold),
                          protected_token_ids=special)
    assert_same(xtc(lp, None), theirs)


def test_xtc_coin_follows_the_key():
    """With 0 < p < 1 the coin is ``uniform(key) <= p`` (mlx-lm: ``not uniform > p``)."""
    lp = log_softmax(CASES["peaked"] * 0.1)
    for seed in range(20):
        key = mx.random.key(seed)
        u = mx.random.uniform(0, 1, key=key).item()
        out = apply_xtc(lp, 0.5, 0.0, None, key=key)
        full = apply_xtc(lp, 1.0, 0.0, None)
        assert_same(out, full if u <= 0.5 else lp)


@pytest.mark.parametrize("case", ["normal", "neg_inf", "peaked", "all_equal", "single_token"])
def test_filter_chain_matches_mlx_lm(case):
    """The whole chain top_p → min_p → XTC(p=1) → top_k equals mlx-lm's sampler
    chain (same order; mlx-lm's closures are rebuilt here from its apply_*)."""
    params = SamplingParams(temperature=1.0, top_p=0.8, min_p=0.02, min_tokens_to_keep=2,
                            xtc_probability=1.0, xtc_threshold=0.1, top_k=10)
    lp = log_softmax(CASES[case])
    ours = lp
    for f in make_filters(params, protected_token_ids=[0]):
        ours = f(ours, None)
    theirs = su.apply_top_p(lp, 0.8)
    theirs = su.apply_min_p(theirs, 0.02, min(2, lp.shape[-1]))
    theirs = su.apply_xtc(theirs, 1.0, 0.1, [0])
    if 10 < lp.shape[-1]:
        theirs = su.apply_top_k(theirs, 10)
    assert_same(ours, theirs)


# ---------------------------------------------------------------------------
# the sampler vs mlx-lm's generate-step sampling


SAMPLER_CONFIGS = {
    "temp": dict(temperature=0.8),
    "top_p": dict(temperature=1.0, top_p=0.9),
    "min_p": dict(temperature=0.7, min_p=0.05, min_tokens_to_keep=2),
    "top_k": dict(temperature=1.3, top_k=5),
    "all_but_xtc": dict(temperature=0.9, top_p=0.95, min_p=0.01, top_k=20,
                        repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1,
                        logit_bias={5: 1.0}),
}


def _theirs_sampler_kwargs(kw: dict) -> tuple[dict, dict]:
    sampler_keys = {"temperature": "temp", "top_p": "top_p", "min_p": "min_p",
                    "min_tokens_to_keep": "min_tokens_to_keep", "top_k": "top_k"}
    s = {sampler_keys[k]: v for k, v in kw.items() if k in sampler_keys}
    p = {k: v for k, v in kw.items() if k not in sampler_keys}
    return s, p


@pytest.mark.parametrize("name", list(SAMPLER_CONFIGS))
def test_sampler_draws_match_mlx_lm(name):
    """Same seed, same tokens over 8 steps: mlx-lm's global key after
    ``mx.random.seed(s)`` splits exactly like ``RequestRNG(s)``. (XTC is left
    out: its coin draws an extra key from mlx-lm's global state.)"""
    kw = SAMPLER_CONFIGS[name]
    s_kw, p_kw = _theirs_sampler_kwargs(kw)
    their_sampler = su.make_sampler(**s_kw)
    their_procs = su.make_logits_processors(**p_kw)
    ours = make_sampler(SamplingParams(**kw))
    rng = RequestRNG(1234)
    mx.random.seed(1234)
    history = [1, 2, 3]
    gen = np.random.default_rng(5)
    for _ in range(8):
        logits = mx.array(gen.normal(0, 2, (2, 60)).astype(np.float32))
        x = run_theirs(their_procs, logits, history)
        theirs = their_sampler(x - mx.logsumexp(x, axis=-1, keepdims=True))
        tok = ours(logits, history, rng)
        assert np_(tok).tolist() == np_(theirs).tolist()
        history.append(int(tok[0].item()))
    assert rng.steps == 8


@pytest.mark.parametrize("case", ["normal", "neg_inf", "peaked", "all_equal"])
def test_greedy_is_argmax(case):
    logits = CASES[case]
    params = SamplingParams(temperature=0.0, top_k=3, xtc_probability=1.0, xtc_threshold=0.0)
    s = make_sampler(params)
    rng = RequestRNG(0)
    tok = s(logits, [], rng)
    assert np_(tok).tolist() == np_(mx.argmax(logits, axis=-1)).tolist()
    assert np_(tok).tolist() == np_(su.greedy_sampler(log_softmax(logits))).tolist()
    assert rng.steps == 0, "greedy must not consume keys"
    assert s(logits[0], []).shape == ()  # (V,) logits, no rng needed


def test_greedy_uses_processed_logits():
    logits = mx.array([[5.0, 4.0, 0.0]])
    s = make_sampler(SamplingParams(repetition_penalty=2.0))
    assert s(logits, [0]).item() == 1  # 5/2 < 4


def test_sample_function_unchanged():
    """The plain ``sample`` (used by the AR loop) equals a temperature-only Sampler."""
    logits = CASES["normal"]
    a = sample(logits, temperature=0.7, rng=RequestRNG(3))
    b = make_sampler(SamplingParams(temperature=0.7))(logits, [], RequestRNG(3))
    assert np_(a).tolist() == np_(b).tolist()
    assert np_(sample(logits, temperature=0, rng=None)).tolist() == np_(mx.argmax(logits, -1)).tolist()
    with pytest.raises(MlxInferError, match="temperature must be >= 0"):
        sample(logits, temperature=-1.0)


def test_temperature_needs_rng():
    with pytest.raises(MlxInferError, match="needs a RequestRNG"):
        make_sampler(SamplingParams(temperature=1.0))(CASES["normal"], [])
