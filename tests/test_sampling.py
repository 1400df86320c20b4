"""Sampling policy: parity with mlx-lm 0.32.2, validation, seeds, properties.

Tolerances: every parity comparison is EXACT — the same -inf positions and
bit-equal finite values (``np.array_equal``) — because our processors and
filters compose the same MLX ops as ``mlx_lm.sample_utils`` (theirs are
``mx.compile``d, ours eager; on CPU that gives identical bits). Our order is
mlx-lm's (processors in its order, log-softmax, top_p → min_p → XTC → top_k,
temperature), so the whole chain is compared too; where behaviour differs on
purpose (top_k >= vocab, top_p = 1, XTC's coin from the request key) the test
says so. Statistical tests state their bounds inline.
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
from mlx_lm import sample_utils as su

from mlx_infer.errors import MlxInferError
from mlx_infer.sampling import (
    RequestRNG,
    RNGState,
    SampleOutput,
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

INF = float("inf")


def np_(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def assert_same(ours: mx.array, theirs: mx.array) -> None:
    """Exact: same shape, same -inf mask, bit-equal finite values."""
    a, b = np_(ours), np_(theirs)
    assert a.shape == b.shape
    assert np.array_equal(np.isneginf(a), np.isneginf(b)), "different tokens removed"
    assert np.array_equal(a, b), f"max |diff| {np.nanmax(np.abs(a - b))}"


def logits_cases() -> dict[str, mx.array]:
    """Logits (B, V) for the parity tests, including the edge cases."""
    rng = np.random.default_rng(0)
    normal = rng.normal(0, 3, (3, 97)).astype(np.float32)
    with_inf = normal.copy()
    with_inf[:, ::5] = -INF
    peaked = rng.normal(0, 1, (2, 64)).astype(np.float32)
    peaked[:, 7] += 12.0
    return {
        "normal": mx.array(normal),
        "neg_inf": mx.array(with_inf),
        "all_equal": mx.zeros((2, 50)),
        "peaked": mx.array(peaked),
        "single_token": mx.array([[1.5], [-2.0]]),
        "two_tokens": mx.array([[0.3, 0.2]]),
        "bf16": mx.array(normal[:2, :64]).astype(mx.bfloat16),  # what models emit
    }


CASES = logits_cases()


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


# ---------------------------------------------------------------------------
# logprobs


def test_logprobs_are_processed_log_softmax_before_filters():
    logits = CASES["peaked"]
    params = SamplingParams(temperature=0.5, top_k=2, repetition_penalty=1.5, logprobs=True,
                            top_logprobs=5)
    s = make_sampler(params)
    tok = s(logits, [7, 3], RequestRNG(9))
    out = s.last
    assert isinstance(out, SampleOutput)
    (proc,) = make_logits_processors(params)
    expected = log_softmax(proc(logits, [7, 3]))
    assert_same(out.logprobs, expected)  # exact; no top_k mask, no temperature
    assert np.isfinite(np_(out.logprobs)).all()
    exp = np_(expected)
    order = np.argsort(-exp, axis=-1, kind="stable")[:, :5]
    assert np_(out.top_ids).tolist() == order.tolist()
    assert np.array_equal(np_(out.top_logprobs), np.take_along_axis(exp, order, -1))
    assert np.array_equal(np_(out.token_logprob), np.take_along_axis(exp, np_(tok)[:, None].astype(int), -1)[:, 0])


def test_logprobs_only_when_asked():
    s = make_sampler(SamplingParams(temperature=1.0))
    out = s.step(CASES["normal"], [], RequestRNG(1))
    assert out.logprobs is None and out.top_ids is None and out.token_logprob is None
    s(CASES["normal"], [], RequestRNG(1))
    assert s.last is None
    s2 = make_sampler(SamplingParams(logprobs=True))  # greedy, no alternatives
    out2 = s2.step(CASES["single_token"][0], [])
    assert out2.top_ids is None and out2.token.shape == () and out2.logprobs.shape == (1,)
    assert out2.token_logprob.item() == 0.0


def test_top_logprobs_clamped_to_vocab():
    s = make_sampler(SamplingParams(logprobs=True, top_logprobs=20))
    out = s.step(CASES["two_tokens"], [])
    assert out.top_ids.shape == (1, 2)
    assert np_(out.top_ids).tolist() == [[0, 1]]


# ---------------------------------------------------------------------------
# seeds and RNG state


def draws(rng: RequestRNG, n: int, sampler=None) -> list[int]:
    sampler = sampler or make_sampler(SamplingParams(temperature=1.0))
    logits = mx.zeros((1, 1000))
    return [int(sampler(logits, [], rng).item()) for _ in range(n)]


def test_seed_reproduces():
    assert draws(RequestRNG(42), 20) == draws(RequestRNG(42), 20)


def test_different_seeds_differ():
    assert draws(RequestRNG(1), 20) != draws(RequestRNG(2), 20)


def test_unseeded_picks_fresh_seeds():
    a, b = RequestRNG(), RequestRNG()
    assert not a.explicit and a.seed != b.seed
    assert draws(a, 20) != draws(b, 20)


def test_batch_independence():
    """A request's draws are the same whether or not another request draws in between."""
    sampler = make_sampler(SamplingParams(temperature=1.0, top_p=0.9, xtc_probability=0.5,
                                          xtc_threshold=0.01))
    alone = draws(RequestRNG(7), 15, sampler)
    a, b = RequestRNG(7), RequestRNG(8)
    mixed = []
    for i in range(15):
        mixed += draws(a, 1, sampler)
        draws(b, 1 + i % 3, sampler)
    assert mixed == alone


