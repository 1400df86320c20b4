"""Stop strings across token boundaries, with streaming hold-back; cancellation."""

import threading

import pytest
from tiny import make_tiny_model_dir

from mlx_infer.artifacts.loader import load_model
from mlx_infer.errors import MlxInferError
from mlx_infer.generation.autoregressive import generate, generate_tokens
from mlx_infer.generation.stopping import CancelToken, StopMatcher
from mlx_infer.sampling import SamplingParams


def feed_all(m, pieces):
    out, stopped = [], False
    for p in pieces:
        text, stopped = m.feed(p)
        out.append(text)
        if stopped:
            break
    return out, stopped


def test_stop_string_spanning_several_tokens():
    out, stopped = feed_all(StopMatcher(["<END>"]), ["Hello ", "wor", "ld<", "E", "ND>", "more"])
    assert stopped and "".join(out) == "Hello world"
    assert out == ["Hello ", "wor", "ld", "", ""]  # "<" and "E" were held back, never shown


def test_stop_string_at_the_very_start():
    out, stopped = feed_all(StopMatcher(["###"]), ["##", "#", "after"])
    assert stopped and "".join(out) == ""


def test_partial_match_that_turns_out_not_to_match_is_released():
    m = StopMatcher(["<END>"])
    out, stopped = feed_all(m, ["a<E", "NX", "b"])
    assert not stopped
    assert "".join(out) + m.flush() == "a<ENXb"
    assert out[0] == "a"  # "<E" held back until "NX" ruled the match out


def test_earliest_of_several_stops_wins_and_stop_inside_one_piece():
    out, stopped = feed_all(StopMatcher(["World", "lo W"]), ["Hello World"])
    assert stopped and out == ["Hel"]


def test_no_stops_passes_through():
    assert StopMatcher([]).feed("abc") == ("abc", False)


def test_empty_stop_string_rejected():
    with pytest.raises(MlxInferError, match="non-empty"):
        StopMatcher([""])


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("s") / "llama", "llama"))


def test_generate_stops_on_a_string_and_excludes_it(loaded):
    full = "".join(t.text for t in generate(loaded, "Hello", max_tokens=24))
    assert len(full) > 6
    stop = full[3:6]
    items = list(generate(loaded, "Hello", max_tokens=24, stop=[stop]))
    assert items[-1].finish_reason == "stop"
    assert "".join(t.text for t in items) == full[: full.find(stop)]


def test_cancel_from_another_thread(loaded):
    cancel = CancelToken()
    gen = generate_tokens(loaded.model, loaded.tokenizer.encode("Hello"), max_tokens=200, cancel=cancel)
    seen = []
    for t in gen:
        seen.append(t)
        if t.index == 3:
            threading.Thread(target=cancel.cancel).start()
            threading.Event().wait(0.05)
    assert seen[-1].finish_reason == "cancelled"
    assert gen.stats.finish_reason == "cancelled" and len(seen) < 200


def test_logprobs_reported_when_asked(loaded):
    params = SamplingParams(logprobs=True, top_logprobs=3)
    items = list(generate_tokens(loaded.model, loaded.tokenizer.encode("Hello"), max_tokens=4, sampling=params))
    for t in items:
        assert t.logprob is not None and t.logprob <= 0
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0][0] == t.token  # greedy picks the top one
        assert t.top_logprobs[0][1] == pytest.approx(t.logprob)
    plain = list(generate_tokens(loaded.model, loaded.tokenizer.encode("Hello"), max_tokens=4))
    assert [t.token for t in plain] == [t.token for t in items] and plain[0].logprob is None


def test_penalties_run_unpipelined_and_change_the_continuation(loaded):
    ids = loaded.tokenizer.encode("Hello")
    plain = [t.token for t in generate_tokens(loaded.model, ids, max_tokens=20)]
    penal = [t.token for t in generate_tokens(loaded.model, ids, max_tokens=20,
                                             sampling=SamplingParams(repetition_penalty=5.0, repetition_context_size=0))]
    assert len(set(penal)) >= len(set(plain))
    assert penal != plain or len(set(plain)) == len(plain)
