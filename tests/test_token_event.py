"""One event type for ``generate`` and the engine (generation/text_output.py ``TokenEvent``)."""

from __future__ import annotations

import pytest

import mlx_infer.engine as engine_pkg
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineRequest
from mlx_infer.generation import autoregressive
from mlx_infer.generation.autoregressive import generate
from mlx_infer.generation.text_output import TokenEvent
from tiny import make_tiny_model_dir

PROMPT = "The capital of France"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama"))


def test_the_old_names_are_the_one_class():
    assert autoregressive.GeneratedToken is TokenEvent
    assert engine_pkg.TokenEvent is TokenEvent


def _fields(events):
    return [(e.token, e.index, e.text, e.finish_reason) for e in events]


def test_generate_and_engine_events_are_one_type_with_equal_sequences(loaded):
    full = list(generate(loaded, PROMPT, max_tokens=12))
    text = "".join(e.text for e in full)
    stop = text[4:7]  # a string the greedy text is known to contain: the stopped run ends early with "stop"
    assert len(stop) == 3
    stopped = list(generate(loaded, PROMPT, max_tokens=12, stop=[stop]))
    assert full[-1].finish_reason == "length" and stopped[-1].finish_reason == "stop"
    assert len(stopped) < len(full)
    ids = loaded.tokenizer.encode(PROMPT)
    with Engine(loaded) as engine:
        handles = [engine.submit(EngineRequest(prompt_ids=ids, max_tokens=12, request_id="a")),
                   engine.submit(EngineRequest(prompt_ids=ids, max_tokens=12, stop=[stop], request_id="b"))]
        got = [list(h) for h in handles]
    for want, events, rid in zip((full, stopped), got, ("a", "b")):
        assert all(type(e) is TokenEvent for e in want + events)
        assert _fields(events) == _fields(want)
        assert {e.request_id for e in events} == {rid}
        assert {e.request_id for e in want} == {None}


def test_events_are_keyword_only():
    with pytest.raises(TypeError):
        TokenEvent("req", 5, 0)  # type: ignore[misc]  # the engine's old positional order must not misassign
    assert TokenEvent(token=5, index=0).request_id is None