@pytest.mark.parametrize("k", [0, 1, 5, 600])
def test_rng_state_round_trip(k):
    """Resuming at step k gives the same subsequent keys as an uninterrupted run."""
    full = RequestRNG(99)
    keys = [full.next_key() for _ in range(k + 5)]
    part = RequestRNG(99)
    for _ in range(k):
        part.next_key()
    state = part.state()
    assert state == RNGState(99, k, True)
    for restored in (RequestRNG.from_state(state),
                     RequestRNG.from_state(json.loads(json.dumps(state))),
                     RequestRNG.from_state(state._asdict())):
        assert restored.state() == state
        for want in keys[k:]:
            assert np_(restored.next_key()).tolist() == np_(want).tolist()


def test_rng_state_keeps_server_chosen_seed():
    rng = RequestRNG()
    rng.next_key()
    back = RequestRNG.from_state(rng.state())
    assert back.seed == rng.seed and back.steps == 1 and back.explicit is False
    assert draws(back, 5) == draws(rng, 5)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_rng_rejects_bad_seed(bad):
    with pytest.raises(MlxInferError, match="seed must be a non-negative integer"):
        RequestRNG(bad)
    with pytest.raises(MlxInferError, match="steps must be a non-negative integer"):
        RequestRNG.from_state((1, bad if bad != "3" else -2))


# ---------------------------------------------------------------------------
# temperature statistics


def _freqs(logits_row: np.ndarray, temperature: float, n: int = 4000, seed: int = 11) -> np.ndarray:
    s = make_sampler(SamplingParams(temperature=temperature))
    logits = mx.broadcast_to(mx.array(logits_row[None]), (n, logits_row.size))  # n independent rows
    toks = np_(s(logits, [], RequestRNG(seed))).astype(int)
    return np.bincount(toks, minlength=logits_row.size) / n


def test_temperature_one_matches_softmax():
    """n = 4000 draws; each frequency within 0.03 of softmax (> 5 sigma)."""
    row = np.array([2.0, 1.0, 0.5, 0.0, -1.0], np.float32)
    p = np.exp(row) / np.exp(row).sum()
    assert np.abs(_freqs(row, 1.0) - p).max() < 0.03


def test_low_temperature_concentrates_high_spreads():
    """T=0.1 puts > 99% on the argmax; T=10 is within 0.05 of uniform."""
    row = np.array([2.0, 1.0, 0.5, 0.0, -1.0], np.float32)
    assert _freqs(row, 0.1)[0] > 0.99
    assert np.abs(_freqs(row, 10.0) - 0.2).max() < 0.05
    assert _freqs(row, 0.5)[0] > _freqs(row, 1.0)[0] > _freqs(row, 2.0)[0]


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
