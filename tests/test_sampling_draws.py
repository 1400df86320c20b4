"""Sampling policy: what a sampler reports and draws — logprobs, seeds and RNG
state, temperature statistics (their bounds stated inline). Parity with mlx-lm:
test_sampling_parity.py.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer.errors import MlxInferError
from mlx_infer.sampling import (
    RequestRNG,
    RNGState,
    SampleOutput,
    SamplingParams,
    log_softmax,
    make_logits_processors,
    make_sampler,
)

from sampling_helpers import CASES, assert_same, np_


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
